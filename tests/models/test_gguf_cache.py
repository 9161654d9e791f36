"""The GGUF conversion cache gives exactly what reading the GGUF file gives."""

from __future__ import annotations

import torch

from pagellm.models import gguf_cache
from pagellm.models.loader import build_model, load_hf_config, load_tokenizer, resolve_model_source


def test_cached_conversion_equals_direct_load(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PAGELLM_CACHE_DIR", str(tmp_path))
    src = resolve_model_source(None)
    assert gguf_cache.cached_folder(src.gguf_path, gguf_cache.CONFIG) is None
    direct = (load_hf_config(src), load_tokenizer(src),
              build_model(load_hf_config(src), src, torch.float32, torch.device("cpu")))
    for part in (gguf_cache.CONFIG, gguf_cache.TOKENIZER, gguf_cache.WEIGHTS):
        assert gguf_cache.cached_folder(src.gguf_path, part) is not None, part
    cached = (load_hf_config(src), load_tokenizer(src),
              build_model(load_hf_config(src), src, torch.float32, torch.device("cpu")))
    strip = lambda c: {k: v for k, v in c.to_dict().items() if k != "_name_or_path"}  # noqa: E731
    assert strip(cached[0]) == strip(direct[0])
    text = "Hello wörld 你好 🙂 <|im_end|> def f(x): return x"
    assert cached[1].encode(text) == direct[1].encode(text)
    assert cached[1].chat_template == direct[1].chat_template
    a, b = direct[2].state_dict(), cached[2].state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_cache_can_be_turned_off(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PAGELLM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("PAGELLM_NO_GGUF_CACHE", "1")
    src = resolve_model_source(None)
    load_hf_config(src)
    assert not any(tmp_path.iterdir())
