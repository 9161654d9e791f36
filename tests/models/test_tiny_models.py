"""Tiny random Llama / Qwen2 / Mistral checkpoints: our model vs transformers on the same weights.

Prompt logits must match within 1e-4 (fp32); greedy decoding through the paged KV cache (whole
and chunked prefill, mixed batches) must give transformers' greedy tokens.
"""

from __future__ import annotations

import pytest
import torch
from paged_harness import PagedHarness

from pagellm.forward_context import set_forward_context
from pagellm.models.loader import build_model, load_hf_config, resolve_model_source

ARCHS = ["llama", "llama-tied", "llama-rope3", "qwen2", "mistral", "qwen3", "phi3"]
NUM_NEW = 8
PROMPTS = [
    "The quick brown fox jumps over the lazy dog. Hello, world! How are you today?" * 2,
    "def forward(self, x):\n    return x * 2 + 1\n",
    "Paged attention stores keys and values in fixed-size blocks.",
]


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    """``models(arch)`` -> (our model, transformers model, tokenizer), cached per module."""
    from transformers import AutoModelForCausalLM

    from pagellm.models.loader import load_tokenizer

    cache: dict[str, tuple] = {}

    def get(arch: str):
        if arch not in cache:
            path = tiny_model_dir(arch)
            src = resolve_model_source(str(path))
            ours = build_model(load_hf_config(src), src, torch.float32, torch.device("cpu"))
            ref = AutoModelForCausalLM.from_pretrained(
                path, dtype=torch.float32, attn_implementation="eager", local_files_only=True
            ).eval()
            ref.generation_config.eos_token_id = None  # always NUM_NEW tokens, like ours
            cache[arch] = (ours, ref, load_tokenizer(src))
        return cache[arch]

    return get


def _hf_greedy(ref, prompt: list[int], n: int) -> list[int]:
    out = ref.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    assert out.shape[1] == len(prompt) + n
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch", ARCHS)
def test_prompt_logits_match_transformers(models, arch):
    ours, ref, tok = models(arch)
    ids = tok(PROMPTS[0]).input_ids
    assert len(ids) > 40  # longer than llama-rope3's original context (32): scaling matters
    x = torch.tensor(ids)
    with torch.inference_mode():
        expected = ref(x[None]).logits[0].float()
        with set_forward_context(None, []):
            plain = ours.compute_logits(ours(x, torch.arange(len(ids))))
    paged = PagedHarness(ours, block_size=16).step([("a", ids)], all_logits=True)
    assert plain.dtype == torch.float32 and plain.shape == expected.shape
    torch.testing.assert_close(plain, expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(paged, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_decode_through_paged_cache_matches_generate(models, arch):
    ours, ref, tok = models(arch)
    ids = tok(PROMPTS[0]).input_ids
    expected = _hf_greedy(ref, ids, NUM_NEW)
    assert len(set(expected)) > 2  # the tiny model does not just repeat one token
    assert PagedHarness(ours, block_size=16).greedy("a", ids, NUM_NEW) == expected
    # Chunked prefill: chunks of 7 tokens, blocks of 32, so chunks straddle block boundaries.
    assert PagedHarness(ours, block_size=32, seed=1).greedy("a", ids, NUM_NEW, chunk=7) == expected


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_mixed_batch_decode_and_prefill_chunks(models, arch):
    """A decodes while B prefills in chunks and C arrives later: tokens match solo greedy."""
    ours, ref, tok = models(arch)
    prompts = {s: tok(p).input_ids for s, p in zip("ABC", PROMPTS, strict=True)}
    expected = {s: _hf_greedy(ref, p, NUM_NEW) for s, p in prompts.items()}
    first_step = {"A": 0, "B": 0, "C": 2}
    chunk = {"A": 10_000, "B": 6, "C": 10_000}
    fed = dict.fromkeys("ABC", 0)
    generated: dict[str, list[int]] = {s: [] for s in "ABC"}
    harness = PagedHarness(ours, block_size=16)
    step = 0
    while any(len(g) < NUM_NEW for g in generated.values()):
        batch = []
        for s, prompt in prompts.items():
            if step < first_step[s] or len(generated[s]) == NUM_NEW:
                continue
            if fed[s] < len(prompt):
                batch.append((s, prompt[fed[s] : fed[s] + chunk[s]]))
                fed[s] += len(batch[-1][1])
            else:
                batch.append((s, [generated[s][-1]]))
        logits = harness.step(batch)
        for (s, _), row in zip(batch, logits, strict=True):
            if fed[s] == len(prompts[s]):
                generated[s].append(int(row.argmax()))
        step += 1
    assert generated == expected


def test_llama3_rope_scaling_changes_the_output(models, tiny_model_dir):
    """Dropping the rope3 checkpoint's scaling changes the logits (so the tests above bite)."""
    ours, _, tok = models("llama-rope3")
    src = resolve_model_source(str(tiny_model_dir("llama-rope3")))
    config = load_hf_config(src)
    config.rope_parameters = {"rope_type": "default",
                              "rope_theta": config.rope_parameters["rope_theta"]}
    plain_rope = build_model(config, src, torch.float32, torch.device("cpu"))
    x = torch.tensor(tok(PROMPTS[0]).input_ids)
    with torch.inference_mode(), set_forward_context(None, []):
        a = ours.compute_logits(ours(x, torch.arange(len(x))))
        b = plain_rope.compute_logits(plain_rope(x, torch.arange(len(x))))
    assert (a - b).abs().max() > 1e-2


def test_bfloat16_model_tracks_fp32(models, tiny_model_dir):
    ours, _, tok = models("llama")
    src = resolve_model_source(str(tiny_model_dir("llama")))
    bf16 = build_model(load_hf_config(src), src, torch.bfloat16, torch.device("cpu"))
    assert next(bf16.parameters()).dtype == torch.bfloat16
    ids = tok(PROMPTS[0]).input_ids
    a = PagedHarness(ours).step([("a", ids)], all_logits=True)
    b = PagedHarness(bf16).step([("a", ids)], all_logits=True)
    assert b.dtype == torch.float32 and torch.isfinite(b).all()
    assert (a - b).abs().max() < 0.1 * a.abs().max()
