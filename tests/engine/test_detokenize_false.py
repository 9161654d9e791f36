"""``SamplingParams(detokenize=False)`` (vLLM's field): outputs carry the token ids only, text
empty, and no decoding work is done; stop strings cannot be used with it."""

from __future__ import annotations

import pytest

from pagellm import LLM, SamplingParams
from pagellm.engine import output_processor

PROMPTS = [{"prompt_token_ids": [5, 17, 42, 99, 7]}, {"prompt_token_ids": [8, 9, 10]}]


def test_token_ids_only(tiny_llama_dir, monkeypatch) -> None:
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", kv_cache_memory="16MiB",
              max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2, n=2)
    want = llm.generate(PROMPTS, params, use_tqdm=False)
    assert all(c.text for o in want for c in o.outputs)

    def no_decoding(*args, **kwargs):
        raise AssertionError("decoded with detokenize=False")

    monkeypatch.setattr(output_processor, "IncrementalDetokenizer", no_decoding)
    monkeypatch.setattr(output_processor, "decode_token", no_decoding)
    got = llm.generate(PROMPTS, params.clone(detokenize=False), use_tqdm=False)
    for g, w in zip(got, want, strict=True):
        for gc, wc in zip(g.outputs, w.outputs, strict=True):
            assert gc.text == ""
            assert gc.token_ids == wc.token_ids
            assert gc.finish_reason == wc.finish_reason == "length"
            assert gc.logprobs is not None and len(gc.logprobs) == len(gc.token_ids)
            assert all(lp.decoded_token is None for e in gc.logprobs for lp in e.values())
            assert [{t: lp.logprob for t, lp in e.items()} for e in gc.logprobs] == \
                [{t: lp.logprob for t, lp in e.items()} for e in wc.logprobs]
    # stop_token_ids still stop a request.
    stop_at = want[0].outputs[0].token_ids[3]
    out = llm.generate(PROMPTS[:1], params.clone(detokenize=False, stop_token_ids=[stop_at],
                                                 n=1, logprobs=None), use_tqdm=False)
    assert out[0].outputs[0].token_ids[-1] == stop_at
    assert out[0].outputs[0].finish_reason == "stop"


def test_stop_strings_refused() -> None:
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(detokenize=False, stop=["\n"])
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(detokenize="no")  # type: ignore[arg-type]
    assert SamplingParams(detokenize=False, stop_token_ids=[2]).stop_token_ids == [2]
