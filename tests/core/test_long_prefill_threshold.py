"""--long-prefill-token-threshold (vLLM's): while other requests are scheduled, no request gets
more than the threshold in one step; a request alone takes the whole budget. Which request gets
how many tokens per step, no starvation, and the same outputs as without the cap."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from core_fakes import FakeRunner, check_step, content_token, make_request, run_until_idle

from pagellm.core.scheduler import Scheduler


def make_scheduler(threshold: int, max_num_batched_tokens: int = 64, max_num_seqs: int = 8,
                   num_blocks: int = 256, block_size: int = 4) -> Scheduler:
    sched_cfg = SimpleNamespace(max_num_seqs=max_num_seqs,
                                max_num_batched_tokens=max_num_batched_tokens,
                                max_model_len=256, long_prefill_token_threshold=threshold)
    cache_cfg = SimpleNamespace(block_size=block_size, enable_prefix_caching=False,
                                prefix_caching_hash_algo="sha256")
    return Scheduler(sched_cfg, cache_cfg, num_blocks)


def step(sched: Scheduler, runner: FakeRunner) -> dict[str, int]:
    out = sched.schedule()
    check_step(sched, out)
    sched.update_from_output(out, runner.execute(out))
    return dict(out.num_scheduled_tokens)


def test_alone_a_prompt_takes_the_whole_budget() -> None:
    sched, runner = make_scheduler(threshold=8), FakeRunner(4)
    sched.add_request(make_request("a", list(range(50)), max_tokens=2))
    assert step(sched, runner) == {"a": 50}


def test_prompts_are_chunked_at_the_threshold_beside_decodes() -> None:
    sched, runner = make_scheduler(threshold=8), FakeRunner(4)
    sched.add_request(make_request("d", list(range(5)), max_tokens=20))
    assert step(sched, runner) == {"d": 5}  # alone: uncapped
    sched.add_request(make_request("p", list(range(100, 130)), max_tokens=2))
    sched.add_request(make_request("q", list(range(200, 212)), max_tokens=2))
    # Both new prompts start in the same step, 8 tokens each; the decode gets its token.
    assert step(sched, runner) == {"d": 1, "p": 8, "q": 8}
    assert step(sched, runner) == {"d": 1, "p": 8, "q": 4}  # q's prompt done: 1st token
    assert step(sched, runner) == {"d": 1, "p": 8, "q": 1}  # q's 2nd token ends it
    assert step(sched, runner) == {"d": 1, "p": 6}  # p's last chunk: 30 = 8 + 8 + 8 + 6
    assert step(sched, runner) == {"d": 1, "p": 1}


def test_threshold_off_keeps_the_budget_rule() -> None:
    sched, runner = make_scheduler(threshold=0), FakeRunner(4)
    sched.add_request(make_request("d", list(range(5)), max_tokens=20))
    step(sched, runner)
    sched.add_request(make_request("p", list(range(100, 200)), max_tokens=2))
    assert step(sched, runner) == {"d": 1, "p": 63}


@pytest.mark.parametrize("threshold", [1, 3, 16])
def test_no_starvation_and_same_outputs_as_without_the_cap(threshold: int) -> None:
    rng = random.Random(threshold)
    requests = [(f"r{i}", [rng.randrange(1, 1000) for _ in range(rng.randint(1, 90))],
                 rng.randint(1, 12)) for i in range(24)]

    def run(cap: int) -> tuple[dict[str, list[int]], int]:
        sched = make_scheduler(threshold=cap, max_num_batched_tokens=32)
        runner = FakeRunner(4, next_token=content_token)
        for rid, prompt, max_tokens in requests:
            sched.add_request(make_request(rid, prompt, max_tokens=max_tokens))
        steps = 0
        outputs: dict[str, list[int]] = {}
        while sched.has_unfinished_requests():
            steps += 1
            assert steps < 5_000
            decoding = {r.request_id for r in sched.running
                        if r.num_computed_tokens == r.num_tokens - 1}
            shared = sched.get_num_unfinished_requests() > 1
            out = sched.schedule()
            check_step(sched, out)
            if cap and shared:
                assert max(out.num_scheduled_tokens.values()) <= cap
            # Every decoding request gets its token every step (32 >= 8 running).
            assert decoding <= set(out.num_scheduled_tokens)
            for o in sched.update_from_output(out, runner.execute(out)):
                outputs.setdefault(o.req_id, []).extend(o.new_token_ids)
        assert sched.kv_cache_manager.get_num_free_blocks() == sched.num_blocks
        return outputs, steps

    capped, _ = run(threshold)
    uncapped, _ = run(0)
    assert capped == uncapped
    assert {rid: len(toks) for rid, toks in capped.items()} == {r[0]: r[2] for r in requests}


def test_run_until_idle_with_threshold_frees_everything() -> None:
    sched, runner = make_scheduler(threshold=5), FakeRunner(4, next_token=content_token)
    for i in range(10):
        sched.add_request(make_request(f"r{i}", list(range(i, i + 40)), max_tokens=3))
    outs = run_until_idle(sched, runner)
    assert len(outs) == 10
    assert sched.kv_cache_manager.get_num_free_blocks() == sched.num_blocks
