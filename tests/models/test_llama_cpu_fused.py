"""The fused CPU path (one kernel call for every layer of a step) against the module path on the
same model: logits and KV caches bit for bit, over GQA, biased QKV (Qwen2), 8-head (Mistral) and
longrope (Phi-3: scaled cos/sin tables) tiny models, several sequences whose blocks are scattered
and whose lengths cross block edges; prefill chunks (with and without cached context) and decode
tokens mixed in one step where the prefill kernel takes the head size; and the cases it must
leave to the modules. In bfloat16 on the AMX kernel or the packed AVX-512 one (whichever this CPU
has), in float32 on the packed one."""

from __future__ import annotations

import pytest
import torch
from paged_harness import PagedHarness

from pagellm.attention import registry
from pagellm.kernels import cpu_ops
from pagellm.layers.linear import AMX_LINEAR_MAX_ROWS, prepack_linears_for_cpu
from pagellm.models.llama_cpu_fused import enable_fused_cpu_forward
from pagellm.models.loader import build_model, load_hf_config, resolve_model_source


def _kind(dtype: torch.dtype) -> str | None:
    """Which linear kernel the fused path runs on in this dtype here, if any."""
    w = torch.empty(16, 32, dtype=dtype)
    if dtype == torch.bfloat16 and cpu_ops.linear_supports(w):
        return "amx"
    return "packed" if cpu_ops.linear_packed_supports(w) else None


DTYPES = [torch.bfloat16, torch.float32]


@pytest.fixture(autouse=True)
def _fused_kernels(cpu_isa, request: pytest.FixtureRequest) -> None:
    """Each test runs once per kernel build (cpu_isa); one of a dtype is skipped where that
    build has no linear kernel for it (the fused path never runs there)."""
    dtype = request.node.callspec.params.get("dtype")
    if dtype is not None and _kind(dtype) is None:
        pytest.skip(f"no linear kernel for {dtype} in this build: the fused path never runs")


def _model(tiny_model_dir, arch: str, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    # An engine built by an earlier test (e.g. --attention-backend torch) leaves its choice as
    # the process-wide default; these layers must resolve the CPU backend.
    registry.set_default_backend("auto")
    src = resolve_model_source(str(tiny_model_dir(arch)))
    model = build_model(load_hf_config(src), src, dtype, torch.device("cpu"))
    prepack_linears_for_cpu(model)
    return model


class _Counting:
    """Counts calls of cpu_ops.llama_forward (to know the fused path really ran)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        real = cpu_ops.llama_forward

        def spy(*args):
            self.calls += 1
            return real(*args)

        monkeypatch.setattr(cpu_ops, "llama_forward", spy)


class _Both:
    """Two harnesses on one model: every step runs fused on one and through the modules on the
    other; the logits must be equal."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.fused = model, model.model.cpu_fused
        self.with_fused = PagedHarness(model, seed=3)
        self.with_modules = PagedHarness(model, seed=3)

    def step(self, batch):
        self.model.model.cpu_fused = self.fused
        a = self.with_fused.step(batch)
        self.model.model.cpu_fused = None
        b = self.with_modules.step(batch)
        self.model.model.cpu_fused = self.fused
        assert torch.equal(a, b)
        return a

    def assert_same_caches(self) -> None:
        for (k1, v1), (k2, v2) in zip(self.with_fused.kv_caches, self.with_modules.kv_caches,
                                      strict=True):
            torch.testing.assert_close(k1, k2, rtol=0, atol=0, equal_nan=True)
            torch.testing.assert_close(v1, v2, rtol=0, atol=0, equal_nan=True)


@pytest.fixture(scope="module")
def llama_hd32_dir(tmp_path_factory, make_tiny_model):
    """head_dim 32: the prefill kernel takes it, so prefill steps run fused too."""
    return make_tiny_model(tmp_path_factory.mktemp("llama_hd32"), "llama", hidden_size=128,
                           intermediate_size=256)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "phi3"])
