"""Async scheduling in the scheduler (no model): step N+1 is scheduled before step N's tokens
are processed, with the fake runner (which checks every attended K/V slot) running the steps in
order. Outputs must equal the synchronous scheduler's, whatever the moment each step runs (right
at submission, or only when collected, after the next schedule() freed and handed out blocks),
with chunked prefill, prefix hits, preemption, stops, aborts and length limits; no block leaks."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from core_fakes import FakeRunner, check_step, content_token, make_request, run_until_idle

from pagellm.core.scheduler import Scheduler
from pagellm.request import RequestStatus

EOS = 3
STOP = 5


def next_token(req_id: str, token_ids: list[int]) -> int:
    """A deterministic model over a small alphabet, so EOS and stop tokens come up often."""
    return content_token(req_id, token_ids) % 20 + 1


def make_scheduler(async_scheduling: bool, num_blocks: int = 64, block_size: int = 4,
                   max_num_seqs: int = 8, max_num_batched_tokens: int = 64,
                   max_model_len: int = 256, enable_prefix_caching: bool = True) -> Scheduler:
    sched_cfg = SimpleNamespace(max_num_seqs=max_num_seqs,
                                max_num_batched_tokens=max_num_batched_tokens,
                                max_model_len=max_model_len, async_scheduling=async_scheduling)
    cache_cfg = SimpleNamespace(block_size=block_size, enable_prefix_caching=enable_prefix_caching,
                                prefix_caching_hash_algo="sha256")
    return Scheduler(sched_cfg, cache_cfg, num_blocks)


class CountingRunner(FakeRunner):
    """Counts the tokens sampled per request (emitted or not)."""

    def __init__(self, block_size: int) -> None:
        super().__init__(block_size, next_token=self._next)
        self.num_sampled: dict[str, int] = {}

    def _next(self, req_id: str, token_ids: list[int]) -> int:
        self.num_sampled[req_id] = self.num_sampled.get(req_id, 0) + 1
        return next_token(req_id, token_ids)


def check_placeholders(sched: Scheduler) -> None:
    for r in sched.running:
        p = r.num_output_placeholders
        assert 0 <= p <= 2, (r.request_id, p)
        if p:  # the last sampled position is the next input
            assert r.num_computed_tokens == r.num_tokens + p - 1, r.request_id
        assert r.num_output_tokens + p <= r.max_tokens
        assert r.num_tokens + p <= sched.max_model_len
    for r in sched.waiting:
        assert r.num_output_placeholders == 0


def run_pipelined(sched: Scheduler, runner: FakeRunner, run_early: bool,
                  aborts: dict[int, list[str]] | None = None,
                  max_steps: int = 10_000) -> dict[str, list]:
    """OverlappedSteps.step's order (engine/overlap.py). ``run_early``: a step runs as soon as it is
    submitted; otherwise only when collected, after the next step was scheduled. ``aborts``:
    iteration -> request ids aborted after it (a step is in flight then)."""
    outputs: dict[str, list] = {}
    in_flight: list | None = None  # [SchedulerOutput, ModelRunnerOutput or None]

    def run(entry: list) -> None:
        if entry[1] is None:
            entry[1] = runner.execute(entry[0])

    def collect(entry: list) -> None:
        run(entry)
        for o in sched.update_from_output(entry[0], entry[1]):
            outputs.setdefault(o.req_id, []).append(o)
        check_placeholders(sched)

    for it in range(max_steps):
        if not sched.has_unfinished_requests():
            if in_flight is None:
                return outputs
            collect(in_flight)
            in_flight = None
            continue
        out = sched.schedule()
        check_step(sched, out)
        check_placeholders(sched)
        if out.total_num_scheduled_tokens == 0 and in_flight is not None:
            sched.defer_to_next_step(out)
            collect(in_flight)
            in_flight = None
            continue
        entry = [out, None]
        if run_early:
            run(entry)
        previous, in_flight = in_flight, entry
        if previous is not None:
            collect(previous)
        for req_id in (aborts or {}).get(it, []):
            sched.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)
    raise AssertionError("scheduler did not become idle")


def workload(seed: int, num: int = 24, max_model_len: int = 256) -> list:
    """Mixed requests: shared prefixes (prefix hits), long prompts (chunked), EOS and stop
    tokens, ignore_eos, max_tokens from 1, some capped by max_model_len."""
    rng = random.Random(seed)
    base = [rng.randrange(30, 90) for _ in range(24)]
    reqs = []
    for i in range(num):
        prompt = ((base[: rng.choice([4, 8, 13])] if i % 3 == 0 else [])
                  + [rng.randrange(30, 90) for _ in range(rng.randint(1, 40))])
        max_tokens = rng.choice([1, 2, 5, 12, 40, 400])
        params = {}
        if i % 4 == 1:
            params["stop_token_ids"] = [STOP]
        if i % 5 == 2:
            params["ignore_eos"] = True
        reqs.append((f"r{i}", prompt[: max_model_len - 1], max_tokens, params))
    return reqs


def run_workload(reqs: list, async_scheduling: bool, run_early: bool = False,
                 **sched_kw) -> tuple[dict, Scheduler, CountingRunner, dict]:
    sched = make_scheduler(async_scheduling, **sched_kw)
    runner = CountingRunner(sched.block_size)
    requests = {}
    for req_id, prompt, max_tokens, params in reqs:
        requests[req_id] = make_request(req_id, prompt, max_tokens=max_tokens, eos_token_id=EOS,
                                        **params)
        sched.add_request(requests[req_id])
    if async_scheduling:
        outs = run_pipelined(sched, runner, run_early)
    else:
        outs = run_until_idle(sched, runner)
    return outs, sched, runner, requests


def summary(outs: dict) -> dict:
    return {req_id: ([t for o in os for t in o.new_token_ids], os[-1].finish_reason,
                     os[-1].stop_reason) for req_id, os in outs.items()}


def assert_idle(sched: Scheduler) -> None:
    kv = sched.kv_cache_manager
    assert not sched.has_unfinished_requests() and sched.requests == {}
    assert kv.get_num_free_blocks() == sched.num_blocks
    assert kv.req_to_blocks == {}
    kv.block_pool.check_invariants()


@pytest.mark.parametrize("run_early", [False, True])
@pytest.mark.parametrize("sched_kw", [
    dict(),
    dict(max_num_batched_tokens=16, max_num_seqs=6),  # chunked prefill
    dict(max_model_len=48, enable_prefix_caching=False),  # max_model_len stops
], ids=["plain", "chunked", "short-context"])
def test_outputs_match_synchronous_scheduling(run_early: bool, sched_kw: dict) -> None:
    reqs = workload(seed=1, max_model_len=sched_kw.get("max_model_len", 256))
    want, _, sync_runner, sync_reqs = run_workload(reqs, False, **sched_kw)
    got, sched, runner, requests = run_workload(reqs, True, run_early, **sched_kw)
    assert summary(got) == summary(want)
    reasons = {r for _, r, _ in summary(want).values()}
    assert {"stop", "length"} <= reasons
    assert_idle(sched)
    for req_id, os in want.items():
        emitted = sum(len(o.new_token_ids) for o in os)
        if requests[req_id].num_preemptions or sync_reqs[req_id].num_preemptions:
            continue  # a preempted request samples again what it dropped
        assert sync_runner.num_sampled.get(req_id, 0) == emitted
        # A request that stops may have one more token computed and dropped; one that reaches
        # max_tokens or max_model_len never runs past it.
        wasted = runner.num_sampled.get(req_id, 0) - emitted
        assert wasted in ((0, 1) if os[-1].finish_reason == "stop" else (0,)), req_id
    # The overlap really happened: some decodes ran while their input was still in flight.
    assert sum(runner.num_sampled.values()) > sum(sync_runner.num_sampled.values())


@pytest.mark.parametrize("run_early", [False, True])
def test_preemption_under_a_tiny_kv_cache(run_early: bool) -> None:
    reqs = workload(seed=2, num=16, max_model_len=64)
    kw = dict(num_blocks=24, max_num_batched_tokens=32, max_model_len=64)
    want, sync_sched, _, _ = run_workload(reqs, False, **kw)
    got, sched, _, _ = run_workload(reqs, True, run_early, **kw)
    assert summary(got) == summary(want)
    assert sched.num_preemptions > 0 and sync_sched.num_preemptions > 0
    assert_idle(sched)


def test_aborts_while_a_step_is_in_flight_free_every_block() -> None:
    reqs = workload(seed=3, num=12, max_model_len=128)
    sched = make_scheduler(True, num_blocks=48, max_model_len=128)
    runner = CountingRunner(sched.block_size)
    for req_id, prompt, max_tokens, _ in reqs:
        sched.add_request(make_request(req_id, prompt, max_tokens=max(max_tokens, 12),
                                       eos_token_id=EOS, ignore_eos=True))
    aborted = {1: ["r0", "r5"], 2: ["r1"], 4: ["r2", "r7", "r9"], 6: ["r3"]}
    outs = run_pipelined(sched, runner, run_early=False, aborts=aborted)
    assert_idle(sched)
    for ids in aborted.values():
        for req_id in ids:
            # Nothing came after the abort: no output ends "length" for an aborted request.
            assert all(o.finish_reason is None for o in outs.get(req_id, []))
    assert all(outs[f"r{i}"][-1].finish_reason == "length" for i in (4, 6, 8, 10, 11))


def test_max_tokens_counts_tokens_in_flight() -> None:
    sched = make_scheduler(True)
    runner = CountingRunner(sched.block_size)
    sched.add_request(make_request("a", [40, 41, 42], max_tokens=3, ignore_eos=True))
    plan = []
    in_flight = None
    while sched.has_unfinished_requests():
        out = sched.schedule()
        if out.total_num_scheduled_tokens == 0:
            sched.defer_to_next_step(out)
        plan.append(out.num_scheduled_tokens.get("a", 0))
        if in_flight is not None:
            sched.update_from_output(in_flight, runner.execute(in_flight))
        in_flight = out if out.total_num_scheduled_tokens else None
    # Prefill, then two decodes each scheduled before the previous token came back; the 4th
    # schedule finds 3 tokens sampled or in flight and runs nothing.
    assert plan == [3, 1, 1, 0]
    assert runner.num_sampled == {"a": 3}
    assert_idle(sched)


def test_failed_step_uncaches_the_blocks_of_both_steps_in_flight() -> None:
    sched = make_scheduler(True, block_size=4)
    prompt = list(range(40, 60))
    sched.add_request(make_request("a", prompt, max_tokens=4))
    first = sched.schedule()  # hashes a's 5 full blocks
    sched.add_request(make_request("b", prompt + [1, 2, 3, 4, 5]))
    second = sched.schedule()  # b hits a's blocks and hashes one more of its own
    assert second.scheduled_new_reqs[0].num_computed_tokens == 20
    pool = sched.kv_cache_manager.block_pool
    assert len(pool.cached_block_hash_to_block) == 6
    # Step `first` raised: it and the step after it fail, and no block they hashed stays.
    failed = sched.fail_step(first) + sched.fail_step(second)
    assert sorted(failed) == ["a", "b"]
    assert pool.cached_block_hash_to_block == {}
    assert sched.finished_req_ids == {"a", "b"}
    assert_idle(sched)
