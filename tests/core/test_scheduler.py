from __future__ import annotations

import random

import pytest
from core_fakes import (
    FIXED_TOKEN,
    FakeRunner,
    check_step,
    content_token,
    make_request,
    make_scheduler,
    output_tokens,
    run_until_idle,
)

from pagellm.core.sched_output import Logprobs, ModelRunnerOutput
from pagellm.core.scheduler import Scheduler
from pagellm.request import RequestStatus


def step(sched: Scheduler, runner: FakeRunner) -> tuple:
    out = sched.schedule()
    check_step(sched, out)
    return out, sched.update_from_output(out, runner.execute(out))


def assert_idle(sched: Scheduler) -> None:
    kv = sched.kv_cache_manager
    assert not sched.has_unfinished_requests() and sched.requests == {}
    assert kv.get_num_free_blocks() == sched.num_blocks and kv.usage == 0.0
    assert kv.req_to_blocks == {} and kv.req_to_block_hashes == {}
    kv.block_pool.check_invariants()


def test_budget_and_chunked_prefill_across_steps() -> None:
    sched = make_scheduler(block_size=4, max_num_batched_tokens=16)
    runner = FakeRunner(4)
    sched.add_request(make_request("a", list(range(50)), max_tokens=3))
    plan = []
    for _ in range(6):
        out, outs = step(sched, runner)
        plan.append(out.num_scheduled_tokens["a"])
        assert out.total_num_scheduled_tokens == plan[-1]
        assert [o.new_token_ids for o in outs] == ([[FIXED_TOKEN]] if len(plan) >= 4 else [])
    assert plan == [16, 16, 16, 2, 1, 1]
    assert not sched.has_unfinished_requests()
    assert_idle(sched)


def test_new_then_cached_request_data() -> None:
    sched = make_scheduler(block_size=4, max_num_batched_tokens=8)
    runner = FakeRunner(4)
    sched.add_request(make_request("a", list(range(10)), max_tokens=2))
    out, _ = step(sched, runner)
    (new,) = out.scheduled_new_reqs
    assert (new.req_id, new.prompt_token_ids, new.output_token_ids) == ("a", list(range(10)), [])
    assert new.block_ids == [0, 1] and new.num_computed_tokens == 0
    out, _ = step(sched, runner)
    assert out.scheduled_new_reqs == []
    c = out.scheduled_cached_reqs
    assert (c.req_ids, c.new_block_ids, c.num_computed_tokens) == (["a"], [[2]], [8])


def test_mixed_prefill_and_decode_in_one_step() -> None:
    sched = make_scheduler(block_size=4, max_num_batched_tokens=10)
    runner = FakeRunner(4)
    sched.add_request(make_request("a", list(range(6)), max_tokens=10))
    step(sched, runner)  # a prefilled, first token sampled
    sched.add_request(make_request("b", list(range(100, 130)), max_tokens=2))
    out, outs = step(sched, runner)
    assert out.num_scheduled_tokens == {"a": 1, "b": 9}  # decode first, then a prefill chunk
    assert [o.req_id for o in outs] == ["a"]
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"a": 1, "b": 9}


def test_max_num_seqs_and_budget_every_step() -> None:
    rng = random.Random(0)
    sched = make_scheduler(num_blocks=200, block_size=4, max_num_seqs=3,
                           max_num_batched_tokens=20)
    runner = FakeRunner(4, next_token=content_token)
    for i in range(12):
        prompt = [rng.randrange(1, 500) for _ in range(rng.randrange(1, 40))]
        sched.add_request(make_request(f"r{i}", prompt, max_tokens=rng.randrange(1, 8)))
    seen_running = set()
    while sched.has_unfinished_requests():
        out = sched.schedule()
        check_step(sched, out)  # budget and max_num_seqs
        seen_running.add(len(sched.running))
        # work-conserving: the budget is only left over when nothing more could run
        if out.total_num_scheduled_tokens < 20:
            assert not sched.waiting or len(sched.running) == 3
        sched.update_from_output(out, runner.execute(out))
    assert max(seen_running) == 3
    assert_idle(sched)


def test_outputs_independent_of_budget_and_batching() -> None:
    """Same prompts, different budgets/limits -> the same tokens (the runner's KV check also
    holds every step)."""
    rng = random.Random(1)
    prompts = [[rng.randrange(1, 300) for _ in range(rng.randrange(2, 30))] for _ in range(8)]

    def run(budget: int, seqs: int) -> dict[str, list[int]]:
        sched = make_scheduler(num_blocks=100, block_size=4, max_num_seqs=seqs,
                               max_num_batched_tokens=budget)
        for i, p in enumerate(prompts):
            sched.add_request(make_request(f"r{i}", p, max_tokens=5))
        outs = run_until_idle(sched, FakeRunner(4, next_token=content_token))
        assert_idle(sched)
        return {k: output_tokens(v) for k, v in outs.items()}

    ref = run(1000, 100)
    assert all(len(v) == 5 for v in ref.values())
    assert run(7, 2) == ref
    assert run(3, 8) == ref


