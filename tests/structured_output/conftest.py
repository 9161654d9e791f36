"""Engines shared by the structured-output tests (start-up costs seconds)."""

from __future__ import annotations

import pytest

from pagellm import LLM


@pytest.fixture(scope="module")
def tiny_path(tiny_model_dir) -> str:
    return str(tiny_model_dir("llama"))


@pytest.fixture(scope="module")
def tiny_llm(tiny_path) -> LLM:
    return LLM(model=tiny_path, dtype="float32", kv_cache_memory="32MiB", max_model_len=256)
