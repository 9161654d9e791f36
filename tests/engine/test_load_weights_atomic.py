"""A weight update is all or nothing (``LLM.load_weights``, ``update_weights_from_disk``).

Refused updates (a tensor of the wrong shape or dtype, a name the model lacks, a path that is no
checkpoint) raise ValueError before any weight changes: the engine then generates exactly what a
fresh engine on the original weights does. An update that fails once weights are changing (a
read error mid-load, a failure while the layers go back to their kernels' layouts, one rank of
two failing) restores the previous weights (WeightUpdateError, ``restored=True``) and resets the
prefix cache; if even that fails the engine goes out of service. No message echoes a loader's
exception text or tells what a server path holds."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from weight_update_utils import GREEDY, checkpoint_weights, perturbed_model, write_checkpoint

import pagellm.worker.weight_update as wu
from pagellm import LLM
from pagellm.errors import EngineDeadError, WeightUpdateError

SECRET = "disk /srv/secret-volume went away"  # a cause's text: must reach no message
# Loaded first (checkpoint order is by name), so a later failure finds it already changed.
GOOD = "model.layers.0.mlp.down_proj.weight"
LATER = "model.layers.1.self_attn.o_proj.weight"


def engine(path: Path, **kw) -> LLM:
    kw = {"dtype": "float32", "kv_cache_memory": "16MiB", "max_model_len": 256, **kw}
    return LLM(model=str(path), **kw)


def long_prompts(vocab: int, n: int = 3) -> list[dict]:
    """Prompts of whole blocks (the prefix cache keeps full blocks only)."""
    rng = random.Random(7)
    return [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(48)]} for _ in range(n)]


def run(llm: LLM, ps: list[dict]) -> tuple[list[list[int]], list[int]]:
    """(greedy tokens, prompt tokens served by the prefix cache) per prompt."""
    outs = llm.generate(ps, GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]


def vocab(llm: LLM) -> int:
    return llm.llm_engine.config.model.vocab_size


def core(llm: LLM):
    return llm.llm_engine.engine_core


def kernel_addresses(llm: LLM) -> list[int]:
    model = core(llm).executor.runner.model
    return [p.data_ptr() for p in model.parameters() if not p.is_mkldnn]


@pytest.fixture(scope="module")
def updated(tiny_llama_dir, tmp_path_factory) -> dict[str, torch.Tensor]:
    """Every tensor of a perturbed checkpoint of the tiny Llama (a trainer's next step)."""
    dst = tmp_path_factory.mktemp("tiny-llama-next")
    perturbed_model(tiny_llama_dir, dst)
    return checkpoint_weights(dst)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir) -> dict[str, list[list[int]]]:
    """What a fresh engine on the original weights generates, per dtype (the independent
    reference every failed update must leave the engine matching)."""
    cache: dict[str, list[list[int]]] = {}

    def get(**kw) -> list[list[int]]:
        key = json.dumps(kw, sort_keys=True)
        if key not in cache:
            llm = engine(tiny_llama_dir, **kw)
            cache[key] = run(llm, long_prompts(vocab(llm)))[0]
        return cache[key]

    return get


BAD = {  # a bad tensor next to a good one: (tensor name, tensor, what the message says)
    "shape": (LATER, torch.zeros(64, 32), "has shape (64, 32), expected (64, 64)"),
    "name": ("model.layers.1.self_attn.no_such_proj.weight", torch.zeros(64, 64),
             "matches no parameter"),
    "dtype": (LATER, torch.zeros(64, 64, dtype=torch.int32), "has dtype int32"),
}


def check_clean(message: str) -> None:
    assert SECRET not in message
    for leak in ("cannot read", "Error", "Traceback", "!=", ".safetensors'", "incomplete"):
        assert leak not in message, message


