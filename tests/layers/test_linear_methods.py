"""Every linear and the LM head hold one method from the factory; the CPU kernel is chosen after
loading by kernels/cpu_matmul.py; pagellm/layers has no import cycle."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import pagellm
from pagellm.kernels.cpu_matmul import choose_cpu_matmul
from pagellm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagellm.layers.linear import (
    MergedColumnParallelLinear,
    RowParallelLinear,
    prepack_linears_for_cpu,
)
from pagellm.layers.linear_method import UnquantizedLinearMethod
from pagellm.layers.quant_methods import QuantizedLinearMethod
from pagellm.layers.quantization import quantize_model

LAYERS = Path(pagellm.__file__).parent / "layers"


def _imports(path: Path) -> set[str]:
    """The pagellm.layers modules ``path`` imports, lazily too."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found.update(n.rsplit(".", 1)[-1] for n in names if n.startswith("pagellm.layers."))
    return found


def test_layers_have_no_import_cycle() -> None:
    graph = {p.stem: _imports(p) for p in LAYERS.glob("*.py")}
    done: set[str] = set()

    def visit(mod: str, path: tuple[str, ...]) -> None:
        assert mod not in path, " -> ".join((*path, mod))
        if mod in done or mod not in graph:
            return
        for dep in graph[mod]:
            visit(dep, (*path, mod))
        done.add(mod)

    for mod in graph:
        visit(mod, ())


def _model(dtype: torch.dtype) -> torch.nn.ModuleDict:
    torch.manual_seed(0)
    emb = VocabParallelEmbedding(320, 64, params_dtype=dtype)
    head = ParallelLMHead(320, 64, params_dtype=dtype)
    head.tie_weights(emb)
    model = torch.nn.ModuleDict({
        "emb": emb, "head": head,
        "gate_up": MergedColumnParallelLinear(64, [96, 96], params_dtype=dtype),
        "down": RowParallelLinear(96, 64, bias=True, params_dtype=dtype)})
    for p in model.parameters():
        torch.nn.init.normal_(p)
    return model


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_each_layer_has_one_method_and_a_tied_head_keeps_its_weight(dtype) -> None:
    model = _model(dtype)
    methods = {n: m.linear_method for n, m in model.items() if n != "emb"}
    assert all(type(m) is UnquantizedLinearMethod for m in methods.values())
    assert methods["head"].weight_shared and not methods["down"].weight_shared
    ids = torch.tensor([0, 7, 319])
    rows = model["emb"](ids)
    kinds = {n: choose_cpu_matmul(m.weight.data, m.bias) for n, m in model.items() if n != "emb"}
    prepack_linears_for_cpu(model)
    for name, method in methods.items():
        assert model[name].linear_method is method  # the same object, its kernel chosen
        expect = kinds[name]
        assert method.cpu_kind == (expect.kind if expect else None), name
    assert model["head"].weight is model["emb"].weight  # plain, still the embedding's
    assert torch.equal(model["emb"](ids), rows)


def test_quantizing_swaps_in_a_quantized_method_and_leaves_the_head() -> None:
    model = _model(torch.float32)
    quantize_model(model, "int8", "torch")
    assert isinstance(model["gate_up"].linear_method, QuantizedLinearMethod)
    assert model["gate_up"].quant_method is model["gate_up"].linear_method
    assert type(model["head"].linear_method) is UnquantizedLinearMethod


def test_no_cpu_kernel_when_disabled(monkeypatch) -> None:
    monkeypatch.setenv("PAGELLM_CPU_KERNELS", "0")
    w = torch.randn(64, 64).to(torch.bfloat16)
    assert choose_cpu_matmul(w, None) is None


def test_bfloat16_weights_skip_onednn_where_the_cpu_lacks_bf16(monkeypatch) -> None:
    """oneDNN's bf16 reorder raises on an AVX2-only CPU: the weight must be left to F.linear
    there (and packed where oneDNN can), not crash the model's load."""
    from pagellm.kernels import cpu_matmul, cpu_ops

    w = torch.randn(64, 64).to(torch.bfloat16)
    monkeypatch.setattr(cpu_ops, "linear_supports", lambda weight: False)
    monkeypatch.setattr(cpu_ops, "linear_packed_supports", lambda weight: False)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    assert cpu_matmul.cpu_matmul_kind(w, None) is None
    assert cpu_matmul.cpu_matmul_kind(w.float(), None) == (
        "onednn" if torch.backends.mkldnn.is_available() else None)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    assert cpu_matmul.cpu_matmul_kind(w, None) == (
        "onednn" if torch.backends.mkldnn.is_available() else None)