PREEMPT_PROMPTS = {"a": list(range(1, 9)), "b": list(range(11, 19)), "c": [21, 22, 23, 24]}


@pytest.mark.parametrize("caching", [False, True])
def test_preemption_newest_first_then_resume(caching: bool) -> None:
    # 6 blocks of 4 = 24 slots; a and b grow to 8 + 12 = 20 tokens each -> cannot both fit.
    sched = make_scheduler(num_blocks=6, block_size=4, max_num_seqs=2, max_num_batched_tokens=32,
                           enable_prefix_caching=caching)
    runner = FakeRunner(4, next_token=content_token)
    for rid, prompt in PREEMPT_PROMPTS.items():
        sched.add_request(make_request(rid, prompt, max_tokens=12))
    b = sched.requests["b"]
    outs: dict[str, list[int]] = {"a": [], "b": [], "c": []}
    preempted_at = None
    resumed_seen = False
    while sched.has_unfinished_requests():
        num_b_before = len(outs["b"])
        out, step_outs = step(sched, runner)
        for o in step_outs:
            outs[o.req_id] += o.new_token_ids
        if out.preempted_req_ids and preempted_at is None:
            preempted_at = sched.num_steps
            assert out.preempted_req_ids == {"b"}  # the newest running request
            # back at the front of waiting, ahead of c; c is not admitted in this step
            assert [r.request_id for r in sched.waiting] == ["b", "c"]
            assert b.status == RequestStatus.PREEMPTED
            assert b.num_computed_tokens == 0 and b.num_preemptions == 1
            assert sched.kv_cache_manager.get_block_ids("b") == []
            assert sched.make_stats().num_preemptions == 1
            assert "b" not in out.num_scheduled_tokens and out.scheduled_new_reqs == []
        if preempted_at is not None and not resumed_seen and "b" in {
            n.req_id for n in out.scheduled_new_reqs
        }:
            # resumed with all its tokens so far
            resumed = next(n for n in out.scheduled_new_reqs if n.req_id == "b")
            assert len(resumed.output_token_ids) == num_b_before > 0
            # with caching, b finds its own head block again; it still counts as never cached
            assert resumed.num_computed_tokens == (4 if caching else 0)
            assert b.num_cached_tokens == 0
            resumed_seen = True
    assert preempted_at is not None and resumed_seen
    # identical to an unconstrained run
    ref = make_scheduler(num_blocks=64, block_size=4, enable_prefix_caching=False)
    for rid, prompt in PREEMPT_PROMPTS.items():
        ref.add_request(make_request(rid, prompt, max_tokens=12))
    ref_outs = run_until_idle(ref, FakeRunner(4, next_token=content_token))
    assert outs == {k: output_tokens(v) for k, v in ref_outs.items()}
    assert ref.num_preemptions == 0
    assert_idle(sched)


def test_blocks_freed_in_the_step_a_request_finishes() -> None:
    sched = make_scheduler(num_blocks=10, block_size=4)
    runner = FakeRunner(4)
    sched.add_request(make_request("a", list(range(9)), max_tokens=1))
    sched.add_request(make_request("b", list(range(9)), max_tokens=3))
    out, outs = step(sched, runner)
    assert [(o.req_id, o.finish_reason) for o in outs] == [("a", "length"), ("b", None)]
    kv = sched.kv_cache_manager
    assert kv.get_block_ids("a") == [] and kv.get_num_free_blocks() == 10 - 3
    assert [r.request_id for r in sched.running] == ["b"]
    out, _ = step(sched, runner)
    assert out.finished_req_ids == {"a"}
    out, _ = step(sched, runner)
    assert out.finished_req_ids == set()
    assert_idle(sched)


def test_abort_frees_now_and_reports_next_step() -> None:
    sched = make_scheduler(num_blocks=10, block_size=4, max_num_seqs=1)
    runner = FakeRunner(4)
    for i, rid in enumerate(("a", "b", "c")):
        sched.add_request(make_request(rid, list(range(i * 10, i * 10 + 9)), max_tokens=5))
    step(sched, runner)
    kv = sched.kv_cache_manager
    assert kv.get_num_free_blocks() == 7
    sched.finish_requests(["a", "b", "nope"], RequestStatus.FINISHED_ABORTED)  # running, waiting
    assert kv.get_num_free_blocks() == 10 and kv.get_block_ids("a") == []
    assert [r.request_id for r in sched.waiting] == ["c"] and sched.running == []
    assert sched.get_num_unfinished_requests() == 1
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)  # already gone: ignored
    out, _ = step(sched, runner)
    assert out.finished_req_ids == {"a", "b"}
    assert out.num_scheduled_tokens == {"c": 9}
    with pytest.raises(ValueError, match="status"):
        sched.finish_requests("c", RequestStatus.RUNNING)
    run_until_idle(sched, runner)
    assert_idle(sched)