@pytest.mark.parametrize("bad", list(BAD))
def test_bad_checkpoint_changes_nothing(tiny_llama_dir, updated, reference, tmp_path,
                                        monkeypatch, bad) -> None:
    """Checked from the safetensors headers, before any tensor data is read."""
    name, tensor, says = BAD[bad]
    path = write_checkpoint(tiny_llama_dir, tmp_path / "ckpt", {GOOD: updated[GOOD],
                                                                 name: tensor})
    llm = engine(tiny_llama_dir)
    ps = long_prompts(vocab(llm))
    assert run(llm, ps)[0] == reference()

    import safetensors.torch

    reads = []
    load_file = safetensors.torch.load_file
    monkeypatch.setattr(safetensors.torch, "load_file",
                        lambda *a, **k: reads.append(a) or load_file(*a, **k))
    with pytest.raises(ValueError) as info:
        core(llm).update_weights_from_disk(str(path))
    assert run(llm, ps)[0] == reference()
    assert not reads  # refused from the headers: no tensor data read
    msg = str(info.value)
    assert str(path) in msg and repr(name) in msg and says in msg, msg
    check_clean(msg)


@pytest.mark.parametrize("bad", list(BAD))
def test_bad_tensor_list_changes_nothing(tiny_llama_dir, updated, reference, bad) -> None:
    name, tensor, says = BAD[bad]
    llm = engine(tiny_llama_dir)
    ps = long_prompts(vocab(llm))
    with pytest.raises(ValueError) as info:
        llm.load_weights([(GOOD, updated[GOOD]), (name, tensor)])
    assert run(llm, ps)[0] == reference()
    assert f"weight {name!r}" in str(info.value) and says in str(info.value)
    check_clean(str(info.value))


@pytest.mark.parametrize("bad", [("model.layers.0.self_attn.q_proj.weight", (64, 63)),
                                 ("model.layers.0.mlp.up_proj.weight", (64, 64)),
                                 ("model.norm.weight", (65,)),
                                 ("model.layers.0.mlp.down_proj.bias", (64,)),
                                 ("model.embed_tokens.weight", (3, 64))])
def test_expected_shapes(tiny_llama_dir, updated, reference, bad) -> None:
    """Fused shards, norms, a bias the layer lacks, the embedding: each refused by name and
    shape before anything changes (in a full update: every other tensor is right); the full
    update with the right shapes loads."""
    name, shape = bad
    llm = engine(tiny_llama_dir)
    ps = long_prompts(vocab(llm))
    weights = dict(updated)
    weights[name] = torch.zeros(shape)
    with pytest.raises(ValueError, match=repr(name)):
        llm.load_weights(weights.items())
    assert run(llm, ps)[0] == reference()
    assert llm.load_weights(updated.items()) == len(updated)


def test_unreadable_paths_say_nothing_about_them(tiny_llama_dir, tiny_model_dir, updated,
                                                 tmp_path, reference) -> None:
    """Another architecture, a broken config.json, no safetensors files, a truncated file, an
    index naming a file outside the folder: one message, naming only model_path."""
    qwen = tiny_model_dir("qwen2")
    broken = write_checkpoint(tiny_llama_dir, tmp_path / "broken", {GOOD: updated[GOOD]})
    (broken / "config.json").write_text("{ not json " + SECRET)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text((tiny_llama_dir / "config.json").read_text())
    truncated = write_checkpoint(tiny_llama_dir, tmp_path / "truncated", dict(updated))
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[:-1000])
    outside = write_checkpoint(tiny_llama_dir, tmp_path / "outside", {GOOD: updated[GOOD]})
    (outside / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {GOOD: "../truncated/model.safetensors"}}))
    llm = engine(tiny_llama_dir)
    messages = []
    for path in (qwen, broken, empty, truncated, outside, tmp_path / "missing"):
        with pytest.raises(ValueError) as info:
            core(llm).update_weights_from_disk(str(path))
        msg = str(info.value)
        assert repr(str(path)) in msg
        check_clean(msg)
        messages.append(msg.replace(repr(str(path)), "PATH"))
    assert len(set(messages)) == 1, messages
    assert "not a loadable checkpoint of this model" in messages[0]
    assert run(llm, long_prompts(vocab(llm)))[0] == reference()


