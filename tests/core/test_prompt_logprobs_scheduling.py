"""Scheduling of requests that ask for prompt logprobs (no model): they never read the prefix
cache (every prompt position must run for its logits) but still write it, and the scheduler
forwards the runner's prompt scores even for a prefill chunk that samples no token."""

from __future__ import annotations

from core_fakes import FakeRunner, check_step, make_request, make_scheduler, run_until_idle

from pagellm.core.sched_output import Logprobs, PromptLogprobs

PROMPT = list(range(100, 140))  # 40 tokens: 10 full blocks of 4


def test_prompt_logprobs_request_reads_no_cached_block_but_writes_them() -> None:
    sched = make_scheduler(num_blocks=64, block_size=4)
    runner = FakeRunner(4)
    sched.add_request(make_request("warm", PROMPT))
    run_until_idle(sched, runner)

    scored = make_request("scored", PROMPT, prompt_logprobs=2)
    sched.add_request(scored)
    out = sched.schedule()
    check_step(sched, out)
    # The whole prompt is computed although its first 9 blocks are cached.
    assert out.num_scheduled_tokens == {"scored": 40}
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0 and scored.num_cached_tokens == 0
    sched.update_from_output(out, runner.execute(out))
    run_until_idle(sched, runner)

    # An ordinary request after it hits the blocks (the ones it wrote or the warm ones).
    later = make_request("later", PROMPT + [1, 2, 3])
    sched.add_request(later)
    out = sched.schedule()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 40
    sched.update_from_output(out, runner.execute(out))
    run_until_idle(sched, runner)
    assert sched.kv_cache_manager.get_num_free_blocks() == sched.num_blocks
    sched.kv_cache_manager.block_pool.check_invariants()


def test_a_chunk_without_a_token_still_sends_its_prompt_scores() -> None:
    sched = make_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=16)
    runner = FakeRunner(4)
    sched.add_request(make_request("r", PROMPT, prompt_logprobs=0))
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"r": 16}
    result = runner.execute(out)
    assert result.sampled_token_ids == [[]]  # a prefill chunk short of the prompt's end
    scores = PromptLogprobs(start=1, records=[Logprobs(PROMPT[i], -1.0, 1, [], [])
                                              for i in range(1, 17)])
    result.prompt_logprobs["r"] = scores
    (core_out,) = sched.update_from_output(out, result)
    assert core_out.req_id == "r" and core_out.new_token_ids == []
    assert core_out.prompt_logprobs is scores and core_out.finish_reason is None
    run_until_idle(sched, runner)
