"""Qwen3-Next and Qwen3.5 (hybrid Gated DeltaNet + gated attention) against transformers on
the same tiny random checkpoints: prompt logits within 1e-4 and greedy tokens identical, whole
and chunked prefill (the recurrent state carried in its slot across chunks)."""

from __future__ import annotations

import pytest
from hf_compare import (
    PROMPT,
    check_against_hf,
    check_chunks_beside_a_decode,
    ours,
    reference,
)
from paged_harness import PagedHarness
from tiny_tokenizer import build_test_tokenizer

ARCHS = ["qwen3-next", "qwen3.5", "qwen3.5-moe"]


def _ids(n: int) -> list[int]:
    ids = build_test_tokenizer()(PROMPT * 4)["input_ids"]
    assert len(ids) >= n
    return ids[:n]


@pytest.mark.parametrize("arch", ARCHS)
def test_matches_transformers(tiny_model_dir, arch):
    path = tiny_model_dir(arch)
    check_against_hf(ours(path), reference(path), _ids(150))


@pytest.mark.parametrize("arch", ARCHS)
def test_chunks_across_several_gdn_chunks(tiny_model_dir, arch):
    """A 200-token prompt in chunks of 70 (past the 64-token scan chunk, unaligned), next to
    another sequence decoding in the same batches: tokens identical to transformers'."""
    path = tiny_model_dir(arch)
    check_chunks_beside_a_decode(ours(path), reference(path), _ids(200), _ids(40)[::-1])


def test_layers_and_state_shapes(tiny_model_dir):
    from pagellm.models.loader import load_hf_config, resolve_model_source
    from pagellm.models.qwen3_next import Qwen3NextForCausalLM

    config = load_hf_config(resolve_model_source(str(tiny_model_dir("qwen3-next"))))
    assert Qwen3NextForCausalLM.recurrent_layers(config) == (0, 2)
    # conv over q|k|v: 2*2*16 + 4*16 channels, window 3; state [4 v heads, 16, 16] float32.
    assert Qwen3NextForCausalLM.recurrent_state_shapes(config, 1) == (
        ((128, 3), False), ((4, 16, 16), True))


def test_image_text_checkpoint_serves_its_language_model(tmp_path, make_tiny_config):
    """A Qwen3_5ForConditionalGeneration checkpoint (vision tower + language model under
    ``model.language_model.``): its language model alone, as transformers runs it on text."""
    import torch
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from pagellm.models.loader import load_hf_config, resolve_model_source

    text = make_tiny_config("qwen3.5")
    cfg = Qwen3_5Config(text_config=text.to_dict(), vision_config=dict(
        depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
        patch_size=4, temporal_patch_size=1, spatial_merge_size=1, in_channels=3))
    torch.manual_seed(0)
    ref = Qwen3_5ForConditionalGeneration(cfg).eval()
    ref.save_pretrained(tmp_path, safe_serialization=True)
    build_test_tokenizer().save_pretrained(tmp_path)
    config = load_hf_config(resolve_model_source(str(tmp_path)))
    assert config.architectures == ["Qwen3_5ForConditionalGeneration"]
    assert config.num_hidden_layers == 4  # the language model's config
    ids = _ids(80)
    with torch.inference_mode():
        expected = ref(torch.tensor([ids])).logits[0].float()
    logits = PagedHarness(ours(tmp_path), block_size=16).step([("a", ids)], all_logits=True)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
