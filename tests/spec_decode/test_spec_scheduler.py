"""The scheduler with drafts (no model): scheduling and cutting drafts, rolling back rejected
ones, prefix caching and preemption still exact, stops inside an accepted run, the counters."""

from __future__ import annotations

import random

import pytest
from spec_fakes import (
    SpecFakeRunner,
    make_request,
    make_scheduler,
    model_token,
    run,
    true_continuation,
)

from pagellm.core.sched_output import ModelRunnerOutput


def _prompts(n: int, seed: int = 0) -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {f"r{i}": [rng.randrange(1, 50) for _ in range(rng.randint(3, 30))]
            for i in range(n)}


def _reference(prompts: dict[str, list[int]], max_tokens: int) -> dict[str, list[int]]:
    return {rid: true_continuation(p, max_tokens) for rid, p in prompts.items()}


@pytest.mark.parametrize("budget", [64, 13])
def test_outputs_equal_the_model_with_every_acceptance_count(budget: int) -> None:
    prompts = _prompts(6)
    sched = make_scheduler(k=3, max_num_batched_tokens=budget, max_num_seqs=6)
    runner = SpecFakeRunner(4, k=3)
    for rid, p in prompts.items():
        sched.add_request(make_request(rid, p, max_tokens=20))
    assert run(sched, runner) == _reference(prompts, 20)
    stats = sched.make_stats().spec_decoding
    assert stats is not None and runner.max_drafts_seen == 3
    assert stats.num_drafts > 0 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    per_pos = stats.num_accepted_tokens_per_pos
    assert sum(per_pos) == stats.num_accepted_tokens and per_pos == sorted(per_pos, reverse=True)
    assert sched.kv_cache_manager.usage == 0.0


def test_preemption_clears_drafts_and_stays_exact() -> None:
    prompts = _prompts(4, seed=1)
    # 12 blocks of 4 cannot hold four requests of up to 30 + 24 tokens: preemptions.
    sched = make_scheduler(k=3, num_blocks=12, max_num_seqs=4)
    runner = SpecFakeRunner(4, k=3)
    for rid, p in prompts.items():
        sched.add_request(make_request(rid, p, max_tokens=24))
    outputs: dict[str, list[int]] = {}
    while sched.has_unfinished_requests():
        out = sched.schedule()
        for rid in out.preempted_req_ids:
            request = sched.requests[rid]
            assert request.spec_token_ids == [] and request.num_computed_tokens == 0
        for o in sched.update_from_output(out, runner.execute(out)):
            outputs.setdefault(o.req_id, []).extend(o.new_token_ids)
    assert sched.num_preemptions > 0
    assert outputs == _reference(prompts, 24)
    assert sched.kv_cache_manager.usage == 0.0


def test_rejected_drafts_never_reach_the_prefix_cache() -> None:
    # Every step rejects some drafts: a later request whose prompt is the first one's whole
    # text hits the cached blocks and must read exactly that text's K/V (the fake runner
    # checks every position it attends to; run() checks the cached blocks after each step).
    sched = make_scheduler(k=4, block_size=4)
    runner = SpecFakeRunner(4, k=4)
    prompt = [5, 9, 2, 7, 3, 1, 8]
    sched.add_request(make_request("a", prompt, max_tokens=30))
    out_a = run(sched, runner)["a"]
    assert sched.make_stats().spec_decoding.num_draft_tokens > 0
    text = prompt + out_a
    hits_before = sched.make_stats().prefix_cache_hits
    sched.add_request(make_request("b", text, max_tokens=5))
    assert run(sched, runner)["b"] == true_continuation(text, 5)
    # The whole text hit the cache (all but its last token, rounded down to a block).
    assert sched.make_stats().prefix_cache_hits - hits_before == (len(text) - 1) // 4 * 4


def test_drafts_cut_by_budget_max_model_len_and_max_tokens() -> None:
    sched = make_scheduler(k=4, max_num_batched_tokens=4, max_model_len=12)
    runner = SpecFakeRunner(4, k=4)
    sched.add_request(make_request("a", [1, 2, 3, 4, 5], max_tokens=6))
    sched.add_request(make_request("b", [6, 7], max_tokens=6))
    out = sched.schedule()  # a budget of 4: a's prompt is chunked, b waits
    sched.update_from_output(out, runner.execute(out))
    out = sched.schedule()
    sched.update_from_output(out, runner.execute(out))
    a, b = sched.requests["a"], sched.requests["b"]
    # Both decode now with 4 drafts each; the budget of 4 keeps one token for b.
    a.spec_token_ids, b.spec_token_ids = [11, 12, 13, 14], [21, 22, 23, 24]
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 3, "b": 1}
    assert out.scheduled_spec_decode_tokens == {"a": [11, 12]}
    assert a.spec_token_ids == [] and b.spec_token_ids == []  # b's were dropped
    sched.update_from_output(out, runner.execute(out))
    sched2 = make_scheduler(k=4, max_model_len=8)
    c = make_request("c", [1, 2, 3, 4, 5, 6], max_tokens=50)
    sched2.add_request(c)
    runner2 = SpecFakeRunner(4, k=4)
    out = sched2.schedule()
    sched2.update_from_output(out, runner2.execute(out))
    c.spec_token_ids = [1, 2, 3, 4]
    out = sched2.schedule()
    # 7 known tokens, 6 computed: position 7 is the last below max_model_len 8.
    assert out.scheduled_spec_decode_tokens == {"c": [1]}
    assert out.num_scheduled_tokens == {"c": 2}


