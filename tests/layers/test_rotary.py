"""The rotary cos/sin table when the engine's max_model_len is past the config's
max_position_embeddings: every position up to max_model_len has its row, and rows past the
config's length follow the same formula (transformers computes them on the fly)."""

from __future__ import annotations

import pytest
import torch

from pagellm.kernels import cpu_ops
from pagellm.layers.rotary import RotaryEmbedding, compute_inv_freq, get_rope_parameters
from pagellm.models.registry import get_model_cls
from pagellm.models.weight_utils import default_dtype

SHORT, LONG = 64, 128


def test_longer_table_matches_the_formula_past_the_original_length() -> None:
    params = {"rope_type": "default", "rope_theta": 10000.0}
    short = RotaryEmbedding(32, 32, SHORT, params)
    long = RotaryEmbedding(32, 32, LONG, params)
    assert long.cos_cache.shape == (LONG, 16)
    assert torch.equal(long.cos_cache[:SHORT], short.cos_cache)
    assert torch.equal(long.sin_cache[:SHORT], short.sin_cache)
    # position * inv_freq in float32, as transformers computes it
    angles = torch.arange(SHORT, LONG).float()[:, None] * compute_inv_freq(32, params)[None, :]
    torch.testing.assert_close(long.cos_cache[SHORT:], angles.cos())
    torch.testing.assert_close(long.sin_cache[SHORT:], angles.sin())
    # Rotating at a position past the original length: the torch path and the CPU kernel agree.
    q, k = torch.randn(3, 64), torch.randn(3, 32)
    positions = torch.tensor([5, SHORT, LONG - 1])
    ref_q, ref_k = long.forward_native(positions, q, k)
    assert torch.isfinite(ref_q).all() and torch.isfinite(ref_k).all()
    if cpu_ops.available() and cpu_ops.supports(q, k):
        cpu_ops.rotary_(q, k, positions, long.cos_cache, long.sin_cache, 32)
        torch.testing.assert_close(q, ref_q)
        torch.testing.assert_close(k, ref_k)


@pytest.mark.parametrize("arch", ["llama", "llama-rope3", "qwen2"])
def test_model_table_reaches_max_model_len_as_transformers(make_tiny_config, arch) -> None:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = make_tiny_config(arch, max_position_embeddings=SHORT)
    with default_dtype(torch.float32):
        model = get_model_cls(config)(config, max_model_len=LONG)
        default = get_model_cls(config)(config)
    rope = model.model.layers[0].self_attn.rotary_emb
    assert rope.cos_cache.shape[0] == LONG and model.max_position == LONG
    assert default.model.layers[0].self_attn.rotary_emb.cos_cache.shape[0] == SHORT
    # A shorter max_model_len keeps the config's table.
    with default_dtype(torch.float32):
        shorter = get_model_cls(config)(config, max_model_len=SHORT // 2)
    assert shorter.model.layers[0].self_attn.rotary_emb.cos_cache.shape[0] == SHORT
    half = rope.cos_cache.shape[1]
    ref = LlamaRotaryEmbedding(config)
    positions = torch.arange(LONG)[None]
    cos, sin = ref(torch.zeros(1, dtype=torch.float32), positions)
    assert get_rope_parameters(config)["rope_type"] in ("default", "llama3")
    torch.testing.assert_close(rope.cos_cache, cos[0, :, :half], atol=1e-6, rtol=0)
    torch.testing.assert_close(rope.sin_cache, sin[0, :, :half], atol=1e-6, rtol=0)
