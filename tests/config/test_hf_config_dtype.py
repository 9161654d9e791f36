"""The checkpoint dtype is read from a transformers config without the deprecated
``torch_dtype`` alias, whose every read logs a warning in transformers 5 (it was printed at every
start of the default GGUF model, whose config has no dtype)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, PretrainedConfig

from pagellm.config import hf_config_dtype
from pagellm.planning.model_spec import ModelSpec


@pytest.fixture
def no_torch_dtype_reads(monkeypatch):
    def fail(self):
        raise AssertionError("the deprecated torch_dtype alias was read")

    if isinstance(getattr(PretrainedConfig, "torch_dtype", None), property):
        monkeypatch.setattr(PretrainedConfig, "torch_dtype", property(fail))


def test_dtype_is_read_without_the_alias(no_torch_dtype_reads):
    assert hf_config_dtype(LlamaConfig()) is None  # a GGUF config: no dtype at all
    assert hf_config_dtype(LlamaConfig(dtype="bfloat16")) == torch.bfloat16
    spec = ModelSpec.from_hf_config(LlamaConfig(hidden_size=64, intermediate_size=128,
                                                num_attention_heads=4, num_hidden_layers=2,
                                                vocab_size=100), "tiny")
    assert spec.config_dtype is None


def test_a_plain_object_with_the_old_name_still_works():
    class OldConfig:  # transformers < 4.56 kept it as a plain attribute
        def __init__(self) -> None:
            self.torch_dtype = "float16"

    assert hf_config_dtype(OldConfig()) == "float16"