def test_abort_while_step_in_flight_drops_its_tokens() -> None:
    sched = make_scheduler()
    runner = FakeRunner(4)
    sched.add_request(make_request("a", list(range(5))))
    out = sched.schedule()
    result = runner.execute(out)
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert sched.update_from_output(out, result) == []
    assert_idle(sched)


def run_one(tokens: list[int], max_model_len: int = 256, **kw: object):
    """Run one request whose runner emits ``tokens`` in order; return (outputs, request)."""
    sched = make_scheduler(max_model_len=max_model_len)
    req = make_request("r", [1, 2, 3], **kw)  # type: ignore[arg-type]
    sched.add_request(req)
    runner = FakeRunner(4, next_token=lambda rid, toks: tokens[len(toks) - 3])
    outs = run_until_idle(sched, runner)["r"]
    assert_idle(sched)
    return outs, req


def test_stop_on_eos() -> None:
    outs, req = run_one([5, 6, 0, 8], max_tokens=10, eos_token_id=0)
    assert output_tokens(outs) == [5, 6, 0]
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason is None
    assert req.status == RequestStatus.FINISHED_STOPPED


def test_ignore_eos_runs_to_max_tokens() -> None:
    outs, _ = run_one([5, 0, 0, 8, 9], max_tokens=4, eos_token_id=0, ignore_eos=True)
    assert output_tokens(outs) == [5, 0, 0, 8] and outs[-1].finish_reason == "length"


def test_stop_token_ids_set_stop_reason() -> None:
    outs, _ = run_one([5, 42, 9], max_tokens=10, stop_token_ids=[42, 43])
    assert output_tokens(outs) == [5, 42]
    assert (outs[-1].finish_reason, outs[-1].stop_reason) == ("stop", 42)


def test_min_tokens_suppresses_eos_and_stop_tokens() -> None:
    outs, _ = run_one([0, 42, 0, 7], max_tokens=10, eos_token_id=0, stop_token_ids=[42],
                      min_tokens=3)
    assert output_tokens(outs) == [0, 42, 0] and outs[-1].finish_reason == "stop"


def test_eos_beats_length_on_the_last_token() -> None:
    outs, _ = run_one([5, 0], max_tokens=2, eos_token_id=0)
    assert outs[-1].finish_reason == "stop"


def test_max_tokens_and_max_model_len() -> None:
    outs, _ = run_one(list(range(10, 30)), max_tokens=4)
    assert len(output_tokens(outs)) == 4 and outs[-1].finish_reason == "length"
    outs, req = run_one(list(range(10, 30)), max_model_len=8, max_tokens=100)
    assert req.num_tokens == 8 and len(output_tokens(outs)) == 5
    assert outs[-1].finish_reason == "length"


def test_outputs_carry_logprobs_and_cached_tokens() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("a", list(range(5))))
    out = sched.schedule()
    lp = Logprobs(9, -0.5, 1, [9, 3], [-0.5, -1.5])
    (o,) = sched.update_from_output(out, ModelRunnerOutput(["a"], [[9]], [lp]))
    assert o.new_token_ids == [9] and o.new_logprobs == [lp] and o.num_cached_tokens == 0
    req = sched.requests["a"]
    assert req.first_scheduled_time is not None and req.first_token_time is not None


def test_add_request_validation() -> None:
    sched = make_scheduler(max_model_len=8)
    sched.add_request(make_request("a", [1]))
    with pytest.raises(ValueError, match="already"):
        sched.add_request(make_request("a", [1]))
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add_request(make_request("b", list(range(9))))
    with pytest.raises(ValueError, match="prompt_token_ids"):
        sched.add_request(make_request("c", []))


def test_long_prefill_never_stalls_running_decodes() -> None:
    """A running request still prefilling a long prompt leaves room for the decodes behind it."""
    from types import SimpleNamespace

    from pagellm.core.scheduler import Scheduler
    from pagellm.request import Request
    from pagellm.sampling_params import SamplingParams

    sched = Scheduler(SimpleNamespace(max_num_seqs=8, max_num_batched_tokens=64,
                                      max_model_len=4096),
                      SimpleNamespace(block_size=16, enable_prefix_caching=False,
                                      prefix_caching_hash_algo="sha256"), num_blocks=512)
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    shorts = [Request(f"s{i}", [1, 2, 3], params, max_tokens=50) for i in range(3)]
    for r in shorts:
        sched.add_request(r)
    out = sched.schedule()  # the three short prompts prefill in one step
    for r in shorts:  # pretend the runner sampled a token for each
        r.append_output_token_ids([7])
    long_req = Request("long", list(range(10, 1010)), params, max_tokens=50)
    sched.running.insert(0, long_req)  # worst case: the long prefill is first in line
    sched.kv_cache_manager.allocate_slots(long_req, 16)
    long_req.num_computed_tokens = 16
    long_req.status = shorts[0].status
    sched.requests["long"] = long_req
    out = sched.schedule()
    assert all(out.num_scheduled_tokens[r.request_id] == 1 for r in shorts)
    assert out.num_scheduled_tokens["long"] == 64 - 3
    assert out.total_num_scheduled_tokens <= 64