def test_fused_decode_is_bit_identical_to_the_modules(tiny_model_dir, arch, dtype, monkeypatch):
    model = _model(tiny_model_dir, arch, dtype)
    assert enable_fused_cpu_forward(model) == 1
    # head_dim 16: the float32 prefill kernel takes it, the bfloat16 ones do not.
    prefill_fused = dtype == torch.float32
    assert model.model.cpu_fused.prefill_ok == prefill_fused
    counter = _Counting(monkeypatch)
    both = _Both(model)
    prompts = {"a": list(range(5, 25)), "b": list(range(40, 77)), "c": [3, 9, 4]}
    logits = both.step([(s, p) for s, p in prompts.items()])
    assert counter.calls == int(prefill_fused)
    last = {s: int(row.argmax()) for s, row in zip(prompts, logits, strict=True)}
    for step in range(14):
        live = [s for s in prompts if not (s == "c" and step >= 9)]  # one sequence leaves
        logits = both.step([(s, [last[s]]) for s in live])
        last = {s: int(row.argmax()) for s, row in zip(live, logits, strict=True)}
    assert counter.calls == 14 + int(prefill_fused)
    both.assert_same_caches()


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_prefill_and_mixed_steps_are_bit_identical_to_the_modules(llama_hd32_dir, dtype,
                                                                         monkeypatch):
    registry.set_default_backend("auto")
    src = resolve_model_source(str(llama_hd32_dir))
    model = build_model(load_hf_config(src), src, dtype, torch.device("cpu"))
    prepack_linears_for_cpu(model)
    assert enable_fused_cpu_forward(model) == 1
    assert model.model.cpu_fused.prefill_ok
    counter = _Counting(monkeypatch)
    both = _Both(model)
    prompts = {"a": list(range(5, 45)), "b": list(range(40, 77)), "c": [3, 9, 4]}
    # prefill chunks with no context, one of them a single token's worth short of a block
    logits = both.step([("a", prompts["a"][:17]), ("b", prompts["b"]), ("c", prompts["c"][:1])])
    last = {"b": int(logits[1].argmax())}
    # mixed: a chunk with cached context (crossing block edges), a decode, a one-token chunk
    # (attended as a decode item), a new sequence's whole prompt
    logits = both.step([("a", prompts["a"][17:]), ("b", [last["b"]]), ("c", prompts["c"][1:2]),
                        ("d", list(range(90, 123)))])
    last = {"a": int(logits[0].argmax()), "b": int(logits[1].argmax()),
            "d": int(logits[3].argmax())}
    logits = both.step([("c", prompts["c"][2:]), *((s, [t]) for s, t in last.items())])
    last = {"c": int(logits[0].argmax()), **{s: int(logits[i + 1].argmax())
                                              for i, s in enumerate(["a", "b", "d"])}}
    for _ in range(5):  # decode-only steps
        logits = both.step([(s, [t]) for s, t in last.items()])
        last = {s: int(row.argmax()) for s, row in zip(last, logits, strict=True)}
    assert counter.calls == 8
    both.assert_same_caches()


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_path_leaves_other_steps_to_the_modules(tiny_model_dir, dtype, monkeypatch):
    model = _model(tiny_model_dir, "llama", dtype)
    assert enable_fused_cpu_forward(model) == 1
    counter = _Counting(monkeypatch)
    h = PagedHarness(model, num_blocks=AMX_LINEAR_MAX_ROWS + 64)
    fused_prefill = model.model.cpu_fused.prefill_ok  # head_dim 16: float32 only
    h.step([("a", list(range(5, 30)))])
    h.step([("a", [7]), ("b", [1, 2, 3])])  # decode mixed with a prefill chunk
    assert counter.calls == (2 if fused_prefill else 0)
    many = [(f"s{i}", [3 + i % 50]) for i in range(AMX_LINEAR_MAX_ROWS + 1)]
    h.step(many)  # prefill of one token each (decode items)
    h.step(many)  # decode-only
    # More rows than the AMX linear takes go to the modules; the packed kernel takes any.
    big_fused = 2 if _kind(dtype) == "packed" else 0
    assert counter.calls == (2 if fused_prefill else 0) + big_fused
    h.step([("a", [8])])
    assert counter.calls == (2 if fused_prefill else 0) + big_fused + 1


def test_fused_decode_only_where_it_reproduces_the_model(tiny_model_dir, monkeypatch):
    src = resolve_model_source(str(tiny_model_dir("llama")))
    fp32 = build_model(load_hf_config(src), src, torch.float32, torch.device("cpu"))
    prepack_linears_for_cpu(fp32)
    # float32 runs fused where its linears took the packed kernel.
    assert enable_fused_cpu_forward(fp32) == int(_kind(torch.float32) == "packed")

    unpacked = build_model(load_hf_config(src), src, torch.bfloat16, torch.device("cpu"))
    assert enable_fused_cpu_forward(unpacked) == 0  # linears have not chosen their kernel

    from pagellm.layers.quantization import quantize_model

    quantized = build_model(load_hf_config(src), src, torch.bfloat16, torch.device("cpu"))
    quantize_model(quantized, "int8")
    prepack_linears_for_cpu(quantized)
    assert enable_fused_cpu_forward(quantized) == 0
    packed = _model(tiny_model_dir, "llama")
    if packed.model.layers[0].mlp.down_proj.cpu_packed:  # not on AMX: plain weights there
        with pytest.raises(ValueError, match="quantize before"):
            quantize_model(packed, "int8")

    monkeypatch.setenv("PAGELLM_FUSED_CPU", "0")
    assert enable_fused_cpu_forward(_model(tiny_model_dir, "llama")) == 0
