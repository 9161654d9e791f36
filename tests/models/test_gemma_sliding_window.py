"""Sliding-window families against transformers on tiny random-weight checkpoints, over a prompt
(62 tokens) and generation longer than the window (16): Mistral with ``sliding_window``, Qwen2
with ``use_sliding_window`` past ``max_window_layers``, Gemma 2 (alternating local/global
layers, query_pre_attn_scalar, attention and final logit soft-capping, four norms, GeGLU,
scaled embeddings, tied head) and Gemma 3 text (q/k norms, layer_types, a local and a global
rotary table, linear rope scaling on global layers)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_compare import PROMPT, check_against_hf, ours, reference
from paged_harness import PagedHarness
from sliding_window_models import (
    SLIDING_ARCHS,
    WINDOW,
    sliding_config,
    write_sliding_model,
)
from tiny_tokenizer import build_test_tokenizer

from pagellm.attention import registry
from pagellm.models.llama_cpu_fused import enable_fused_cpu_forward

ARCHS = SLIDING_ARCHS


@pytest.fixture(scope="module")
def sliding_model_dir(tmp_path_factory):
    cache: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in cache:
            cache[arch] = write_sliding_model(tmp_path_factory.mktemp(f"sliding-{arch}"), arch)
        return cache[arch]

    return get


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("arch", ARCHS)
def test_matches_transformers_past_the_window(sliding_model_dir, arch, backend):
    path = sliding_model_dir(arch)
    ids = build_test_tokenizer()(PROMPT).input_ids
    assert len(ids) > 3 * WINDOW
    registry.set_default_backend(backend)
    try:
        model = ours(path)
        windows = model.layer_windows
        assert WINDOW in windows
        if arch in ("qwen2", "gemma2", "gemma3"):
            assert None in windows  # hybrid: global layers too
        check_against_hf(model, reference(path), ids)
    finally:
        registry.set_default_backend("auto")


def test_window_changes_the_output(sliding_model_dir):
    """The same Mistral weights with the window off give other logits past the window (so the
    test above could fail if the window were ignored)."""
    from hf_compare import hf_tokens_and_logits

    path = sliding_model_dir("mistral")
    ids = build_test_tokenizer()(PROMPT).input_ids
    _, windowed = hf_tokens_and_logits(reference(path), ids, 1)
    model = ours(path)
    for layer in model.model.layers:
        layer.self_attn.attn.sliding_window = None
    full = PagedHarness(model, block_size=16).step([("a", ids)], all_logits=True)
    assert (windowed[WINDOW:] - full[WINDOW:]).abs().max() > 1e-3
    torch.testing.assert_close(windowed[:WINDOW], full[:WINDOW], atol=1e-4, rtol=0)


def test_windowed_llama_layout_skips_the_fused_cpu_step(sliding_model_dir):
    from pagellm.layers.linear import prepack_linears_for_cpu

    model = ours(sliding_model_dir("mistral"))
    prepack_linears_for_cpu(model)
    assert enable_fused_cpu_forward(model) == 0


def test_gemma_layer_types_and_windows():
    from pagellm.models.gemma2 import Gemma2ForCausalLM
    from pagellm.models.gemma3 import Gemma3ForCausalLM

    g2 = sliding_config("gemma2")
    assert Gemma2ForCausalLM.layer_sliding_windows(g2) == [WINDOW, None, WINDOW, None]
    g3 = sliding_config("gemma3")
    assert Gemma3ForCausalLM.layer_sliding_windows(g3) == [WINDOW, WINDOW, None, WINDOW]
    # Without layer_types: Gemma 2 alternates, Gemma 3 makes every 6th layer global.
    from types import SimpleNamespace

    bare = SimpleNamespace(num_hidden_layers=6, sliding_window=8, layer_types=None)
    assert Gemma2ForCausalLM.layer_sliding_windows(bare) == [8, None] * 3
    assert Gemma3ForCausalLM.layer_sliding_windows(bare) == [8] * 5 + [None]


def test_tp2_matches_tp1_gemma(tmp_path, sliding_model_dir):
    """Head-split attention with soft-capping and windows, replicated Gemma norms (q/k norms in
    Gemma 3), the tied head over a split vocabulary: 2 ranks give the unsharded logits."""
    from test_tensor_parallel import _run_tp2

    _run_tp2(tmp_path, [str(sliding_model_dir("gemma2")), str(sliding_model_dir("gemma3"))])
