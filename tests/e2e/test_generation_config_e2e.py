"""generation_config.json end to end on a tiny model: every EOS id it (and config.json) lists
stops generation, and its sampling defaults apply to requests that leave them unset."""

from __future__ import annotations

import json

import pytest

from pagellm import LLM, SamplingParams

GEN_EOS = [2, 100, 200]  # 2: the tokenizer's <|im_end|>; 100 and 200: extra EOS ids
CONFIG_EOS = [2, 300]  # config.json may list several too
PROMPT = "The quick brown fox"
ENGINE = dict(dtype="float32", kv_cache_memory="16MiB", max_model_len=128, device="cpu")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, make_tiny_model):
    path = make_tiny_model(tmp_path_factory.mktemp("gen-config"), "llama",
                           eos_token_id=CONFIG_EOS)
    (path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": GEN_EOS, "temperature": 0.0, "top_k": 5, "do_sample": False}))
    return path


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return LLM(model=str(model_dir), **ENGINE)


def forced(llm: LLM, token: int, **kwargs) -> object:
    """Greedy, with ``token`` made the greedy choice at every step."""
    params = SamplingParams(temperature=0, max_tokens=12, logit_bias={token: 100.0}, **kwargs)
    return llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]


@pytest.mark.parametrize("eos", sorted({*GEN_EOS, *CONFIG_EOS}))
def test_every_eos_id_stops(llm, eos) -> None:
    assert llm.get_tokenizer().eos_token_id == 2
    out = forced(llm, eos)
    assert out.token_ids == [eos]  # like the tokenizer's EOS: in token_ids, not in the text
    assert out.finish_reason == "stop" and out.text == ""
    # vLLM: the tokenizer's EOS has no stop_reason; the others stop as stop_token_ids do.
    assert out.stop_reason == (None if eos == 2 else eos)
    later = forced(llm, eos, min_tokens=3)  # blocked under min_tokens, like the main EOS
    assert len(later.token_ids) == 4 and later.token_ids[-1] == eos
    assert later.finish_reason == "stop" and eos not in later.token_ids[:3]


def test_ignore_eos_runs_on(llm) -> None:
    out = forced(llm, 100, ignore_eos=True)
    assert out.token_ids == [100] * 12 and out.finish_reason == "length"


def test_defaults_apply_only_without_sampling_params(llm) -> None:
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k) == (0.0, 5)
    greedy = llm.generate(PROMPT, SamplingParams(temperature=0.0), use_tqdm=False)[0]
    unset = llm.generate(PROMPT, use_tqdm=False)[0]  # the model's temperature 0: greedy
    assert unset.outputs[0].token_ids == greedy.outputs[0].token_ids
    # Explicit SamplingParams get none of the model's defaults (vLLM's rule): temperature 1.
    sampled = llm.generate(PROMPT, SamplingParams(n=4, seed=1, max_tokens=16),
                           use_tqdm=False)[0]
    assert any(c.token_ids != greedy.outputs[0].token_ids for c in sampled.outputs)


def test_vllm_mode_ignores_defaults_keeps_eos(model_dir) -> None:
    llm = LLM(model=str(model_dir), generation_config="vllm", **ENGINE)
    assert llm.get_default_sampling_params() == SamplingParams()
    out = forced(llm, 200)
    assert out.token_ids == [200] and out.finish_reason == "stop"