def fail_on_call(monkeypatch, target: str, n: int) -> None:
    """``wu.<target>`` raises (an OSError with SECRET) on its n-th call only."""
    orig = getattr(wu, target)
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == n:
            raise OSError(SECRET)
        return orig(*args, **kwargs)

    monkeypatch.setattr(wu, target, failing)


@pytest.mark.parametrize("kw", [{}, {"dtype": "bfloat16"}, {"quantization": "int8"},
                                {"quantization": "int4"}],
                         ids=["float32", "bfloat16", "int8", "int4"])
@pytest.mark.parametrize("where", ["mid_load", "after_relayout"])
@pytest.mark.parametrize("source", ["list", "disk"])
def test_failed_update_is_undone(tiny_llama_dir, updated, reference, tmp_path, monkeypatch,
                                 kw, where, source) -> None:
    """mid_load: the 2nd tensor's load raises (the 1st went in). after_relayout: every tensor
    loaded and every layer back in its kernel's layout (into its old storage), then the last
    step raises. Either way: the previous weights, where they were; the prefix cache reset."""
    llm = engine(tiny_llama_dir, enable_prefix_caching=True, **kw)
    ps = long_prompts(vocab(llm))
    before, _ = run(llm, ps)
    assert before == reference(**kw)
    assert min(run(llm, ps)[1]) > 0  # cached: a later miss means the cache was reset
    addresses = kernel_addresses(llm)
    if where == "mid_load":
        fail_on_call(monkeypatch, "load_checkpoint_tensor", 2)
    else:
        fail_on_call(monkeypatch, "enable_fused_cpu_forward", 1)
    with pytest.raises(WeightUpdateError) as info:
        if source == "list":
            llm.load_weights(updated.items())
        else:
            path = write_checkpoint(tiny_llama_dir, tmp_path / "next", updated)
            core(llm).update_weights_from_disk(str(path))
    assert info.value.restored is True
    assert "previous weights were restored" in str(info.value)
    check_clean(str(info.value))
    assert kernel_addresses(llm) == addresses
    after, cached = run(llm, ps)
    assert cached == [0] * len(ps)
    assert after == before
    monkeypatch.undo()
    # The engine still updates (the same update, now without the fault).
    assert llm.load_weights(updated.items()) == len(updated)
    assert run(llm, ps)[0] != before


def test_failed_restore_takes_the_engine_out_of_service(tiny_llama_dir, updated,
                                                        monkeypatch) -> None:
    llm = engine(tiny_llama_dir, enable_prefix_caching=True)
    ps = long_prompts(vocab(llm))
    run(llm, ps)
    fail_on_call(monkeypatch, "load_checkpoint_tensor", 2)

    def restore_fails(self) -> None:
        raise RuntimeError(SECRET)

    monkeypatch.setattr(wu.WeightBackup, "restore", restore_fails)
    with pytest.raises(WeightUpdateError) as info:
        llm.load_weights(updated.items())
    assert info.value.restored is False
    assert "out of service" in str(info.value)
    check_clean(str(info.value))
    assert not core(llm).scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block
    with pytest.raises(EngineDeadError, match="out of service"):
        llm.generate(ps, GREEDY, use_tqdm=False)
    with pytest.raises(EngineDeadError, match="out of service"):
        llm.load_weights(updated.items())


def test_error_pickles_with_restored() -> None:
    """It crosses processes (tensor-parallel ranks, the engine core) with ``restored``."""
    import pickle

    for restored in (True, False):
        e = pickle.loads(pickle.dumps(WeightUpdateError("msg", restored=restored)))
        assert isinstance(e, WeightUpdateError) and e.restored is restored and str(e) == "msg"


def stage_failing_on_rank1(runner, weights) -> int:
    """``stage_weights`` whose 2nd tensor fails on tp rank 1 only: rank 0 loads all of it."""
    if runner.tp_rank != 1:
        return runner.stage_weights(weights)
    orig = wu.load_checkpoint_tensor
    calls = []

    def failing(*args):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(SECRET)
        return orig(*args)

    wu.load_checkpoint_tensor = failing
    try:
        return runner.stage_weights(weights)
    finally:
        wu.load_checkpoint_tensor = orig


