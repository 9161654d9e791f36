"""The token-budget scheduler: one rule, no prefill/decode phases (pure Python, no torch)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any, Protocol

from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.request_queue import create_request_queue
from pagellm.core.sched_output import (
    CachedRequestData,
    EngineCoreOutput,
    Logprobs,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from pagellm.core.stop_check import accept_grammar_token, check_stop
from pagellm.metrics.stats import SchedulerStats, SpecDecodingStats
from pagellm.request import Request, RequestStatus

logger = logging.getLogger("pagellm")


class SchedulerConfigLike(Protocol):
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int


class CacheConfigLike(Protocol):
    block_size: int
    enable_prefix_caching: bool
    prefix_caching_hash_algo: str


class Scheduler:
    """Spends a per-step token budget catching each request's ``num_computed_tokens`` up to its
    ``num_tokens``: RUNNING requests first, in order, then WAITING ones (FCFS) while fewer than
    ``max_num_seqs`` run. Chunked prefill, mixed prefill+decode steps and prefix hits all follow.
    When blocks run out, the newest running request is preempted (recompute): its blocks are
    freed and it returns to the front of the waiting queue.

    With ``policy="priority"`` (SchedulerConfig.policy), waiting requests are admitted by
    (priority, arrival) (lower priority value first), the running batch is served in that order,
    and the victim of a preemption is the lowest-priority (then newest) running request.
    Waiting requests never preempt running ones, whatever their priority.

    ``num_computed_tokens`` advances at schedule time: the runner computes all it is given.

    With ``async_scheduling`` (SchedulerConfig), step N+1 is scheduled before step N's tokens
    come back. Each request counts the tokens it will sample in steps not yet processed
    (``num_output_placeholders``); a decoding request runs its next position while the token
    for it is still in flight (the runner, which runs steps in order, knows it by then), and
    max_tokens / max_model_len count the tokens in flight, so nothing runs past them. A request
    that stops (EOS, stop token) at step N may already be in step N+1: that token is computed
    and dropped, never emitted.
    """

    def __init__(
        self,
        scheduler_config: SchedulerConfigLike,
        cache_config: CacheConfigLike,
        num_blocks: int,
        kv_group_windows: list[int | None] | None = None,
        speculative_config: Any = None,
        enable_kv_cache_events: bool = False,
        num_state_slots: int = 0,
        state_snapshots: tuple[int, int] = (0, 1),
    ) -> None:
        """``kv_group_windows``: the sliding window of each KV cache group
        (core/kv_cache_groups.py; None: one group of full attention). ``speculative_config``:
        a SpeculativeConfig (spec_decode/config.py) or None. ``enable_kv_cache_events``: the
        block pool records KV cache events (taken with ``kv_cache_manager.take_events()``).
        ``num_state_slots``: the recurrent-state slots of a model with recurrent layers
        (core/state_slots.py; 0: none); ``state_snapshots``: their prefix-cache snapshots
        (slots, interval in blocks) (core/state_snapshots.py)."""
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.max_model_len = scheduler_config.max_model_len
        self.block_size = cache_config.block_size
        self.num_blocks = num_blocks
        self.kv_cache_manager = KVCacheManager(
            block_size=cache_config.block_size,
            num_blocks=num_blocks,
            enable_caching=cache_config.enable_prefix_caching,
            hash_algo=getattr(cache_config, "prefix_caching_hash_algo", "sha256"),
            max_model_len=self.max_model_len,
            group_windows=kv_group_windows,
            enable_kv_cache_events=enable_kv_cache_events,
            kv_dtype_key=_kv_dtype_key(cache_config),
            num_state_slots=num_state_slots,
            num_snapshot_slots=state_snapshots[0],
            snapshot_interval_blocks=state_snapshots[1],
        )
        self.policy = getattr(scheduler_config, "policy", "fcfs")
        self.async_scheduling = getattr(scheduler_config, "async_scheduling", False)
        # vLLM's long_prefill_token_threshold: while other requests are scheduled too, no
        # request gets more than this many tokens in a step (0: off); set per step in schedule().
        self.long_prefill_token_threshold = getattr(scheduler_config,
                                                    "long_prefill_token_threshold", 0)
        self._chunk_cap = self.max_num_batched_tokens
        # Speculative decoding: a running request's drafts (Request.spec_token_ids) run after
        # its last known token; update_from_output rolls num_computed_tokens back over the
        # rejected ones (their K/V is overwritten later, and blocks holding them are never
        # cached: the KV cache manager caches known tokens only).
        spec = speculative_config
        self.num_lookahead_slots = spec.num_lookahead_slots if spec is not None else 0
        self.spec_stats = (SpecDecodingStats(spec.num_speculative_tokens)
                           if spec is not None else None)
        self._scheduled_drafts: dict[str, list[int]] = {}
        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(self.policy)
        self.running: list[Request] = []
        # Finished (or aborted) since the last schedule(): sent once to the runner.
        self.finished_req_ids: set[str] = set()
        self.num_preemptions = 0
        self.num_steps = 0

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in the scheduler.")
        if request.num_tokens < 1:
            raise ValueError("prompt_token_ids must not be empty.")
        if request.num_tokens > self.max_model_len:
            raise ValueError(
                f"prompt_token_ids has {request.num_tokens} tokens, more than max_model_len "
                f"({self.max_model_len})."
            )
        request.status = RequestStatus.WAITING
        request.num_lookahead_slots = self.num_lookahead_slots
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self) -> SchedulerOutput:
        self.num_steps += 1
        self.kv_cache_manager.begin_step()
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached = CachedRequestData()
        preempted: set[str] = set()
        self._scheduled_drafts = {}
        self._state_checkpoints: dict[str, list[tuple[int, int]]] = {}
        threshold = self.long_prefill_token_threshold
        # A request alone has nobody to keep waiting: it may take the whole budget (as vLLM).
        self._chunk_cap = (threshold if threshold > 0 and len(self.running) + len(self.waiting) > 1
                           else self.max_num_batched_tokens)
        budget = self._schedule_running(self.max_num_batched_tokens, num_scheduled, cached,
                                        preempted)
        # A step that had to preempt is short of blocks: admitting more would only preempt again.
        if not preempted:
            budget = self._schedule_waiting(budget, num_scheduled, new_reqs)
        out = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=self.max_num_batched_tokens - budget,
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids=preempted,
            scheduled_spec_decode_tokens=self._scheduled_drafts,
            state_checkpoints=self._state_checkpoints,
        )
        self.finished_req_ids = set()
        return out

    def _take_state_plan(self, req_id: str) -> int:
        """Note the state snapshots the request's step writes; returns the snapshot slot it
        resumes from (-1: none). Models without recurrent layers have neither."""
        restore, checkpoints = self.kv_cache_manager.take_state_plan(req_id)
        if checkpoints:
            self._state_checkpoints[req_id] = checkpoints
        return restore

    def _schedule_running(self, budget: int, num_scheduled: dict[str, int],
                          cached: CachedRequestData, preempted: set[str]) -> int:
        """Give the running requests their tokens, in order, preempting when blocks run out;
        fills ``num_scheduled``, ``cached`` and ``preempted``. Returns the budget left."""
        kv = self.kv_cache_manager
        if self.policy == "priority":
            # Sorted, running[i:] are never more urgent than running[:i]: the victim below is
            # always the globally least urgent request not yet given tokens this step.
            self.running.sort(key=lambda r: (r.priority, r.arrival_time))

        # A long prefill chunk must not take the tokens of the decodes queued behind it: each
        # chunk leaves one token per decoding request still to come (no request stalls).
        decodes_left = sum(1 for r in self.running if self._num_uncomputed(r) == 1)
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            remaining = self._num_uncomputed(request)
            if remaining == 1:
                decodes_left -= 1
                room = budget
            else:
                room = min(budget - decodes_left, self._chunk_cap)
            num_new = min(remaining, room, self.max_model_len - request.num_computed_tokens)
            if num_new <= 0:  # nothing to compute until the runner samples its next token
                i += 1
                continue
            if request.spec_token_ids:
                # Drafts only with the tokens left after one per decode still to come.
                num_new += self._fit_drafts(request, remaining, min(
                    budget - num_new - decodes_left, self._chunk_cap - num_new))
            num_slots = num_new + self._lookahead(request, request.num_computed_tokens + num_new)
            new_blocks = kv.allocate_slots(request, num_slots)
            while new_blocks is None:
                victim = self.running.pop(self._victim_index(i))
                self._preempt(victim)
                preempted.add(victim.request_id)
                if victim is request:
                    break
                new_blocks = kv.allocate_slots(request, num_slots)
            if new_blocks is None:
                break
            if request.spec_token_ids:  # consumed: the runner returns new ones
                self._scheduled_drafts[request.request_id] = request.spec_token_ids
                request.spec_token_ids = []
            cached.req_ids.append(request.request_id)
            cached.new_block_ids.append([b.block_id for b in new_blocks])
            if kv.num_groups > 1:
                cached.new_group_block_ids.append(
                    kv.get_other_group_block_ids(request.request_id, last=len(new_blocks)))
            cached.num_computed_tokens.append(request.num_computed_tokens)
            self._take_state_plan(request.request_id)
            num_scheduled[request.request_id] = num_new
            request.num_computed_tokens += num_new
            self._count_placeholder(request)
            budget -= num_new
            i += 1
        return budget

    def _schedule_waiting(self, budget: int, num_scheduled: dict[str, int],
                          new_reqs: list[NewRequestData]) -> int:
        """Admit waiting requests in queue order while blocks, budget and ``max_num_seqs``
        allow; fills ``num_scheduled`` and ``new_reqs``. Returns the budget left."""
        kv = self.kv_cache_manager
        skipped: list[Request] = []  # grammar still compiling: they keep their place
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting.peek()
            if request.grammar is not None and not request.grammar.ready:
                skipped.append(self.waiting.pop())
                continue
            computed_blocks, num_hit = kv.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_hit, budget, self._chunk_cap)
            num_slots = num_new + self._lookahead(request, num_hit + num_new)
            if kv.allocate_slots(request, num_slots, computed_blocks, num_hit) is None:
                break  # FCFS: no skipping ahead, no preemption for waiting requests
            self.waiting.pop()
            self.running.append(request)
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
                request.first_scheduled_time = time.monotonic()
            request.status = RequestStatus.RUNNING
            restore = self._take_state_plan(request.request_id)
            new_reqs.append(
                NewRequestData(
                    req_id=request.request_id,
                    prompt_token_ids=list(request.prompt_token_ids),
                    output_token_ids=list(request.output_token_ids),
                    sampling_params=request.sampling_params,
                    block_ids=kv.get_block_ids(request.request_id),
                    num_computed_tokens=num_hit,
                    group_block_ids=kv.get_other_group_block_ids(request.request_id),
                    state_slot=kv.get_state_slot(request.request_id),
                    state_restore_slot=restore,
                )
            )
            num_scheduled[request.request_id] = num_new
            request.num_computed_tokens = num_hit + num_new
            self._count_placeholder(request)
            budget -= num_new
        for request in reversed(skipped):
            self.waiting.prepend(request)
        return budget

    def _num_uncomputed(self, request: Request) -> int:
        """Tokens the request could run now: its known tokens not computed yet, plus (async
        scheduling) the position of a token still in flight, unless the tokens in flight
        already end the request by max_tokens or max_model_len."""
        in_flight = request.num_output_placeholders
        if in_flight and (request.num_output_tokens + in_flight >= request.max_tokens
                          or request.num_tokens + in_flight >= self.max_model_len):
            return 0
        return request.num_tokens + in_flight - request.num_computed_tokens

    def _count_placeholder(self, request: Request) -> None:
        """Async scheduling: a step that reaches the end of the request's tokens (known and in
        flight) samples one more; it is in flight until update_from_output gets it."""
        if (self.async_scheduling and request.num_computed_tokens
                >= request.num_tokens + request.num_output_placeholders):
            request.num_output_placeholders += 1

    def _fit_drafts(self, request: Request, remaining: int, room: int) -> int:
        """How many of the request's drafts run this step (the rest are dropped): within
        ``room`` tokens of budget, max_model_len, and max_tokens (a step emits at most one
        token more than it has drafts), and only after its last known token."""
        num_drafts = min(len(request.spec_token_ids), room,
                         self.max_model_len - request.num_computed_tokens - 1,
                         request.max_tokens - request.num_output_tokens - 1)
        num_drafts = max(num_drafts, 0) if remaining == 1 else 0
        del request.spec_token_ids[num_drafts:]
        return num_drafts

    def _lookahead(self, request: Request, num_computed_after: int) -> int:
        """KV slots past the scheduled tokens a draft model writes while proposing after this
        step (one that reaches the end of the request's known tokens), within max_model_len."""
        if not self.num_lookahead_slots or num_computed_after < request.num_tokens:
            return 0
        return max(0, min(self.num_lookahead_slots, self.max_model_len - num_computed_after))

    def _victim_index(self, start: int) -> int:
        """Which of ``running[start:]`` (not yet scheduled this step) to preempt."""
        if self.policy != "priority":
            return len(self.running) - 1  # the newest
        return max(range(start, len(self.running)),
                   key=lambda j: (self.running[j].priority, self.running[j].arrival_time))

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []  # proposed again after it resumes and samples
        # Async scheduling: its tokens still in flight are dropped when they come back (the
        # request is no longer RUNNING); it samples them again after it resumes.
        request.num_output_placeholders = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(request)
        # Warn on the first preemption and then every 100th: frequent preemption means the KV
        # cache is too small for the load (recompute wastes work).
        if self.num_preemptions % 100 == 1:
            logger.warning(
                "Preempted request %s (recompute): KV cache full; %d preemptions so far. Raise "
                "--kv-cache-memory / --gpu-memory-utilization or lower --max-num-seqs.",
                request.request_id, self.num_preemptions)

    def update_from_output(
        self, sched_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append the sampled tokens, apply EOS/stop-token/length stops and free finished
        requests' blocks; one output per request that got tokens or finished."""
        index = {req_id: i for i, req_id in enumerate(runner_output.req_ids)}
        outputs: list[EngineCoreOutput] = []
        now = time.monotonic()
        any_finished = False
        for req_id in sched_output.num_scheduled_tokens:
            i = index.get(req_id)
            request = self.requests.get(req_id)
            # Aborted while its step ran, or no token (prefill chunk short of the end); async
            # scheduling: finished or preempted after this step was scheduled.
            if i is None or request is None or request.status != RequestStatus.RUNNING:
                continue
            sampled = runner_output.sampled_token_ids[i]
            if sampled and self.async_scheduling:
                assert request.num_output_placeholders > 0, req_id
                request.num_output_placeholders -= 1
            prompt_lps = runner_output.prompt_logprobs.get(req_id)
            if not sampled:
                if prompt_lps is not None:  # a prefill chunk's scores, sent as they come
                    outputs.append(EngineCoreOutput(req_id=req_id, new_token_ids=[],
                                                    prompt_logprobs=prompt_lps))
                continue
            if request.first_token_time is None:
                request.first_token_time = now
            drafts = sched_output.scheduled_spec_decode_tokens.get(req_id)
            if drafts:
                self._rollback_rejected(request, len(drafts), len(sampled) - 1)
            new_token_ids: list[int] = []
            for token_id in sampled:
                if request.grammar is not None and not accept_grammar_token(request,
                                                                                  token_id):
                    break  # finished with an error; the token is not part of the output
                request.append_output_token_ids([token_id])
                new_token_ids.append(token_id)
                if check_stop(request, self.max_model_len):
                    break
            lp = runner_output.logprobs[i] if i < len(runner_output.logprobs) else None
            new_logprobs: list[Logprobs] = (lp[:len(new_token_ids)] if isinstance(lp, list)
                                            else [lp] if lp is not None else [])
            finish = request.get_finish_reason()
            if finish is not None:
                self._free_request(request)
                any_finished = True
            elif runner_output.spec_token_ids:
                request.spec_token_ids = list(runner_output.spec_token_ids.get(req_id, ()))
            outputs.append(
                EngineCoreOutput(
                    req_id=req_id,
                    new_token_ids=new_token_ids,
                    finish_reason=finish.value if finish is not None else None,
                    stop_reason=request.stop_reason,
                    new_logprobs=new_logprobs,
                    num_cached_tokens=max(request.num_cached_tokens, 0),
                    prompt_logprobs=prompt_lps,
                )
            )
        if any_finished:  # one pass, not a list.remove per finished request
            self.running = [r for r in self.running if not r.is_finished]
        return outputs

    def _rollback_rejected(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """A verify step ran ``num_drafts`` drafts and accepted the first ``num_accepted``: the
        positions of the rejected ones are computed again later (their K/V is overwritten)."""
        assert 0 <= num_accepted <= num_drafts, (request.request_id, num_accepted, num_drafts)
        request.num_computed_tokens -= num_drafts - num_accepted
        if self.spec_stats is not None:
            self.spec_stats.observe(num_drafts, num_accepted)

    def finish_requests(self, req_ids: str | Iterable[str], status: RequestStatus) -> None:
        """Finish requests from outside (abort, stop string): their blocks are freed now and their
        ids go to the next SchedulerOutput. Unknown or already finished ids are ignored."""
        if not status.is_finished:
            raise ValueError(f"status must be a finished status, got {status.name}.")
        for req_id in [req_ids] if isinstance(req_ids, str) else req_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._free_request(request)

    def fail_step(self, sched_output: SchedulerOutput) -> list[str]:
        """The model step of ``sched_output`` raised: finish every request it scheduled with
        FINISHED_ERROR (blocks freed now) and send the step's finished/preempted ids to the
        runner again (it may have failed before dropping them; dropping twice is a no-op).
        The blocks the step hashed leave the prefix cache first: nothing wrote their K/V.
        Returns the failed request ids."""
        # Async scheduling fails the step in flight with this one, scheduled after it.
        self.kv_cache_manager.uncache_step(include_previous=self.async_scheduling)
        failed = [r for r in sched_output.num_scheduled_tokens
                  if r in self.requests and not self.requests[r].is_finished]
        self.finish_requests(failed, RequestStatus.FINISHED_ERROR)
        self.finished_req_ids |= sched_output.finished_req_ids | sched_output.preempted_req_ids
        return failed

    def defer_to_next_step(self, sched_output: SchedulerOutput) -> None:
        """``sched_output`` schedules no token and will not run (async scheduling): the
        finished and preempted ids it carries for the runner go with the next step."""
        assert sched_output.total_num_scheduled_tokens == 0
        self.finished_req_ids |= sched_output.finished_req_ids | sched_output.preempted_req_ids

    def _free_request(self, request: Request) -> None:
        """Free a finished request's blocks and forget it (the caller unlinks it from the
        running/waiting queue)."""
        assert request.is_finished
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self.finished_req_ids.add(request.request_id)

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def make_stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=kv.usage,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            num_steps=self.num_steps,
            spec_decoding=self.spec_stats.snapshot() if self.spec_stats is not None else None,
        )


def _kv_dtype_key(cache_config: CacheConfigLike) -> str | None:
    """The hash key of --kv-cache-dtype (pagellm.config.CacheConfig.kv_cache_dtype); None for
    auto or a cache config without one (tests' fakes)."""
    kv_dtype = getattr(cache_config, "kv_cache_dtype", None)
    return kv_dtype.hash_key() if kv_dtype is not None else None
