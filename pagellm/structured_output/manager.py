"""The engine core's side of structured outputs: compiles off the step loop, one matcher per
request, and each step's token bitmask.

A constrained request enters the scheduler's waiting queue at once, with its grammar compiling
in a small thread pool; the scheduler skips it (``Request.grammar.ready`` False) and runs the
others until ``update()``, at the start of a step, marks the compile done. The bitmask of a step
holds one row per constrained request that samples in it (filled on the engine core, which owns
the matchers) and travels to the model runner inside the SchedulerOutput, so under tensor
parallelism it reaches rank 0, the rank that samples, like the rest of the step.
"""

from __future__ import annotations

import concurrent.futures
import logging
from dataclasses import dataclass

import numpy as np

from pagellm.core.sched_output import SchedulerOutput
from pagellm.request import Request
from pagellm.structured_output.compiler import GrammarCompiler
from pagellm.structured_output.request_grammar import RequestGrammar

logger = logging.getLogger("pagellm")

COMPILE_THREADS = 2  # grammars compiling at once, off the step loop


@dataclass(slots=True)
class GrammarBitmask:
    """One step's allowed tokens: ``bitmask[i]`` (int32 words, bit t % 32 of word t // 32 set:
    token t allowed) is for request ``req_ids[i]``."""

    req_ids: list[str]
    bitmask: np.ndarray  # int32 [len(req_ids), ceil(vocab_size / 32)]


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class StructuredOutputManager:
    def __init__(self, compiler: GrammarCompiler, num_threads: int = COMPILE_THREADS) -> None:
        self.compiler = compiler
        self.vocab_size = compiler.vocab_size
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._num_threads = num_threads
        self._compiling: list[Request] = []  # grammar not marked ready yet
        self._requests: dict[str, Request] = {}  # unfinished constrained requests

    def add_request(self, request: Request) -> None:
        """Start compiling the request's grammar (the request may be queued right away)."""
        spec = request.sampling_params.structured_outputs
        assert spec is not None
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                self._num_threads, thread_name_prefix="pagellm-grammar")
        # Keyed by the request's cache namespace too: a tenant never hits another's entry.
        future = self._pool.submit(self.compiler.compile, spec, request.cache_salt)
        request.grammar = RequestGrammar(future, request.output_token_ids)
        self._compiling.append(request)
        self._requests[request.request_id] = request

    @property
    def num_requests(self) -> int:
        """Unfinished constrained requests (finished ones are forgotten here)."""
        for req_id in [r for r, req in self._requests.items() if req.is_finished]:
            del self._requests[req_id]
        return len(self._requests)

    @property
    def num_compiling(self) -> int:
        return len(self._compiling)

    def update(self) -> list[Request]:
        """Mark the grammars compiled since the last call ready; returns the requests whose
        compile failed (to be finished with an error). Called once per step, before
        scheduling, so whether a request can run does not change during a step."""
        failed: list[Request] = []
        still: list[Request] = []
        for request in self._compiling:
            grammar = request.grammar
            if request.is_finished:
                continue  # aborted while compiling
            if not grammar.is_compiled():
                still.append(request)
            elif grammar.compile_error() is not None:
                logger.error("Grammar of request %s failed to compile: %s", request.request_id,
                             grammar.compile_error())
                failed.append(request)
            else:
                grammar.ready = True
        self._compiling = still
        return failed

    def wait_for_compiles(self, timeout_s: float) -> None:
        """Block until a compile finishes or ``timeout_s`` passes (nothing else to run)."""
        futures = [r.grammar.future for r in self._compiling if not r.is_finished]
        if futures:
            concurrent.futures.wait(futures, timeout_s,
                                    return_when=concurrent.futures.FIRST_COMPLETED)

    def grammar_bitmask(self, sched_output: SchedulerOutput, requests: dict[str, Request]
                        ) -> GrammarBitmask | None:
        """The bitmask of the constrained requests that sample in ``sched_output`` (their
        scheduled tokens reach the end of their known tokens); None when none does. Forgets
        finished requests on the way."""
        scheduled = sched_output.num_scheduled_tokens
        sampling: list[Request] = []
        for req_id, request in list(self._requests.items()):
            if request.is_finished or requests.get(req_id) is not request:
                del self._requests[req_id]
            elif req_id in scheduled and request.num_computed_tokens >= request.num_tokens:
                sampling.append(request)
        if not sampling:
            return None
        import torch

        bitmask = np.empty((len(sampling), bitmask_words(self.vocab_size)), dtype=np.int32)
        view = torch.from_numpy(bitmask)  # xgrammar fills torch tensors; same memory
        for i, request in enumerate(sampling):
            request.grammar.fill_bitmask(view, i)
            if request.num_output_tokens < request.sampling_params.min_tokens:
                _hold_back_stop_tokens(bitmask[i], request, self.vocab_size)
        return GrammarBitmask([r.request_id for r in sampling], bitmask)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


def _hold_back_stop_tokens(row: np.ndarray, request: Request, vocab_size: int) -> None:
    """min_tokens under a grammar: EOS and the stop token ids stay masked while the request is
    short of min_tokens, unless the grammar allows nothing else (its output is complete, and a
    complete output ends the request whatever min_tokens says)."""
    params = request.sampling_params
    stops = set(params.stop_token_ids or ())
    if request.eos_token_id is not None:
        stops.add(request.eos_token_id)
    words = row.view(np.uint32)
    saved = words.copy()
    for tok in stops:
        if 0 <= tok < vocab_size:
            words[tok // 32] &= np.uint32(~(1 << (tok % 32)) & 0xFFFFFFFF)
    if not words.any():
        words[:] = saved
