"""Fake requests, configs and a fake model runner for the core tests (no torch, no model).

The fake runner keeps its own copy of every request's tokens and block table from the
SchedulerOutput diffs alone, like the real runner must, and simulates the KV cache: each scheduled
token "writes" (request-independent content: its token id and position) into its slot, and every
step then checks that each scheduled request's block table holds exactly its own tokens at every
position it attends to. A wrong prefix hit, a block reused while still needed, or a bad diff shows
up as a mismatch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace

from pagellm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagellm.core.scheduler import Scheduler
from pagellm.request import Request
from pagellm.sampling_params import SamplingParams

FIXED_TOKEN = 7


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def make_request(
    req_id: str,
    prompt: list[int],
    max_tokens: int = 4,
    eos_token_id: int | None = None,
    cache_salt: str | None = None,
    group_id: str | None = None,
    **params: object,
) -> Request:
    sp = SamplingParams(max_tokens=max_tokens, **params)  # type: ignore[arg-type]
    return Request(
        request_id=req_id,
        prompt_token_ids=list(prompt),
        sampling_params=sp,
        eos_token_id=eos_token_id,
        cache_salt=cache_salt,
        group_id=group_id,
        max_tokens=max_tokens,
    )


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 256,
    enable_prefix_caching: bool = True,
    hash_algo: str = "sha256",
) -> Scheduler:
    sched_cfg = SimpleNamespace(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
    )
    cache_cfg = SimpleNamespace(
        block_size=block_size,
        enable_prefix_caching=enable_prefix_caching,
        prefix_caching_hash_algo=hash_algo,
    )
    return Scheduler(sched_cfg, cache_cfg, num_blocks)


@dataclass
class _RunnerReq:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int


@dataclass
class FakeRunner:
    """Samples ``next_token(req_id, token_ids_so_far)`` (default: a fixed token) for every
    request whose computed tokens reach its known tokens."""

    block_size: int
    next_token: Callable[[str, list[int]], int] = lambda req_id, token_ids: FIXED_TOKEN
    reqs: dict[str, _RunnerReq] = field(default_factory=dict)
    # slot -> (token id, position) last written there
    kv: dict[int, tuple[int, int]] = field(default_factory=dict)
    num_tokens_run: int = 0

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in out.finished_req_ids | out.preempted_req_ids:
            self.reqs.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            assert new.req_id not in self.reqs, "a running request was sent as new"
            self.reqs[new.req_id] = _RunnerReq(
                new.prompt_token_ids + new.output_token_ids, list(new.block_ids),
                new.num_computed_tokens,
            )
        cached = out.scheduled_cached_reqs
        for req_id, new_block_ids, num_computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True
        ):
            state = self.reqs[req_id]
            assert state.num_computed_tokens == num_computed, "diff disagrees with runner"
            state.block_ids.extend(new_block_ids)
        assert sum(out.num_scheduled_tokens.values()) == out.total_num_scheduled_tokens
        # Write every scheduled token's K/V first (the real runner does this per layer) ...
        for req_id, n in out.num_scheduled_tokens.items():
            state = self.reqs[req_id]
            start = state.num_computed_tokens
            assert start + n <= len(state.token_ids), "scheduled beyond the known tokens"
            assert len(state.block_ids) == cdiv(start + n, self.block_size), "block table size"
            for pos in range(start, start + n):
                self.kv[self._slot(state, pos)] = (state.token_ids[pos], pos)
        self.num_tokens_run += out.total_num_scheduled_tokens
        # ... then "attend": every position up to the end must hold this request's tokens.
        req_ids, sampled = [], []
        for req_id, n in out.num_scheduled_tokens.items():
            state = self.reqs[req_id]
            end = state.num_computed_tokens + n
            for pos in range(end):
                got = self.kv.get(self._slot(state, pos))
                assert got == (state.token_ids[pos], pos), (req_id, pos, got)
            state.num_computed_tokens = end
            req_ids.append(req_id)
            if end == len(state.token_ids):
                token = self.next_token(req_id, state.token_ids)
                state.token_ids.append(token)
                sampled.append([token])
            else:
                sampled.append([])
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)

    def _slot(self, state: _RunnerReq, pos: int) -> int:
        return state.block_ids[pos // self.block_size] * self.block_size + pos % self.block_size


def check_step(sched: Scheduler, out: SchedulerOutput) -> None:
    """Per-step invariants: budget, max_num_seqs, block tables, pool structure."""
    assert out.total_num_scheduled_tokens <= sched.max_num_batched_tokens
    assert len(sched.running) <= sched.max_num_seqs
    assert all(n > 0 for n in out.num_scheduled_tokens.values())
    kv = sched.kv_cache_manager
    for req in sched.running:
        assert len(kv.get_block_ids(req.request_id)) == cdiv(
            req.num_computed_tokens, sched.block_size
        )
    for req in sched.waiting:
        assert kv.get_block_ids(req.request_id) == []
    kv.block_pool.check_invariants()


def run_until_idle(
    sched: Scheduler, runner: FakeRunner, max_steps: int = 10_000
) -> dict[str, list]:
    """Step until nothing is left; returns req_id -> list of EngineCoreOutputs."""
    outputs: dict[str, list] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return outputs
        out = sched.schedule()
        check_step(sched, out)
        for o in sched.update_from_output(out, runner.execute(out)):
            outputs.setdefault(o.req_id, []).append(o)
    raise AssertionError("scheduler did not become idle")


def content_token(req_id: str, token_ids: list[int]) -> int:
    """A deterministic "model": the next token depends only on the tokens so far."""
    h = 17
    for t in token_ids:
        h = (h * 1_000_003 + t) % (1 << 61)
    return (h >> 13) % 1000 + 1


def output_tokens(outs: list) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]