def test_tp2_one_rank_failing_undoes_both(tiny_llama_dir, updated, reference) -> None:
    """Rank 0 loaded the whole update, rank 1 failed: rank 0's load is rolled back too."""
    llm = engine(tiny_llama_dir, tensor_parallel_size=2, enable_prefix_caching=True)
    try:
        ps = long_prompts(vocab(llm))
        before, _ = run(llm, ps)
        assert before == reference()
        c = core(llm)
        batch = list(updated.items())
        with pytest.raises(WeightUpdateError) as info:
            c._update(lambda: c.executor.collective_rpc(stage_failing_on_rank1, (batch,)))
        assert info.value.restored is True
        check_clean(str(info.value))
        after, cached = run(llm, ps)
        assert after == before and cached == [0] * len(ps)
        # A refused one changes nothing on either rank; a good one loads on both.
        with pytest.raises(ValueError, match="expected"):
            llm.load_weights([(GOOD, updated[GOOD]), BAD["shape"][:2]])
        assert run(llm, ps)[0] == before
        assert llm.load_weights(batch) == len(batch)
        assert run(llm, ps)[0] != before
    finally:
        llm.llm_engine.shutdown()


EXPERT = {"mixtral": "model.layers.0.block_sparse_moe.experts.2.",
          "qwen3-moe": "model.layers.0.mlp.experts.2."}


@pytest.mark.parametrize("arch", ["mixtral", "qwen3-moe"])
@pytest.mark.parametrize("kw", [{}, {"quantization": "int8"}], ids=["float32", "int8"])
def test_moe_update_all_or_nothing(tiny_model_dir, tmp_path, monkeypatch, arch, kw) -> None:
    """Experts: a per-expert tensor of the wrong shape (here a down projection's transpose) is
    refused from the headers; a failure mid-load restores the float or quantized stacks."""
    src = tiny_model_dir(arch)
    perturbed_model(src, tmp_path / "next")
    weights = checkpoint_weights(tmp_path / "next")
    down = next(n for n in weights
                if n.startswith(EXPERT[arch]) and (".w2." in n or ".down_proj." in n))
    llm = engine(src, enable_prefix_caching=True, **kw)
    ps = long_prompts(vocab(llm))
    before = run(llm, ps)[0]
    assert before == run(engine(src, **kw), ps)[0]
    bad = write_checkpoint(src, tmp_path / "bad", {**weights, down: weights[down].t()})
    with pytest.raises(ValueError, match=repr(down) + ".*expected") as info:
        core(llm).update_weights_from_disk(str(bad))
    check_clean(str(info.value))
    assert run(llm, ps)[0] == before
    fail_on_call(monkeypatch, "load_checkpoint_tensor", len(weights) // 2)
    with pytest.raises(WeightUpdateError) as err:
        llm.load_weights(weights.items())
    assert err.value.restored is True
    after, cached = run(llm, ps)
    assert after == before and cached == [0] * len(ps)


def test_phi3_fused_checkpoint_updates(tiny_model_dir, tmp_path) -> None:
    """Phi-3 checkpoints store fused qkv_proj / gate_up_proj tensors: split as at start-up, they
    update the model (a wrongly sized fused one is refused first)."""
    src = tiny_model_dir("phi3")
    perturbed_model(src, tmp_path / "next")
    weights = checkpoint_weights(tmp_path / "next")
    assert "model.layers.0.self_attn.qkv_proj.weight" in weights
    llm = engine(src)
    ps = long_prompts(vocab(llm))
    before = run(llm, ps)[0]
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    with pytest.raises(ValueError, match=repr(qkv)):
        llm.load_weights([*weights.items(), (qkv, weights[qkv][:-1])])
    assert run(llm, ps)[0] == before
    assert core(llm).update_weights_from_disk(str(tmp_path / "next")) == len(weights)
    after = run(llm, ps)[0]
    assert after == run(engine(tmp_path / "next"), ps)[0] and after != before
