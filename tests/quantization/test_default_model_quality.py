"""The default model (SmolLM2-135M-Instruct, GGUF Q4_1) under int8 / int4 against bf16.

One bf16 build per module; the quantized models are copies quantized in place. Perplexity is
computed from the prompt logprobs of a fixed text (one causal forward, no KV cache); greedy
continuations are recomputed token by token. Measured on this machine (torch 2.13, CPU):
- perplexity: bf16 19.16, int8 19.23 (+0.4%), int4 (group 32) 19.21 (+0.3%); int4-g128 would
  be 29.8 (+55%): re-quantizing a 4-bit checkpoint onto coarser groups hurts, see the docs.
- greedy, 8 prompts x 16 tokens: int8 gives 5/8 identical continuations and 125/128 identical
  next tokens given bf16's prefix (fp32 vs bf16, for scale: 6/8 and 126/128); int4 7/8, 128/128.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from pagellm.forward_context import set_forward_context
from pagellm.layers.quantization import quantize_model

TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined several existing technologies into a single machine. Before his invention, books "
    "were copied by hand, a slow and expensive process that kept written knowledge in the hands "
    "of a few. Movable metal type, oil-based ink and a screw press adapted from wine making "
    "allowed a small workshop to produce hundreds of identical pages in a day. Within fifty "
    "years, printing shops had spread to more than two hundred cities across Europe, and "
    "millions of books were in circulation. The effects reached far beyond the workshop. "
    "Scholars could compare the same text in different cities, errors could be corrected in "
    "later editions, and new ideas travelled faster than ever before. Pamphlets and newspapers "
    "gave ordinary people access to news and arguments, and rising literacy changed how "
    "societies governed themselves. Historians still debate which of these changes matter most, "
    "but few doubt that the printing press was one of the most important inventions of its age.\n"
)
PROMPTS = [
    "The capital of France is", "Write a haiku about the sea:", "def fibonacci(n):",
    "Once upon a time, in a small village,", "The three primary colors are",
    "To make a cup of tea, first", "Water boils at a temperature of",
    "The largest planet in our solar system is",
]
NUM_TOKENS = 16
# Stated bounds (measured values in the module docstring).
MAX_PPL_RISE = {"int8": 0.02, "int4": 0.05}


@pytest.fixture(scope="module")
def setup():
    from pagellm.models.loader import (
        build_model,
        load_hf_config,
        load_tokenizer,
        resolve_model_source,
    )

    try:
        src = resolve_model_source(None)
    except ValueError as e:
        pytest.skip(str(e))
    # One thread: on a shared, oversubscribed machine OpenMP's spinning threads made each small
    # forward cost ~1 s of CPU instead of ~0.1 s.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    tok = load_tokenizer(src)
    base = build_model(load_hf_config(src), src, torch.bfloat16, torch.device("cpu"))
    models = {"bf16": base}
    for spec in ("int8", "int4"):
        models[spec] = copy.deepcopy(base)
        quantize_model(models[spec], spec)
    yield tok, models
    torch.set_num_threads(threads)


@torch.inference_mode()
def _logits(model, ids: list[int]) -> torch.Tensor:
    with set_forward_context(None, []):
        return model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids))))


def _perplexity(model, ids: list[int]) -> float:
    logprobs = torch.log_softmax(_logits(model, ids)[:-1], dim=-1)
    token_lp = logprobs.gather(1, torch.tensor(ids[1:])[:, None])
    return math.exp(-float(token_lp.mean()))


def test_perplexity_rises_less_than_bound(setup) -> None:
    tok, models = setup
    ids = tok(TEXT)["input_ids"]
    assert len(ids) > 150
    ppl = {name: _perplexity(m, ids) for name, m in models.items()}
    assert ppl["bf16"] < 30, ppl  # the model really reads the text
    for spec, bound in MAX_PPL_RISE.items():
        assert ppl[spec] < ppl["bf16"] * (1 + bound), ppl
        assert ppl[spec] != ppl["bf16"], ppl  # the weights really changed


def _greedy(model, prompt_ids: list[int]) -> list[int]:
    ids = list(prompt_ids)
    for _ in range(NUM_TOKENS):
        ids.append(int(_logits(model, ids)[-1].argmax()))
    return ids[len(prompt_ids):]


def _teacher_forced_agreement(model, prompt_ids: list[int], continuation: list[int]) -> int:
    """Next tokens that equal ``continuation`` when ``model`` is given its prefix."""
    logits = _logits(model, prompt_ids + continuation)
    pred = logits[len(prompt_ids) - 1 : -1].argmax(-1).tolist()
    return sum(a == b for a, b in zip(pred, continuation, strict=True))


def test_greedy_output_agrees_with_bf16(setup) -> None:
    tok, models = setup
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    ref = [_greedy(models["bf16"], p) for p in prompts]
    int8 = [_greedy(models["int8"], p) for p in prompts]
    identical = sum(a == b for a, b in zip(ref, int8, strict=True))
    total = NUM_TOKENS * len(prompts)
    forced = {spec: sum(_teacher_forced_agreement(models[spec], p, r)
                        for p, r in zip(prompts, ref, strict=True)) for spec in ("int8", "int4")}
    # Measured: 5/8 identical continuations, 125/128 and 128/128 next tokens (see docstring).
    assert identical >= 4, (identical, ref, int8)
    assert forced["int8"] >= 0.93 * total, forced
    assert forced["int4"] >= 0.93 * total, forced
