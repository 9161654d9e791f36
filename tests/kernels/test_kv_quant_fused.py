"""The fused CPU step (``cpu_kv_quant.llama_forward``: every layer in one kernel call) over 8-bit
KV caches against the module path (the CPU backend's ``_forward_quant``) on the same model:
logits and caches (values and int8 scales) bit for bit, through prefill chunks with and without
context, mixed steps and decode steps, in each kernel build; head_dim 64 and 3 query heads a kv
head (the default model's group), so decode rows take the register kernel and chunks the tile
kernel."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from pagellm.attention import registry
from pagellm.attention.kv_quant import SCALE_DTYPE, KVQuant, storage_dtype
from pagellm.kernels import cpu_kv_quant, cpu_ops
from pagellm.layers.linear import prepack_linears_for_cpu
from pagellm.models.llama_cpu_fused import enable_fused_cpu_forward
from pagellm.models.loader import build_model, load_hf_config, resolve_model_source

sys.path.insert(0, str(Path(__file__).parents[1] / "models"))
import paged_harness  # noqa: E402

KINDS = ("fp8_e4m3", "fp8_e5m2", "int8_per_token_head")


@pytest.fixture(scope="module")
def llama_hd64_dir(tmp_path_factory, make_tiny_model):
    return make_tiny_model(tmp_path_factory.mktemp("llama_hd64"), "llama", hidden_size=384,
                           intermediate_size=256, num_attention_heads=6, num_key_value_heads=2)


class QuantHarness(paged_harness.PagedHarness):
    """A PagedHarness whose caches are 8-bit (unwritten bytes 0x7f: NaN in fp8, NaN int8
    scales), its KVQuant passed to the forward context."""

    current: QuantHarness | None = None

    def __init__(self, model, kind: str, **kw) -> None:
        super().__init__(model, **kw)
        shape = self.kv_caches[0][0].shape
        self.kv_caches = [(torch.full(shape, 0x7F, dtype=storage_dtype(kind)),
                           torch.full(shape, 0x7F, dtype=storage_dtype(kind)))
                          for _ in self.kv_caches]
        self.kv_quant = []
        for _ in self.kv_caches:
            scales = None
            if kind == "int8_per_token_head":
                scales = torch.full((2, *shape[:3]), float("nan"), dtype=SCALE_DTYPE)
            self.kv_quant.append(KVQuant(kind, 0.5, 2.0, None if scales is None else scales[0],
                                         None if scales is None else scales[1]))

    def step(self, batch, all_logits: bool = False):
        QuantHarness.current = self
        return super().step(batch, all_logits)


_real_context = paged_harness.set_forward_context


def _context(meta, kv_caches, kv_quant=None, **kw):
    """The harness's forward context, with the stepping harness's KVQuant."""
    return _real_context(meta, kv_caches, QuantHarness.current.kv_quant, **kw)


@pytest.mark.skipif(not cpu_ops.available(), reason="no C++ compiler")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", KINDS)
def test_fused_step_on_quantized_cache_is_bit_identical(llama_hd64_dir, kind, dtype, cpu_isa,
                                                        monkeypatch):
    registry.set_default_backend("auto")
    src = resolve_model_source(str(llama_hd64_dir))
    model = build_model(load_hf_config(src), src, dtype, torch.device("cpu"))
    prepack_linears_for_cpu(model)
    if not enable_fused_cpu_forward(model):
        pytest.skip(f"no fused path for {dtype} in this build")
    monkeypatch.setattr(paged_harness, "set_forward_context", _context)
    calls = []
    real = cpu_kv_quant.llama_forward
    monkeypatch.setattr(cpu_kv_quant, "llama_forward", lambda *a: calls.append(1) or real(*a))
    fused = model.model.cpu_fused
    a, b = QuantHarness(model, kind, seed=3), QuantHarness(model, kind, seed=3)

    def step(batch):
        model.model.cpu_fused = fused
        x = a.step(batch)
        model.model.cpu_fused = None
        y = b.step(batch)
        model.model.cpu_fused = fused
        assert torch.isfinite(x).all()
        assert torch.equal(x, y)
        return x

    prompts = {"a": list(range(5, 45)), "b": list(range(40, 77)), "c": [3, 9, 4]}
    logits = step([("a", prompts["a"][:17]), ("b", prompts["b"]), ("c", prompts["c"][:1])])
    last = {"b": int(logits[1].argmax())}
    logits = step([("a", prompts["a"][17:]), ("b", [last["b"]]), ("c", prompts["c"][1:]),
                   ("d", list(range(90, 123)))])
    last = {s: int(logits[i].argmax()) for i, s in enumerate("abcd")}
    for _ in range(6):
        logits = step([(s, [t]) for s, t in last.items()])
        last = {s: int(row.argmax()) for s, row in zip(last, logits, strict=True)}
    assert len(calls) == 8
    for (k1, v1), (k2, v2), q1, q2 in zip(a.kv_caches, b.kv_caches, a.kv_quant, b.kv_quant,
                                          strict=True):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
        if q1.k_scales is not None:
            torch.testing.assert_close(q1.k_scales, q2.k_scales, rtol=0, atol=0, equal_nan=True)
            torch.testing.assert_close(q1.v_scales, q2.v_scales, rtol=0, atol=0, equal_nan=True)
