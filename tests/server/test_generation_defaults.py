"""The server's sampling parameters: generation_config.json defaults fill the fields a request
leaves out (or null), in place of OpenAI's; a field the request sends always wins."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pagellm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagellm.entrypoints.openai.serving_engine import OpenAIServing, ServedModels
from pagellm.models.generation_config import GenerationConfig

MODEL_DEFAULTS = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
                  "repetition_penalty": 1.1}
OPENAI = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}


def serving(generation: GenerationConfig | None) -> OpenAIServing:
    model = SimpleNamespace(vocab_size=50, max_model_len=64, generation_config=generation)
    engine = SimpleNamespace(tokenizer=None, config=SimpleNamespace(model=model))
    s = OpenAIServing(engine, ServedModels(["m"], "m", 64))  # type: ignore[arg-type]
    s.tokenizer_pool.shutdown()
    return s


def fields(params) -> dict:
    return {k: getattr(params, k) for k in OPENAI}


def completion(**body) -> CompletionRequest:
    return CompletionRequest(prompt="hi", **body)


def test_absent_fields_take_the_model_defaults() -> None:
    s = serving(GenerationConfig(defaults=MODEL_DEFAULTS))
    assert fields(s.sampling_params(completion(), 16, None)) == MODEL_DEFAULTS
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    assert fields(s.sampling_params(chat, None, None)) == MODEL_DEFAULTS


def test_sent_fields_win_even_at_openai_defaults() -> None:
    s = serving(GenerationConfig(defaults=MODEL_DEFAULTS))
    req = completion(temperature=1.0, top_k=0, repetition_penalty=1.0)
    assert fields(s.sampling_params(req, 16, None)) == {
        **MODEL_DEFAULTS, "temperature": 1.0, "top_k": 0, "repetition_penalty": 1.0}
    # null is "not set", as vLLM reads it
    assert fields(s.sampling_params(completion(temperature=None), 16, None)) == MODEL_DEFAULTS


@pytest.mark.parametrize("generation", [None, GenerationConfig()])
def test_no_defaults_means_openai_defaults(generation) -> None:
    # --generation-config vllm, a model without the file, or a GGUF without one
    assert fields(serving(generation).sampling_params(completion(), 16, None)) == OPENAI
