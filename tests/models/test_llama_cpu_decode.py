"""The fused CPU decode path (one kernel call for every layer of a decode-only step) against the
module path on the same model: logits and KV caches bit for bit, over GQA, biased QKV (Qwen2)
and 8-head (Mistral) tiny models, several sequences whose blocks are scattered and whose lengths
cross block edges; and the cases it must leave to the modules."""

from __future__ import annotations

import pytest
import torch
from paged_harness import PagedHarness

from pagellm.attention import registry
from pagellm.kernels import cpu_ops
from pagellm.layers.linear import AMX_LINEAR_MAX_ROWS, prepack_linears_for_cpu
from pagellm.models.llama_cpu_decode import enable_fused_cpu_decode
from pagellm.models.loader import build_model, load_hf_config, resolve_model_source

pytestmark = pytest.mark.skipif(
    not cpu_ops.linear_supports(torch.empty(16, 32, dtype=torch.bfloat16)),
    reason="no AMX tiles on this CPU (or not granted): the fused path never runs")


def _bf16_model(tiny_model_dir, arch: str) -> torch.nn.Module:
    # An engine built by an earlier test (e.g. --attention-backend torch) leaves its choice as
    # the process-wide default; these layers must resolve the CPU backend.
    registry.set_default_backend("auto")
    src = resolve_model_source(str(tiny_model_dir(arch)))
    model = build_model(load_hf_config(src), src, torch.bfloat16, torch.device("cpu"))
    prepack_linears_for_cpu(model)
    return model


class _Counting:
    """Counts calls of cpu_ops.llama_decode (to know the fused path really ran)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        real = cpu_ops.llama_decode

        def spy(*args):
            self.calls += 1
            return real(*args)

        monkeypatch.setattr(cpu_ops, "llama_decode", spy)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_fused_decode_is_bit_identical_to_the_modules(tiny_model_dir, arch, monkeypatch):
    model = _bf16_model(tiny_model_dir, arch)
    assert enable_fused_cpu_decode(model) == 1
    fused = model.model.cpu_decode
    counter = _Counting(monkeypatch)
    with_fused, with_modules = PagedHarness(model, seed=3), PagedHarness(model, seed=3)

    def both(batch):
        model.model.cpu_decode = fused
        a = with_fused.step(batch)
        model.model.cpu_decode = None
        b = with_modules.step(batch)
        assert torch.equal(a, b)
        return a

    prompts = {"a": list(range(5, 25)), "b": list(range(40, 77)), "c": [3, 9, 4]}
    logits = both([(s, p) for s, p in prompts.items()])  # prefill: the modules, both times
    assert counter.calls == 0
    last = {s: int(row.argmax()) for s, row in zip(prompts, logits, strict=True)}
    for step in range(14):
        live = [s for s in prompts if not (s == "c" and step >= 9)]  # one sequence leaves
        logits = both([(s, [last[s]]) for s in live])
        last = {s: int(row.argmax()) for s, row in zip(live, logits, strict=True)}
    assert counter.calls == 14
    for (k1, v1), (k2, v2) in zip(with_fused.kv_caches, with_modules.kv_caches, strict=True):
        torch.testing.assert_close(k1, k2, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(v1, v2, rtol=0, atol=0, equal_nan=True)


def test_fused_decode_leaves_other_steps_to_the_modules(tiny_model_dir, monkeypatch):
    model = _bf16_model(tiny_model_dir, "llama")
    assert enable_fused_cpu_decode(model) == 1
    counter = _Counting(monkeypatch)
    h = PagedHarness(model, num_blocks=300)
    h.step([("a", list(range(5, 30)))])  # prefill
    h.step([("a", [7]), ("b", [1, 2, 3])])  # decode mixed with a prefill chunk
    assert counter.calls == 0
    many = [(f"s{i}", [i + 1]) for i in range(AMX_LINEAR_MAX_ROWS + 1)]
    h.step(many)  # prefill of one token each: more rows than the AMX linear takes
    h.step(many)  # ... decode-only, but too many rows
    assert counter.calls == 0
    h.step([("a", [8])])
    assert counter.calls == 1


def test_fused_decode_only_where_it_reproduces_the_model(tiny_model_dir, monkeypatch):
    src = resolve_model_source(str(tiny_model_dir("llama")))
    fp32 = build_model(load_hf_config(src), src, torch.float32, torch.device("cpu"))
    prepack_linears_for_cpu(fp32)
    assert enable_fused_cpu_decode(fp32) == 0  # the kernels are bfloat16

    unpacked = build_model(load_hf_config(src), src, torch.bfloat16, torch.device("cpu"))
    assert enable_fused_cpu_decode(unpacked) == 0  # linears have not chosen the AMX kernel

    from pagellm.layers.quantization import quantize_model

    quantized = _bf16_model(tiny_model_dir, "llama")
    quantize_model(quantized, "int8")
    assert enable_fused_cpu_decode(quantized) == 0

    monkeypatch.setenv("PAGELLM_FUSED_DECODE", "0")
    assert enable_fused_cpu_decode(_bf16_model(tiny_model_dir, "llama")) == 0
