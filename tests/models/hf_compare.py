"""Shared by the model-family tests: our model and transformers' on the same tiny checkpoint,
compared on prompt logits and greedy tokens through the paged harness."""

from __future__ import annotations

import torch
from paged_harness import PagedHarness

from pagellm.models.loader import build_model, load_hf_config, resolve_model_source

NUM_NEW = 8
PROMPT = "The quick brown fox jumps over the lazy dog. Hello, world! How are you today?" * 2


def ours(path, max_model_len: int | None = None) -> torch.nn.Module:
    src = resolve_model_source(str(path))
    return build_model(load_hf_config(src), src, torch.float32, torch.device("cpu"),
                       max_model_len=max_model_len)


def reference(path):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", local_files_only=True).eval()
    ref.generation_config.eos_token_id = None
    return ref


def hf_tokens_and_logits(ref, ids: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens and its prompt logits."""
    with torch.inference_mode():
        logits = ref(torch.tensor([ids])).logits[0].float()
    out = ref.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist(), logits


def check_against_hf(model, ref, ids: list[int]) -> None:
    """Prompt logits within 1e-4 and greedy tokens identical, whole and chunked prefill."""
    expected_tokens, expected_logits = hf_tokens_and_logits(ref, ids, NUM_NEW)
    assert len(set(expected_tokens)) > 2
    logits = PagedHarness(model, block_size=16).step([("a", ids)], all_logits=True)
    torch.testing.assert_close(logits, expected_logits, atol=1e-4, rtol=0)
    assert PagedHarness(model, block_size=16).greedy("a", ids, NUM_NEW) == expected_tokens
    assert PagedHarness(model, block_size=32, seed=1).greedy("a", ids, NUM_NEW,
                                                            chunk=7) == expected_tokens


def check_chunks_beside_a_decode(model, ref, ids: list[int], other: list[int],
                                 chunk: int = 70) -> None:
    """``ids`` prefilled in chunks of ``chunk`` tokens while ``other`` decodes in the same
    batches (a recurrent state carried across chunks beside another's): both sequences' greedy
    tokens identical to transformers'."""
    expected, _ = hf_tokens_and_logits(ref, ids, NUM_NEW)
    expected_other, _ = hf_tokens_and_logits(ref, other, NUM_NEW)
    h = PagedHarness(model, block_size=16, seed=3)
    out_other = [int(h.step([("b", other)])[0].argmax())]
    logits = None
    for i in range(0, len(ids), chunk):
        logits = h.step([("a", ids[i:i + chunk]), ("b", [out_other[-1]])])
        out_other.append(int(logits[1].argmax()))
    out = [int(logits[0].argmax())]
    while len(out) < NUM_NEW:
        logits = h.step([("a", [out[-1]]), ("b", [out_other[-1]])])
        out.append(int(logits[0].argmax()))
        out_other.append(int(logits[1].argmax()))
    assert out == expected
    assert out_other[:NUM_NEW] == expected_other
