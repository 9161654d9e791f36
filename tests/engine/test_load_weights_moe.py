"""``LLM.load_weights`` on Mixture-of-Experts models (Mixtral, Qwen3-MoE): per-expert checkpoint
tensors go into FusedMoE's stacked weights in place, the router and Qwen3-MoE's dense layer
through the usual path; afterwards the engine generates what a fresh one built from the same
weights does. Under --quantization the experts are quantized too: an update re-quantizes the
experts it loads into (and only those)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from weight_update_utils import (
    checkpoint_weights,
    perturbed_model,
    prompts,
    tokens,
    write_checkpoint,
)

from pagellm import LLM
from pagellm.layers.fused_moe import FusedMoE

ARCHS = ["mixtral", "qwen3-moe", "qwen3-next"]
# Layer 0's expert 2 of each family, by checkpoint name (w1/gate, w3/up, w2/down).
EXPERT = {"mixtral": "model.layers.0.block_sparse_moe.experts.2.",
          "qwen3-moe": "model.layers.0.mlp.experts.2.",
          "qwen3-next": "model.layers.0.mlp.experts.2."}


@pytest.fixture(scope="module", params=ARCHS)
def moe(request, tiny_model_dir, tmp_path_factory) -> tuple[str, Path, Path, dict]:
    """(arch, original checkpoint, perturbed checkpoint, the perturbed tensors by name)."""
    arch = request.param
    src = tiny_model_dir(arch)
    dst = tmp_path_factory.mktemp(f"tiny-{arch}-updated")
    perturbed_model(src, dst)
    return arch, src, dst, checkpoint_weights(dst)


def engine(path: Path, **kw) -> LLM:
    kw = {"dtype": "float32", "kv_cache_memory": "16MiB", "max_model_len": 256, **kw}
    return LLM(model=str(path), **kw)


def experts_of(llm: LLM) -> list[FusedMoE]:
    model = llm.llm_engine.engine_core.executor.runner.model
    return [m for m in model.modules() if isinstance(m, FusedMoE)]


def expert_state(llm: LLM) -> list[dict[str, torch.Tensor]]:
    return [{n: p.detach().clone() for n, p in m.named_parameters()} for m in experts_of(llm)]


@pytest.mark.parametrize("kw", [{}, {"dtype": "bfloat16"}, {"quantization": "int8"},
                                {"quantization": "int4"}],
                         ids=["float32", "bfloat16", "int8", "int4"])
def test_update_equals_fresh_engine(moe, kw) -> None:
    """The router stays float; float experts are copied in place, quantized ones re-quantized;
    attention and the dense layer go back through their kernels' layouts (packed bfloat16, int8,
    int4) as for a dense model."""
    arch, src, dst, weights = moe
    assert any(".experts.3." in n for n in weights)  # per-expert names, as checkpoints store
    if arch == "qwen3-moe":
        assert "model.layers.1.mlp.gate_proj.weight" in weights  # the dense layer
    llm = engine(src, enable_prefix_caching=True, **kw)
    quantized = "quantization" in kw
    assert all((m.quant is not None) == quantized for m in experts_of(llm))
    ps = prompts(llm.llm_engine.config.model.vocab_size)
    before = tokens(llm, ps)
    assert llm.load_weights(weights.items()) == len(weights)
    # The same prompts again: their cached blocks hold the old model's K/V.
    after = tokens(llm, ps)
    # Caching on for the fresh engine too: a hybrid model's cold run with state snapshots
    # splits its scan at their boundaries, which may flip a near-tie in int4 otherwise.
    fresh = engine(dst, enable_prefix_caching=True, **kw)
    assert after == tokens(fresh, ps)
    assert after != before
    if quantized:  # re-quantized from the new weights: the fresh engine's quantized experts
        for got, want in zip(expert_state(llm), expert_state(fresh), strict=True):
            # int8 experts sit in the fused CPU kernel's layout where it runs (moe_cpu_pack.py)
            assert got.keys() == want.keys() and {"w13_qweight", "w13_packed"} & got.keys()
            for name in got:
                assert torch.equal(got[name], want[name]), name


@pytest.mark.parametrize("kw", [{}, {"quantization": "int8"}], ids=["float32", "int8"])
def test_partial_update_of_one_expert(moe, tmp_path, kw) -> None:
    """Expert 2 of layer 0 gets new gate and down weights, keeping its up weight; every other
    expert (and the router) keeps its values: as a fresh engine loaded with that state. int8:
    the other experts keep their codes untouched; expert 2's up rows, dequantized and quantized
    again, come back to the same codes (per-row scales)."""
    arch, src, _, weights = moe
    up = "w3" if arch == "mixtral" else "up_proj"
    part = {n: t for n, t in weights.items()
            if n.startswith(EXPERT[arch]) and f".{up}." not in n}
    assert len(part) == 2
    llm = engine(src, **kw)
    ps = prompts(llm.llm_engine.config.model.vocab_size, seed=2)
    before = tokens(llm, ps)
    state = expert_state(llm)
    assert llm.load_weights(part.items()) == 2
    got = tokens(llm, ps)
    assert got != before
    mixed = write_checkpoint(src, tmp_path / "mixed", {**checkpoint_weights(src), **part})
    fresh = engine(mixed, **kw)
    assert tokens(fresh, ps) == got
    if kw:
        for name, t in expert_state(llm)[0].items():
            assert torch.equal(t, expert_state(fresh)[0][name]), name
            others = [e for e in range(t.shape[0]) if e != 2]
            assert torch.equal(t[others], state[0][name][others]), name
    # Back to the original expert: the original tokens.
    orig = checkpoint_weights(src)
    llm.load_weights((n, orig[n]) for n in part)
    assert tokens(llm, ps) == before


def test_bad_expert_index_changes_nothing(moe) -> None:
    arch, src, _, weights = moe
    llm = engine(src)
    ps = prompts(llm.llm_engine.config.model.vocab_size, n=2)
    before = tokens(llm, ps)
    good = {n: t for n, t in weights.items() if n.startswith(EXPERT[arch])}
    bad = [(n.replace(".experts.2.", ".experts.4."), t) for n, t in good.items()]
    with pytest.raises(ValueError, match=re.escape("names expert 4") + ".*experts 0..3"):
        llm.load_weights([*good.items(), *bad])
    assert tokens(llm, ps) == before
    # transformers 5's stacked name (its named_parameters()) is no checkpoint name: refused.
    with pytest.raises(ValueError, match="matches no parameter"):
        llm.load_weights([*good.items(),
                          ("model.layers.0.mlp.experts.gate_up_proj", torch.zeros(4, 64, 64))])
    assert tokens(llm, ps) == before
