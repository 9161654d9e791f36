"""Speculative decoding (n-gram) on the real default model: a copy-heavy chat gives the same
greedy tokens as without it, and most drafts are accepted."""

from __future__ import annotations

from pagellm import LLM, SamplingParams

TEXT = ("Paged attention stores the keys and values of every sequence in fixed-size blocks. "
        "A block table maps each sequence to its blocks, so memory is allocated on demand and "
        "shared prefixes are stored once.")
MESSAGES = [{"role": "user", "content": f"Repeat this text exactly, word for word:\n\n{TEXT}"}]


def test_copy_task_identical_with_drafts_accepted(default_llm) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=48)
    want = default_llm.chat(MESSAGES, params)[0].outputs[0]
    spec = LLM(dtype="float32", kv_cache_memory="512MiB", max_model_len=2048, seed=0,
               speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                   "prompt_lookup_min": 2, "prompt_lookup_max": 4})
    got = spec.chat(MESSAGES, params)[0].outputs[0]
    assert got.token_ids == want.token_ids and got.text == want.text
    stats = spec.llm_engine.engine_core.make_stats().spec_decoding
    # The model copies the text: most steps verify drafts and accept some.
    assert stats.num_drafts > 0
    assert stats.num_accepted_tokens > 0.5 * stats.num_draft_tokens, stats
