"""`pagellm plan` for hybrid (linear attention) models against the engine: the recurrent state
slots and the prefix-cache snapshots come out of the KV budget the same way in both, and the
weight count equals the parameters the engine loads."""

from __future__ import annotations

import json

import pytest

from pagellm.entrypoints.cli import main


@pytest.mark.parametrize("caching", [False, True])
def test_plan_equals_what_the_engine_allocates(tiny_model_dir, capsys, caching):
    from pagellm.engine.core import EngineCore
    from pagellm.engine_args import EngineArgs

    path = str(tiny_model_dir("qwen3-next"))
    flags = ["--kv-cache-memory", "64MiB", "--max-model-len", "256", "--device", "cpu",
             "--dtype", "float32", "--max-num-seqs", "8"]
    assert main(["plan", path, *flags, *(["--enable-prefix-caching"] if caching else []),
                 "--json"]) == 0
    rank = json.loads(capsys.readouterr().out)["ranks"][0]
    core = EngineCore(EngineArgs(model=path, kv_cache_memory="64MiB", max_model_len=256,
                                 device="cpu", dtype="float32", max_num_seqs=8,
                                 enable_prefix_caching=caching).create_engine_config())
    runner = core.executor.runner
    kv = core.scheduler.kv_cache_manager
    assert rank["num_blocks"] == core.num_blocks
    assert rank["kv_bytes_per_token"] == runner.kv_plan.kv_bytes_per_token
    # 2 Gated DeltaNet layers x (conv 128 x 3 + state 4 x 16 x 16 x 4 bytes... in float32)
    assert rank["state_slot_bytes"] == 2 * (128 * 3 + 4 * 16 * 16) * 4
    assert rank["state_bytes"] == rank["state_slot_bytes"] * 9
    state = sum(t.numel() * t.element_size() for ts in runner.state_caches.values() for t in ts)
    assert state == rank["state_slot_bytes"] * (9 + rank["state_snapshot_slots"])
    assert kv.state_slots.num_slots == 8
    if caching:
        assert rank["state_snapshot_slots"] == kv.snapshots.num_slots > 0
        assert (rank["state_snapshot_interval_tokens"]
                == kv.snapshots.interval_blocks * kv.block_size)
    else:
        assert rank["state_snapshot_slots"] == 0 and kv.snapshots is None
    assert rank["weight_bytes"] == runner.weight_bytes
