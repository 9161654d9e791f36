"""A fake model runner that verifies drafts (no torch, no model), for the scheduler's tests.

The "model" is deterministic: the next token is a hash of the tokens so far (greedy decoding of
any model reduces to such a function). The fake keeps every request's tokens and block table from
the SchedulerOutput diffs, writes (token, position) into the slot of every scheduled position,
drafts included, and checks that every position a request attends to holds its own token.
Drafts come from a configurable oracle, so tests choose how many get accepted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace

from pagellm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagellm.core.scheduler import Scheduler
from pagellm.request import Request
from pagellm.sampling_params import SamplingParams
from pagellm.spec_decode.config import parse_speculative_config


def model_token(token_ids: list[int]) -> int:
    h = 17
    for t in token_ids:
        h = (h * 1_000_003 + t) % (1 << 61)
    return (h >> 13) % 1000 + 1


def true_continuation(token_ids: list[int], k: int) -> list[int]:
    tokens = list(token_ids)
    for _ in range(k):
        tokens.append(model_token(tokens))
    return tokens[len(token_ids):]


def oracle_drafts(token_ids: list[int], k: int) -> list[int]:
    """The model's own next tokens, the first ``len % (k + 1)`` of them right (then wrong): every
    acceptance count from 0 to k happens."""
    right = len(token_ids) % (k + 1)
    truth = true_continuation(token_ids, k)
    return truth[:right] + [t + 1 for t in truth[right:]]


def make_request(req_id: str, prompt: list[int], max_tokens: int = 8,
                 eos_token_id: int | None = None, **params: object) -> Request:
    sp = SamplingParams(max_tokens=max_tokens, **params)  # type: ignore[arg-type]
    return Request(request_id=req_id, prompt_token_ids=list(prompt), sampling_params=sp,
                   eos_token_id=eos_token_id, max_tokens=max_tokens)


def make_scheduler(k: int | None = 3, num_blocks: int = 64, block_size: int = 4,
                   max_num_seqs: int = 8, max_num_batched_tokens: int = 64,
                   max_model_len: int = 256, caching: bool = True,
                   method: str = "ngram") -> Scheduler:
    spec = None
    if k is not None:
        spec = parse_speculative_config({"method": method, "num_speculative_tokens": k,
                                         **({"model": "draft"} if method == "draft_model"
                                            else {})})
    sched_cfg = SimpleNamespace(max_num_seqs=max_num_seqs,
                                max_num_batched_tokens=max_num_batched_tokens,
                                max_model_len=max_model_len)
    cache_cfg = SimpleNamespace(block_size=block_size, enable_prefix_caching=caching,
                                prefix_caching_hash_algo="sha256")
    return Scheduler(sched_cfg, cache_cfg, num_blocks, speculative_config=spec)


@dataclass
class _Req:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int


@dataclass
class SpecFakeRunner:
    block_size: int
    k: int = 3
    propose: Callable[[list[int], int], list[int]] = oracle_drafts
    reqs: dict[str, _Req] = field(default_factory=dict)
    kv: dict[int, tuple[int, int]] = field(default_factory=dict)  # slot -> (token, position)
    max_drafts_seen: int = 0

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in out.finished_req_ids | out.preempted_req_ids:
            self.reqs.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            self.reqs[new.req_id] = _Req(new.prompt_token_ids + new.output_token_ids,
                                         list(new.block_ids), new.num_computed_tokens)
        cached = out.scheduled_cached_reqs
        for req_id, block_ids, num_computed in zip(cached.req_ids, cached.new_block_ids,
                                                   cached.num_computed_tokens, strict=True):
            state = self.reqs[req_id]
            assert state.num_computed_tokens == num_computed, (req_id, "diff disagrees")
            state.block_ids.extend(block_ids)
        req_ids, sampled, proposals = [], [], {}
        for req_id, n in out.num_scheduled_tokens.items():
            state = self.reqs[req_id]
            drafts = out.scheduled_spec_decode_tokens.get(req_id, [])
            self.max_drafts_seen = max(self.max_drafts_seen, len(drafts))
            start = state.num_computed_tokens
            tokens = state.token_ids + drafts
            assert start + n <= len(tokens), "scheduled beyond the known tokens and drafts"
            if drafts:
                assert start + n == len(tokens), "drafts come right after the last known token"
            for pos in range(start, start + n):
                self.kv[self._slot(state, pos)] = (tokens[pos], pos)
        for req_id, n in out.num_scheduled_tokens.items():
            state = self.reqs[req_id]
            drafts = out.scheduled_spec_decode_tokens.get(req_id, [])
            tokens = state.token_ids + drafts
            end = state.num_computed_tokens + n
            for pos in range(end):  # attend: every position holds this request's own token
                assert self.kv.get(self._slot(state, pos)) == (tokens[pos], pos), (req_id, pos)
            req_ids.append(req_id)
            if end < len(tokens):
                sampled.append([])
                state.num_computed_tokens = end
                continue
            # Greedy verification: accept drafts while they are the model's token.
            emitted: list[int] = []
            for j in range(len(drafts) + 1):
                target = model_token(state.token_ids + drafts[:j])
                if j < len(drafts) and drafts[j] == target:
                    emitted.append(target)
                    continue
                emitted.append(target)
                break
            state.num_computed_tokens = end - (len(drafts) + 1 - len(emitted))
            state.token_ids += emitted
            sampled.append(emitted)
            proposal = self.propose(state.token_ids, self.k)
            if proposal:
                proposals[req_id] = proposal
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled,
                                 spec_token_ids=proposals)

    def _slot(self, state: _Req, pos: int) -> int:
        return state.block_ids[pos // self.block_size] * self.block_size + pos % self.block_size


def check_cached_blocks_hold_known_tokens(sched: Scheduler, runner: SpecFakeRunner) -> None:
    """Every prefix-cached block of a running request holds the K/V of its known tokens (never
    of a rejected draft)."""
    kv = sched.kv_cache_manager
    bs = sched.block_size
    for request in sched.running:
        state = runner.reqs.get(request.request_id)
        if state is None:
            continue
        for i, block in enumerate(kv.get_blocks(request.request_id)):
            if block.block_hash is None:
                continue
            for pos in range(i * bs, (i + 1) * bs):
                slot = block.block_id * bs + pos % bs
                assert runner.kv.get(slot) == (request.all_token_ids[pos], pos), (
                    request.request_id, block, pos)


def run(sched: Scheduler, runner: SpecFakeRunner, max_steps: int = 10_000
        ) -> dict[str, list[int]]:
    """Step until idle (checking the cache after every step); req_id -> output tokens."""
    outputs: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return outputs
        out = sched.schedule()
        assert out.total_num_scheduled_tokens <= sched.max_num_batched_tokens
        for o in sched.update_from_output(out, runner.execute(out)):
            outputs.setdefault(o.req_id, []).extend(o.new_token_ids)
        check_cached_blocks_hold_known_tokens(sched, runner)
        sched.kv_cache_manager.block_pool.check_invariants()
    raise AssertionError("not idle")
