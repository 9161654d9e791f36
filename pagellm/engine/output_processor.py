"""EngineCoreOutputs -> RequestOutputs: detokenize, apply stop strings, gather n samples.

This is the one loop over the batch's outputs in the front end.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pagellm.core.sched_output import EngineCoreOutput, Logprobs, PromptLogprobs
from pagellm.engine.detokenizer import IncrementalDetokenizer, TokenIdsOnly, decode_token
from pagellm.errors import RequestIdInUseError
from pagellm.outputs import CompletionOutput, Logprob, RawPromptLogprobs, RequestOutput
from pagellm.outputs import PromptLogprobs as PromptLogprobList
from pagellm.request import FinishReason
from pagellm.sampling_params import SamplingParams


class OutputKind(enum.Enum):
    CUMULATIVE = 0  # every update carries the whole text so far
    DELTA = 1  # every update carries only what is new (streaming)
    FINAL_ONLY = 2  # one output when every sample has finished


@dataclass
class _Sample:
    index: int
    detok: IncrementalDetokenizer | TokenIdsOnly
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_sent_tokens: int = 0
    num_sent_logprobs: int = 0


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    kind: OutputKind
    samples: dict[str, _Sample]
    queue: Any = None  # an asyncio.Queue (or similar) in the async front end
    num_cached_tokens: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    last_token_time: float | None = None
    first_scheduled_time: float | None = None  # when the scheduler first ran any sample
    finished_time: float | None = None  # when the last sample finished
    num_unfinished: int = 0
    # params.prompt_logprobs: filled by position as the prefill chunks are scored (a chunk
    # scored again after a preemption overwrites the same values); DELTA sends it once.
    prompt_logprobs: PromptLogprobList | RawPromptLogprobs | None = None
    prompt_logprobs_sent: bool = False

    @property
    def finished(self) -> bool:
        return self.num_unfinished == 0


@dataclass(slots=True)
class ProcessedOutputs:
    request_outputs: list[RequestOutput]
    # Samples a stop string finished: the engine core must stop them (finish as "stop").
    reqs_to_stop: list[str]
    # Samples whose sibling failed (finish_reason "error"): the request as a whole failed, so
    # the engine core must abort them.
    reqs_to_abort: list[str] = field(default_factory=list)
    # Every sample a stop string ended in this batch, ``reqs_to_stop`` and those the engine core
    # finished in the same step (max_tokens reached too): they all finish as "stop".
    stopped_by_string: list[str] = field(default_factory=list)


class OutputProcessor:
    def __init__(self, tokenizer: Any, raw_prompt_logprobs: bool = False) -> None:
        """``raw_prompt_logprobs``: prompt logprobs stay the engine's ``Logprobs`` records
        (RawPromptLogprobs), which the server turns into entries off its event loop
        (prompt_logprobs.shaped_prompt_logprobs): up to ~100k entries a request."""
        self.tokenizer = tokenizer
        self.raw_prompt_logprobs = raw_prompt_logprobs
        self.requests: dict[str, RequestState] = {}
        self._parent_of: dict[str, str] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, child_ids: list[str],
                    kind: OutputKind = OutputKind.FINAL_ONLY, queue: Any = None,
                    arrival_time: float | None = None) -> None:
        """Track a request and its samples' ids (the engine core's ids). Raises ValueError,
        changing nothing, if any of those ids is in flight already: n > 1 names its samples
        ``<i>_<id>`` (child_request_id), which another request's id may equal, and the engine
        core could not tell the two apart."""
        ids = (request_id, *child_ids)
        in_use = [i for i in ids if i in self.requests or i in self._parent_of]
        if in_use or len(set(child_ids)) != len(child_ids):
            raise RequestIdInUseError(
                f"Request id {request_id!r} is already in use (an id of its or its samples, "
                f"{(in_use or child_ids)[0]!r}, is in flight).")
        samples = {}
        for i, cid in enumerate(child_ids):
            detok: IncrementalDetokenizer | TokenIdsOnly = IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids, skip_special_tokens=params.skip_special_tokens,
                stop=params.stop_strs,
                include_stop_str_in_output=params.include_stop_str_in_output,
                min_tokens=params.min_tokens) if params.detokenize else TokenIdsOnly()
            samples[cid] = _Sample(index=i, detok=detok,
                                   cumulative_logprob=0.0 if params.logprobs is not None else None,
                                   logprobs=[] if params.logprobs is not None else None)
            self._parent_of[cid] = request_id
        self.requests[request_id] = RequestState(
            request_id, prompt, prompt_token_ids, params, kind, samples, queue,
            arrival_time=arrival_time or time.monotonic(), num_unfinished=len(child_ids),
            prompt_logprobs=([None] * len(prompt_token_ids)
                             if params.prompt_logprobs is not None else None))

    def abort_request(self, request_id: str) -> list[str]:
        """Forget a request; returns its child ids for the engine core to abort."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return []
        for cid in state.samples:
            self._parent_of.pop(cid, None)
        return list(state.samples)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def process_outputs(self, outputs: list[EngineCoreOutput],
                        first_scheduled_times: Mapping[str, float] | None = None
                        ) -> ProcessedOutputs:
        """``first_scheduled_times``: the engine core's, by sample id (EngineCoreOutputs):
        the finished outputs' metrics carry the request's first one (its queue time)."""
        now = time.monotonic()
        request_outputs: list[RequestOutput] = []
        reqs_to_stop: list[str] = []
        reqs_to_abort: list[str] = []
        stopped_by_string: list[str] = []
        for out in outputs:
            parent = self._parent_of.get(out.req_id)
            if parent is None:
                continue  # aborted by the front end meanwhile
            state = self.requests[parent]
            sample = state.samples[out.req_id]
            if sample.finish_reason is not None:
                continue
            scheduled = first_scheduled_times.get(out.req_id) if first_scheduled_times \
                else None
            if scheduled is not None and (state.first_scheduled_time is None
                                          or scheduled < state.first_scheduled_time):
                state.first_scheduled_time = scheduled
            if out.prompt_logprobs is not None:
                self._add_prompt_logprobs(state, out.prompt_logprobs)
            if not out.new_token_ids and out.finish_reason is None:
                continue  # a prefill chunk's prompt logprobs: nothing to send yet
            if out.new_token_ids and self._update_sample(state, sample, out, now):
                stopped_by_string.append(out.req_id)
                if out.finish_reason is None:  # the core must be told to stop it
                    reqs_to_stop.append(out.req_id)
            if sample.finish_reason is None and out.finish_reason is not None:
                sample.finish_reason, sample.stop_reason = out.finish_reason, out.stop_reason
            if sample.finish_reason is not None:
                self._finish_sample(state, sample, out.req_id, reqs_to_abort)
                if state.finished:
                    state.finished_time = now
            ro = self._request_output(state, sample)
            if ro is not None:
                request_outputs.append(ro)
        return ProcessedOutputs(request_outputs, reqs_to_stop, reqs_to_abort, stopped_by_string)

    def _update_sample(self, state: RequestState, sample: _Sample, out: EngineCoreOutput,
                       now: float) -> bool:
        """Take a sample's new tokens (timing, logprobs, text). True when a stop string ended
        it (the core must be told to stop it unless it finished the sample itself)."""
        if state.first_token_time is None or sample.index == 0:
            # n > 1: sample 0's hit, what the prompt found; its siblings hit the blocks
            # it computed (that is sharing, not a cache hit).
            state.num_cached_tokens = out.num_cached_tokens
        if state.first_token_time is None:
            state.first_token_time = now
        state.last_token_time = now
        num_before = len(sample.detok.output_token_ids)
        # EOS / stop token ids: the token stays in token_ids, its text stays out.
        stop_str = sample.detok.update(out.new_token_ids,
                                       stop_terminated=out.finish_reason == "stop")
        sample.token_ids = sample.detok.output_token_ids  # cut after a stop string
        # One record per token kept (a stop string may end several new tokens early).
        self._add_logprobs(sample, out.new_logprobs[:len(sample.token_ids) - num_before])
        if stop_str is None:
            return False
        sample.finish_reason, sample.stop_reason = "stop", stop_str
        return True

    def _finish_sample(self, state: RequestState, sample: _Sample, sample_id: str,
                       reqs_to_abort: list[str]) -> None:
        """A sample finished: count it off its request; a failed one fails its siblings."""
        state.num_unfinished -= 1
        self._parent_of.pop(sample_id, None)
        if sample.finish_reason == FinishReason.ERROR:
            reqs_to_abort += self._fail_siblings(state)

    def _request_output(self, state: RequestState, sample: _Sample) -> RequestOutput | None:
        """The request's output for this update (None when its kind sends none yet), also put
        on its queue; a finished request is forgotten."""
        ro = self._make_output(state, sample)
        if state.finished:
            del self.requests[state.request_id]
        if ro is not None and state.queue is not None:
            state.queue.put_nowait(ro)
        return ro

    def _fail_siblings(self, state: RequestState) -> list[str]:
        """One sample failed: the request fails whole; its unfinished samples end now."""
        ids = []
        for cid, s in state.samples.items():
            if s.finish_reason is None:
                s.finish_reason = FinishReason.ERROR.value
                state.num_unfinished -= 1
                self._parent_of.pop(cid, None)
                ids.append(cid)
        return ids

    def _add_logprobs(self, sample: _Sample, records: list[Logprobs]) -> None:
        if sample.logprobs is None:
            return
        # detokenize=False: no decoded_token either (None, as vLLM).
        tok = None if isinstance(sample.detok, TokenIdsOnly) else self.tokenizer
        for rec in records:
            sample.logprobs.append(_logprob_entry(tok, rec))
            assert sample.cumulative_logprob is not None
            sample.cumulative_logprob += rec.sampled_logprob

    def _add_prompt_logprobs(self, state: RequestState, chunk: PromptLogprobs) -> None:
        if state.prompt_logprobs is None:
            return
        if self.raw_prompt_logprobs:
            state.prompt_logprobs[chunk.start:chunk.start + len(chunk.records)] = chunk.records
            return
        tok = self.tokenizer if state.params.detokenize else None
        for pos, rec in enumerate(chunk.records, start=chunk.start):
            state.prompt_logprobs[pos] = _logprob_entry(tok, rec)

    def _completion(self, sample: _Sample, delta: bool) -> CompletionOutput:
        finished = sample.finish_reason is not None
        text = sample.detok.get_next_output_text(finished, delta)
        if delta:
            token_ids = sample.token_ids[sample.num_sent_tokens:]
            logprobs = (sample.logprobs[sample.num_sent_logprobs:]
                        if sample.logprobs is not None else None)
            sample.num_sent_tokens = len(sample.token_ids)
            sample.num_sent_logprobs = len(sample.logprobs or [])
        else:
            token_ids, logprobs = list(sample.token_ids), sample.logprobs
        return CompletionOutput(index=sample.index, text=text, token_ids=token_ids,
                                cumulative_logprob=sample.cumulative_logprob, logprobs=logprobs,
                                finish_reason=sample.finish_reason,
                                stop_reason=sample.stop_reason)

    def _make_output(self, state: RequestState, sample: _Sample) -> RequestOutput | None:
        if state.kind is OutputKind.FINAL_ONLY and not state.finished:
            return None
        if state.kind is OutputKind.DELTA:
            outputs = [self._completion(sample, delta=True)]
        else:
            ordered = sorted(state.samples.values(), key=lambda s: s.index)
            outputs = [self._completion(s, delta=False) for s in ordered]
        metrics = {"arrival_time": state.arrival_time}
        if state.first_token_time is not None:
            metrics["first_token_time"] = state.first_token_time
            metrics["last_token_time"] = state.last_token_time or state.first_token_time
        if state.first_scheduled_time is not None:
            metrics["first_scheduled_time"] = state.first_scheduled_time
        if state.finished_time is not None:
            metrics["finished_time"] = state.finished_time
        prompt_logprobs = state.prompt_logprobs
        if state.kind is OutputKind.DELTA and prompt_logprobs is not None:
            # Once, complete (n > 1: a sibling's first token may come before sample 0's scores).
            ready = not state.prompt_logprobs_sent and all(e is not None
                                                           for e in prompt_logprobs[1:])
            state.prompt_logprobs_sent |= ready
            prompt_logprobs = prompt_logprobs if ready else None
        return RequestOutput(request_id=state.request_id, prompt=state.prompt,
                             prompt_token_ids=state.prompt_token_ids, outputs=outputs,
                             finished=state.finished, num_cached_tokens=state.num_cached_tokens,
                             metrics=metrics, prompt_logprobs=prompt_logprobs)


def _logprob_entry(tokenizer: Any, rec: Logprobs) -> dict[int, Logprob]:
    return logprob_entry(rec, lambda tid: _decode(tokenizer, tid))


def logprob_entry(rec: Logprobs, decode: Callable[[int], str | None]) -> dict[int, Logprob]:
    """One token's logprobs as vLLM shapes them: the token itself first, then the top-N
    (``decode``: a token id's text, or None)."""
    entry = {rec.sampled_token_id: Logprob(rec.sampled_logprob, rec.sampled_rank,
                                           decode(rec.sampled_token_id))}
    for rank, (tid, lp) in enumerate(zip(rec.top_token_ids, rec.top_logprobs, strict=True),
                                     start=1):
        if tid not in entry:
            entry[tid] = Logprob(lp, rank, decode(tid))
    return entry


def _decode(tokenizer: Any, token_id: int) -> str | None:
    return None if tokenizer is None else decode_token(tokenizer, token_id)
