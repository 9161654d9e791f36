"""Engines shared by the end-to-end tests (built once per session: start-up costs seconds)."""

from __future__ import annotations

import pytest

from pagellm import LLM


@pytest.fixture(scope="session")
def default_llm() -> LLM:
    """The real default model (SmolLM2-135M-Instruct GGUF), fp32 so tokens match transformers."""
    return LLM(dtype="float32", kv_cache_memory="512MiB", max_model_len=2048, seed=0)
