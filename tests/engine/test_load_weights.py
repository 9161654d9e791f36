"""``LLM.load_weights`` (weights from a trainer, in place) and ``LLM.collective_rpc``: after an
update the engine generates exactly what a fresh engine built from the same weights does, with
the CPU kernels' layouts, int8 quantization and the prefix cache all following."""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path

import pytest
import torch
from weight_update_utils import perturbed_model, prompts, tokens

from pagellm import LLM


@pytest.fixture(scope="module")
def new_model(tiny_llama_dir, tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    dst = tmp_path_factory.mktemp("tiny-llama-updated")
    return dst, perturbed_model(tiny_llama_dir, dst)


def layouts(llm: LLM) -> tuple:
    model = llm.llm_engine.engine_core.executor.runner.model
    kinds = tuple((n, type(m.linear_method).__name__, getattr(m.linear_method, "cpu_kind", None))
                  for n, m in model.named_modules() if hasattr(m, "linear_method"))
    return model.model.cpu_fused is not None, kinds


def kernel_weights(llm: LLM) -> list[torch.Tensor]:
    """The weights a CPU kernel streams, in module order (gather_kernel_weights placed them);
    quantized methods have none."""
    model = llm.llm_engine.engine_core.executor.runner.model
    return [w for m in model.modules() if hasattr(m, "linear_method")
            and (w := getattr(m.linear_method, "kernel_weight", lambda _: None)(m)) is not None]


def engine(path: Path, **kw) -> LLM:
    kw = {"dtype": "float32", "kv_cache_memory": "16MiB", "max_model_len": 256, **kw}
    return LLM(model=str(path), **kw)


@pytest.mark.parametrize("kw", [{}, {"dtype": "bfloat16"}, {"quantization": "int8"},
                                {"quantization": "int4"}],
                         ids=["float32", "bfloat16", "int8", "int4"])
def test_update_equals_fresh_engine(tiny_llama_dir, new_model, kw) -> None:
    path, weights = new_model
    llm = engine(tiny_llama_dir, enable_prefix_caching=True, **kw)
    ps = prompts(llm.llm_engine.config.model.vocab_size)
    before = tokens(llm, ps)
    layout, addresses = layouts(llm), [w.data_ptr() for w in kernel_weights(llm)]
    assert llm.load_weights(weights.items()) == len(weights)
    assert layouts(llm) == layout  # the same kernels, the fused step (or not) as before
    assert [w.data_ptr() for w in kernel_weights(llm)] == addresses  # updated where they were
    # The same prompts again: their blocks are cached from before, and must not be reused.
    after = tokens(llm, ps)
    want = tokens(engine(path, **kw), ps)
    assert after == want
    assert after != before


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tied_head_update(tiny_model_dir, tmp_path, dtype) -> None:
    """A tied LM head's kernel reads a copy of the embedding: an update of the embedding
    reaches it, in the copy's old storage."""
    src = tiny_model_dir("llama-tied")
    weights = perturbed_model(src, tmp_path / "updated")
    llm = engine(src, dtype=dtype)
    ps = prompts(llm.llm_engine.config.model.vocab_size)
    before, addresses = tokens(llm, ps), [w.data_ptr() for w in kernel_weights(llm)]
    assert llm.load_weights(weights.items()) == len(weights)
    assert [w.data_ptr() for w in kernel_weights(llm)] == addresses
    after = tokens(llm, ps)
    assert after == tokens(engine(tmp_path / "updated", dtype=dtype), ps)
    assert after != before


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kernel_weights_side_by_side(tiny_llama_dir, dtype) -> None:
    """The weights the CPU kernels stream lie one after another in the order a step reads
    them (batch-1 decode is one stream over the model)."""
    weights = kernel_weights(engine(tiny_llama_dir, dtype=dtype))
    if not weights:
        pytest.skip("no CPU kernel streams these weights here")
    for w, nxt in pairwise(weights):
        end = w.data_ptr() + w.numel() * w.element_size()
        assert end <= nxt.data_ptr() < end + 4096  # huge_pages.SLOT_ALIGN_BYTES
    assert len({w.untyped_storage().data_ptr() for w in weights}) == 1


def test_partial_update(tiny_llama_dir, new_model) -> None:
    """Only some tensors (one of q/k/v, one of gate/up): the others keep the old values."""
    path, weights = new_model
    base = engine(tiny_llama_dir, dtype="bfloat16")
    ps = prompts(base.llm_engine.config.model.vocab_size, seed=2)
    before = tokens(base, ps)
    part = {n: t for n, t in weights.items() if n.endswith(("k_proj.weight", "up_proj.weight"))}
    assert base.load_weights(part.items()) == len(part)
    got = tokens(base, ps)
    assert got != before
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    mixed = {**{n: p.detach() for n, p in ref.named_parameters()}, **part}
    fresh = engine(tiny_llama_dir, dtype="bfloat16")
    fresh.load_weights(mixed.items())
    assert tokens(fresh, ps) == got
    # Back to the original weights: the original tokens.
    base.load_weights((n, p.detach()) for n, p in ref.named_parameters())
    assert tokens(base, ps) == before


def test_bad_name_changes_nothing(tiny_llama_dir) -> None:
    llm = engine(tiny_llama_dir)
    ps = prompts(llm.llm_engine.config.model.vocab_size, n=2)
    before = tokens(llm, ps)
    with pytest.raises(ValueError, match="no_such"):
        llm.load_weights([("model.layers.0.mlp.up_proj.weight", torch.zeros(1)),
                          ("model.no_such.weight", torch.zeros(1))])
    assert tokens(llm, ps) == before


def rank_of(runner) -> int:
    return runner.tp_rank


def test_collective_rpc(tiny_llama_dir) -> None:
    llm = engine(tiny_llama_dir)
    assert llm.collective_rpc(rank_of) == [0]
    assert llm.collective_rpc("load_weights", args=([],)) == [0]
    with pytest.raises(AttributeError, match="nope"):
        llm.collective_rpc("nope")