def test_max_tokens_one_short_runs_no_drafts() -> None:
    sched = make_scheduler(k=3)
    runner = SpecFakeRunner(4, k=3)
    sched.add_request(make_request("a", [3, 4, 5], max_tokens=2))
    out = sched.schedule()
    sched.update_from_output(out, runner.execute(out))
    request = sched.requests["a"]
    request.spec_token_ids = [1, 2, 3]
    out = sched.schedule()
    assert out.scheduled_spec_decode_tokens == {} and out.num_scheduled_tokens == {"a": 1}


def _accept_all(token_ids: list[int], k: int) -> list[int]:
    return true_continuation(token_ids, k)


@pytest.mark.parametrize("stop", ["eos", "stop_token", "max_tokens"])
def test_stop_inside_an_accepted_run(stop: str) -> None:
    prompt = [4, 8, 15, 16]
    truth = true_continuation(prompt, 12)
    sched = make_scheduler(k=4)
    runner = SpecFakeRunner(4, k=4, propose=_accept_all)
    kwargs: dict = {"max_tokens": 12}
    if stop == "eos":
        kwargs["eos_token_id"] = truth[6]
    elif stop == "stop_token":
        kwargs["stop_token_ids"] = [truth[6]]
    else:
        kwargs["max_tokens"] = 7
    sched.add_request(make_request("a", prompt, **kwargs))
    outs = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        outs += sched.update_from_output(out, runner.execute(out))
    tokens = [t for o in outs for t in o.new_token_ids]
    # The first occurrence of the stop token ends it.
    end = 7 if stop == "max_tokens" else truth.index(truth[6]) + 1
    assert tokens == truth[:end]
    assert outs[-1].finish_reason == ("length" if stop == "max_tokens" else "stop")
    # Several tokens arrived in one step.
    assert max(len(o.new_token_ids) for o in outs) > 1
    assert sched.kv_cache_manager.usage == 0.0


def test_logprobs_follow_the_emitted_tokens() -> None:
    from pagellm.core.sched_output import Logprobs

    sched = make_scheduler(k=3)
    request = make_request("a", [1, 2, 3], max_tokens=3, logprobs=0)
    sched.add_request(request)
    out = sched.schedule()
    sched.update_from_output(out, ModelRunnerOutput(["a"], [[7]], spec_token_ids={"a": [8, 9]}))
    assert request.spec_token_ids == [8, 9]
    out = sched.schedule()
    assert out.scheduled_spec_decode_tokens == {"a": [8]}  # max_tokens 3: one draft at most
    records = [Logprobs(t, -0.5, 1, [], []) for t in (8, 5)]
    (o,) = sched.update_from_output(out, ModelRunnerOutput(["a"], [[8, 5]], [records]))
    assert o.new_token_ids == [8, 5] and o.finish_reason == "length"
    assert [r.sampled_token_id for r in o.new_logprobs] == [8, 5]


def test_rollback_of_computed_tokens() -> None:
    sched = make_scheduler(k=3)
    request = make_request("a", [1, 2, 3, 4, 5], max_tokens=20)
    sched.add_request(request)
    out = sched.schedule()
    sched.update_from_output(out, ModelRunnerOutput(["a"], [[6]], spec_token_ids={"a": [7, 8, 9]}))
    assert request.num_computed_tokens == 5 and request.num_tokens == 6
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 4} and request.num_computed_tokens == 9
    # One draft accepted (7), then the target's 10: 8 and 9 were rejected.
    sched.update_from_output(out, ModelRunnerOutput(["a"], [[7, 10]]))
    assert request.all_token_ids[-2:] == [7, 10]
    assert request.num_computed_tokens == 7 and request.num_tokens == 8
    assert request.spec_token_ids == []
    stats = sched.make_stats().spec_decoding
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 3, 1)
    assert stats.num_accepted_tokens_per_pos == [1, 0, 0]


def test_draft_model_lookahead_slots_are_reserved() -> None:
    sched = make_scheduler(k=3, method="draft_model", block_size=4)
    request = make_request("a", [1, 2, 3, 4, 5, 6], max_tokens=20)
    sched.add_request(request)
    assert request.num_lookahead_slots == 3
    out = sched.schedule()
    # 6 prompt tokens + 3 lookahead slots: 9 slots, 3 blocks.
    assert len(sched.kv_cache_manager.get_block_ids("a")) == 3
    sched.update_from_output(out, ModelRunnerOutput(["a"], [[7]], spec_token_ids={"a": [8, 9, 10]}))
    out = sched.schedule()
    # Positions 6..9 run; 3 more slots after them: 13 slots, 4 blocks.
    assert out.num_scheduled_tokens == {"a": 4}
    assert len(sched.kv_cache_manager.get_block_ids("a")) == 4


def test_no_speculation_no_counters() -> None:
    sched = make_scheduler(k=None)
    sched.add_request(make_request("a", [1, 2, 3], max_tokens=2))
    assert run(sched, SpecFakeRunner(4, k=3, propose=lambda t, k: [])) == {
        "a": true_continuation([1, 2, 3], 2)}
    assert sched.make_stats().spec_decoding is None
    assert model_token([1]) == model_token([1])
