"""--max-model-len past the model's max_position_embeddings (PAGELLM_ALLOW_LONG_MAX_MODEL_LEN):
the rotary table must reach every position the scheduler hands out. Without it the CPU rotary
kernel turns positions past the table into NaN, the torch path raises IndexError and Triton
reads past the table. Greedy tokens past position 64 must have finite logprobs and be the same on
the torch attention backend (with rotary's torch path, then its CPU kernel), the cpu backend
(and its fused path) and in transformers, which computes rotary angles on the fly."""

from __future__ import annotations

import math

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.attention import registry
from pagellm.config import read_env
from pagellm.kernels import cpu_ops

MAX_POS, MAX_MODEL_LEN = 64, 128
PROMPT_LEN, NEW_TOKENS = 40, 60  # the last tokens sit at positions ~100


@pytest.fixture(scope="module")
def long_model(tmp_path_factory, make_tiny_model):
    return make_tiny_model(tmp_path_factory.mktemp("long-ctx"), "llama",
                           max_position_embeddings=MAX_POS)


def _generate(path, backend: str, prompt: list[int]) -> tuple[list[int], list[float]]:
    llm = LLM(model=str(path), dtype="float32", kv_cache_memory="16MiB",
              max_model_len=MAX_MODEL_LEN, attention_backend=backend)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
    logprobs = [lp.logprob for step in out.logprobs for lp in step.values()]
    registry.set_default_backend("auto")  # the engine leaves its choice as the default
    return list(out.token_ids), logprobs


def test_generation_past_max_position_embeddings(long_model, monkeypatch) -> None:
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("PAGELLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 300, (PROMPT_LEN,), generator=g).tolist()

    with monkeypatch.context() as m:
        m.setattr(cpu_ops, "supports", lambda *tensors: False)  # rotary's torch path too
        plain_tokens, plain_lps = _generate(long_model, "torch", prompt)
    torch_tokens, torch_lps = _generate(long_model, "torch", prompt)  # CPU rotary kernel
    fused_calls = 0
    real = cpu_ops.llama_forward

    def spy(*args):
        nonlocal fused_calls
        fused_calls += 1
        return real(*args)

    monkeypatch.setattr(cpu_ops, "llama_forward", spy)
    cpu_tokens, cpu_lps = _generate(long_model, "cpu", prompt)

    assert len(torch_tokens) == NEW_TOKENS and PROMPT_LEN + NEW_TOKENS > MAX_POS
    assert all(math.isfinite(x) for x in plain_lps + torch_lps + cpu_lps)
    assert plain_tokens == torch_tokens == cpu_tokens
    for a, b, c in zip(plain_lps, torch_lps, cpu_lps, strict=True):
        assert a == pytest.approx(b, abs=1e-3) and a == pytest.approx(c, abs=1e-3)
    if read_env().fused_cpu and cpu_ops.linear_packed_supports(torch.empty(16, 32)):
        assert fused_calls > 0  # the fused CPU path took the steps past position 64

    ref = AutoModelForCausalLM.from_pretrained(long_model, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        expect = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                              do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch_tokens == expect[0, PROMPT_LEN:].tolist()
