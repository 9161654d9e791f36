"""AsyncLLM: the asyncio client the server uses to reach the engine core process.

Tokenization (InputProcessor) and detokenization (OutputProcessor) run here, in the front end; the
engine core runs in its own process (core_proc.py), so HTTP and text work never take the GIL from
the model loop. One background task reads the engine's outputs and routes each RequestOutput to
its request's queue; ``generate()`` reads that queue.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import pickle
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import zmq
import zmq.asyncio

from pagellm.config import EngineConfig
from pagellm.engine.core_proc import EngineCoreClient, EngineCoreOutputs
from pagellm.engine.dp_client import DPEngineCoreClient, combine_weight_updates, make_core_client
from pagellm.engine.input_processor import InputProcessor, PromptType
from pagellm.engine.output_processor import OutputKind, OutputProcessor
from pagellm.engine_args import EngineArgs
from pagellm.errors import (
    EngineDeadError,
    EngineSleepingError,
    RequestFailedError,
    RequestIdInUseError,
    WeightUpdateError,
)
from pagellm.metrics.cache_info import cache_config_info
from pagellm.metrics.logger import DEFAULT_LOG_INTERVAL_S, LoggingStatLogger
from pagellm.metrics.metric_specs import DEFAULT_METRIC_NAMES, prefixes
from pagellm.metrics.prometheus import PrometheusStatLogger
from pagellm.metrics.request_stats import IterationMetrics, RequestStatsTracker
from pagellm.metrics.stats import SchedulerStats
from pagellm.outputs import RequestOutput
from pagellm.request import FinishReason, RequestStatus
from pagellm.sampling_params import SamplingParams
from pagellm.structured_output.compile_pool import GrammarCompilePool

logger = logging.getLogger("pagellm")

__all__ = ["AsyncLLM", "EngineDeadError", "OutputKind", "RequestFailedError", "RequestStream"]


class RequestStream:
    """The outputs of one request, as an async iterator. ``close()`` (or being dropped before the
    last output) aborts the request in the engine. Raises EngineDeadError if the engine dies, and
    RequestFailedError (instead of yielding its last output) if the step that ran the request
    raised (the engine goes on)."""

    def __init__(self, engine: AsyncLLM, request_id: str, prompt: str | None,
                 prompt_token_ids: list[int], queue: asyncio.Queue) -> None:
        self.engine = engine
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.queue = queue
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
            if any(c.finish_reason == FinishReason.ERROR for c in item.outputs):
                raise RequestFailedError(
                    f"Request {self.request_id} failed: the engine raised while admitting or "
                    "running it (the cause is in the server log).", [self.request_id])
        return item

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            self.engine.abort_nowait([self.request_id])

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: nothing left to free
            pass


class AsyncLLM:
    def __init__(self, config: EngineConfig, *, log_stats: bool = True,
                 log_requests: bool = False, max_log_len: int | None = None,
                 stat_log_interval_s: float = DEFAULT_LOG_INTERVAL_S,
                 core_factory: Any = None, tokenizer: Any = None,
                 eos_token_id: int | None = None,
                 metric_names: str = DEFAULT_METRIC_NAMES) -> None:
        if tokenizer is None:
            from pagellm.engine.llm_engine import load_tokenizer_and_eos

            tokenizer, eos_token_id = load_tokenizer_and_eos(config)
        self.config = config
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        self.log_requests = log_requests
        self.max_log_len = max_log_len
        self.input_processor = InputProcessor(config, tokenizer, eos_token_id)
        # The server compiles grammars here, off the event loop, before add_request.
        self.grammar_pool = GrammarCompilePool(self.input_processor.grammar_compiler)
        # Prompt logprobs (up to ~100k entries a request) are shaped and decoded by the
        # server, off the event loop this runs on.
        self.output_processor = OutputProcessor(tokenizer, raw_prompt_logprobs=True)
        self.request_stats = RequestStatsTracker()
        prefixes(metric_names)  # a bad --metrics-names fails before the engine starts
        self.stat_logger = LoggingStatLogger() if log_stats else None
        self.stat_log_interval_s = stat_log_interval_s
        self.scheduler_stats = SchedulerStats()
        self.dead_error: EngineDeadError | None = None
        self._dead_callbacks: list[Callable[[EngineDeadError], None]] = []
        self._tasks: list[asyncio.Task] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._utility_calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        # Set from the moment a sleep is asked for until wake_up returns: requests are refused.
        self._sleeping = False
        self._closing = False
        # When the engine last made progress (sent a step's outputs) or, if later, when work
        # became pending: a wedged engine shows as this growing while requests are in flight.
        self._last_progress = time.monotonic()
        self.core = core = make_core_client(config, eos_token_id, core_factory)
        # Data parallelism (--data-parallel-size N): N engines, each with its own output
        # socket; self._dp routes requests over them. One engine: the client itself.
        self._dp = core if isinstance(core, DPEngineCoreClient) else None
        self.engines: list[EngineCoreClient] = (
            core.engines if isinstance(core, DPEngineCoreClient) else [core])
        parallel = getattr(config, "parallel", None)  # test doubles' configs lack it
        # Each engine's index in the metrics' engine label: its data-parallel rank.
        self.engine_indexes: tuple[int, ...] = parallel.engine_ranks if parallel else (0,)
        spec = config.speculative_config
        # Built once the engine is up: cache_config_info carries its KV block count.
        cache = getattr(config, "cache", None)  # test doubles' configs lack it
        self.prometheus = PrometheusStatLogger(
            config.model.served_model_name, config.model.max_model_len,
            num_speculative_tokens=spec.num_speculative_tokens if spec is not None else 0,
            engine_indexes=self.engine_indexes, metric_names=metric_names,
            cache_config_info=None if cache is None else cache_config_info(
                cache, self.core.info.get("num_blocks")))

    @classmethod
    def from_engine_args(cls, args: EngineArgs, **kwargs: Any) -> AsyncLLM:
        return cls(args.create_engine_config(), **kwargs)

    # ---- lifecycle -------------------------------------------------------------------------
    @property
    def engine_pid(self) -> int | None:
        return self.core.pid

    @property
    def num_unfinished_requests(self) -> int:
        """Sequences (n > 1 counts n) sent to the engine and not yet finished or aborted."""
        return len(self.request_stats)

    @property
    def num_prefill_tokens(self) -> int:
        """Prompt tokens of the sequences sent to the engine that have no output token yet
        (each of n samples counts its prompt; a chunked prompt counts whole until then)."""
        return self.request_stats.num_prefill_tokens

    @property
    def errored(self) -> bool:
        return self.dead_error is not None

    def on_dead(self, callback: Callable[[EngineDeadError], None]) -> None:
        """Call ``callback`` once if the engine process dies or fails."""
        self._dead_callbacks.append(callback)

    def start(self) -> None:
        """Start the output handler (and the stats log) on the running loop; idempotent."""
        if self._loop is not None:
            return
        loop = self._loop = asyncio.get_running_loop()
        for i, engine in enumerate(self.engines):
            self._tasks.append(loop.create_task(self._output_handler(i),
                                                name=f"pagellm-output{self._rank_name(i)}"))
            # The process sentinel becomes readable when the engine exits, however it exits.
            loop.add_reader(engine.proc.sentinel, self._on_engine_exit, i)
        if self.stat_logger is not None:
            self._tasks.append(loop.create_task(self._log_stats_loop(), name="pagellm-stats"))

    async def aclose(self) -> None:
        """Stop the background tasks and the engine process."""
        self._closing = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        self.shutdown()

    def shutdown(self) -> None:
        self._closing = True
        if self._loop is not None and not self._loop.is_closed():
            for engine in self.engines:
                self._loop.remove_reader(engine.proc.sentinel)
        self.grammar_pool.shutdown()
        self.core.shutdown()

    def _rank_name(self, i: int) -> str:
        """"" for a single engine; " of data-parallel rank R" for engine ``i`` of several."""
        return "" if self._dp is None else f" of data-parallel rank {self.engine_indexes[i]}"

    def _on_engine_exit(self, i: int = 0) -> None:
        assert self._loop is not None
        proc = self.engines[i].proc
        self._loop.remove_reader(proc.sentinel)
        if not self._closing:
            proc.join(1.0)  # the sentinel can fire just before the exit status is in
            # One engine of several gone: the server is dead too (its share of the requests
            # would fail), so /health fails and the server exits for a restart.
            self._set_dead(f"The engine core process{self._rank_name(i)} exited (exit code "
                           f"{proc.exitcode}).")

    def _set_dead(self, message: str) -> None:
        if self.dead_error is not None:
            return
        self.dead_error = EngineDeadError(message)
        logger.error("%s", message)
        for state in self.output_processor.requests.values():
            if state.queue is not None:
                state.queue.put_nowait(self.dead_error)
        for fut in self._utility_calls.values():
            if not fut.done():
                fut.set_exception(self.dead_error)
        for callback in self._dead_callbacks:
            callback(self.dead_error)

    async def check_health(self) -> None:
        if self.dead_error is not None:
            raise self.dead_error

    def seconds_without_progress(self) -> float:
        """How long requests have been in flight with no engine step completing (0 while
        none are in flight): a wedged step, a hung device, a deadlock in the engine."""
        if self._dp is not None:
            return self._dp.seconds_without_progress()
        if not self.num_unfinished_requests:
            return 0.0
        return time.monotonic() - self._last_progress

    # ---- requests --------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                    kind: OutputKind = OutputKind.DELTA, arrival_time: float | None = None,
                    priority: int = 0, grammar_compiled: bool = False) -> RequestStream:
        """Validate, tokenize and send one prompt to the engine (raises ValueError for bad
        input, EngineDeadError when the engine is gone); returns its output stream.
        ``grammar_compiled``: ``grammar_pool.compile`` has compiled the request's spec (for its
        cache_salt), so it is not compiled again here, on the event loop."""
        if self.dead_error is not None:
            raise self.dead_error
        if self._sleeping:
            raise EngineSleepingError("The engine is sleeping (its memory is freed for "
                                      "training): POST /wake_up first, then retry.")
        self.start()
        if request_id in self.output_processor.requests:
            raise RequestIdInUseError(f"Request id {request_id!r} is already in use.")
        processed, children = self.input_processor.process(request_id, prompt, params,
                                                           arrival_time, priority,
                                                           grammar_compiled)
        queue: asyncio.Queue = asyncio.Queue()
        ids = processed.prompt_token_ids
        self.output_processor.add_request(
            request_id, processed.prompt, ids, params, [c.request_id for c in children], kind,
            queue, arrival_time=children[0].arrival_time)
        if not self.num_unfinished_requests:
            self._last_progress = time.monotonic()  # an idle engine owes no step until now
        for child in children:
            self.request_stats.add(child.request_id, child.arrival_time, len(ids),
                                   child.max_tokens, params.n, child.group_id)
        try:
            self.core.add_requests(children)
        except BaseException:
            self.output_processor.abort_request(request_id)
            self.request_stats.abort([c.request_id for c in children])
            raise
        if self.log_requests:
            # NOTE: the only place prompt text is logged, and only with --enable-log-requests.
            logger.info("Received request %s: prompt: %s, %d prompt tokens, params: %s",
                        request_id, _clip(processed.prompt, ids, self.max_log_len), len(ids),
                        params)
        return RequestStream(self, request_id, processed.prompt, ids, queue)

    async def generate(self, prompt: PromptType, params: SamplingParams, request_id: str,
                       kind: OutputKind = OutputKind.DELTA, arrival_time: float | None = None,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs (deltas by default) until it finishes. If the consumer
        stops early (client gone, task cancelled), the request is aborted and its KV blocks
        are freed in the engine's next step."""
        stream = self.add_request(request_id, prompt, params, kind, arrival_time, priority)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    async def abort(self, request_id: str | list[str]) -> None:
        self.abort_nowait([request_id] if isinstance(request_id, str) else request_id)

    def abort_nowait(self, request_ids: list[str]) -> None:
        child_ids = [c for rid in request_ids for c in self.output_processor.abort_request(rid)]
        if not child_ids:
            return
        self._record(None, self.request_stats.abort(child_ids), self._engine_index_of(child_ids))
        if self.dead_error is None and not self._closing:
            self.core.abort_requests(child_ids)
            if self.log_requests:
                logger.info("Aborted request(s) %s", ", ".join(request_ids))

    async def reset_prefix_cache(self) -> bool:
        return all(map(bool, await self._call_utility("reset_prefix_cache")))

    async def update_weights_from_disk(self, model_path: str) -> int:
        """Load a safetensors checkpoint of the same architecture into the running engine, once
        the requests running when it arrives have finished (on the old weights); requests sent
        meanwhile wait and then run on the new ones. The prefix cache is reset. Raises
        ValueError (naming model_path) for a path that is not such a checkpoint, nothing changed;
        WeightUpdateError when the load failed midway: the previous weights restored, or, when
        they could not be, the engine is taken out of service here too (as if it had died).
        With data parallelism every engine loads it, all or nothing (combine_weight_updates):
        engines left on different weights take the server out of service."""
        try:
            results = await self._call_each("update_weights_from_disk", (model_path,))
            return combine_weight_updates(results, self.engine_indexes)
        except WeightUpdateError as e:
            if not e.restored:
                self._set_dead(f"The engine is out of service: {e}")
            raise

    async def sleep(self, level: int = 1) -> None:
        """Free the KV cache (level 1) and the weights (level 2) once the requests running now
        have finished; requests sent from now until wake_up raise EngineSleepingError."""
        was, self._sleeping = self._sleeping, True
        try:
            results = await self._call_each("sleep", (level,))
            slept = [i for i, r in enumerate(results) if not isinstance(r, BaseException)]
            failed = [r for r in results if isinstance(r, BaseException)]
            if failed:
                if slept:  # all or nothing: wake the engines that slept
                    woken = await self._call_each("wake_up", engines=slept)
                    if any(isinstance(r, BaseException) for r in woken):
                        logger.error("sleep failed on some data-parallel ranks and wake_up "
                                     "failed on others: POST /wake_up again.")
                        was = True  # some engine still sleeps: keep refusing requests
                raise failed[0]
        except BaseException:
            self._sleeping = was
            raise

    async def wake_up(self) -> None:
        # An engine that failed to wake keeps the server refusing; a retry wakes it (awake
        # engines ignore wake_up).
        await self._call_utility("wake_up")
        self._sleeping = False

    async def is_sleeping(self) -> bool:
        """True while any engine sleeps (the server is not fully back)."""
        return any(map(bool, await self._call_utility("is_sleeping")))

    async def _call_utility(self, method: str, args: tuple = ()) -> list[Any]:
        """Every engine's result of ``method`` (raising the first engine's error, if any)."""
        results = await self._call_each(method, args)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return results

    async def _call_each(self, method: str, args: tuple = (),
                         engines: list[int] | None = None) -> list[Any]:
        """Run ``method`` on each engine (positions ``engines``; default all) at once: its
        result or the exception it raised, in engine order."""
        if self.dead_error is not None:
            raise self.dead_error
        self.start()
        loop = asyncio.get_running_loop()
        call_ids: list[int] = []
        try:
            for i in range(len(self.engines)) if engines is None else engines:
                call_id = next(self._call_ids)
                self._utility_calls[call_id] = loop.create_future()
                call_ids.append(call_id)
                self.engines[i].send(("utility", call_id, method, args))
            return list(await asyncio.gather(*(self._utility_calls[c] for c in call_ids),
                                             return_exceptions=True))
        finally:
            for call_id in call_ids:
                self._utility_calls.pop(call_id, None)

    # ---- background tasks ------------------------------------------------------------------
    async def _output_handler(self, i: int = 0) -> None:
        """Reads engine ``i``'s output socket."""
        sock = zmq.asyncio.Socket.shadow(self.engines[i].output_socket.underlying)
        try:
            while True:
                frame = await sock.recv(copy=False)
                msg = pickle.loads(frame.buffer)
                if msg[0] == "outputs":
                    self._process(msg[1], i)
                elif msg[0] == "utility":
                    fut = self._utility_calls.get(msg[1])
                    if fut is not None and not fut.done():
                        if isinstance(msg[2], BaseException):
                            fut.set_exception(msg[2])
                        else:
                            fut.set_result(msg[2])
                elif msg[0] == "error":
                    self._set_dead(f"The engine core{self._rank_name(i)} failed:\n{msg[1]}")
                    return
        except asyncio.CancelledError:
            raise
        except Exception as e:
            logger.exception("Output handler failed")
            self._set_dead(f"The output handler failed: {e!r}")

    def _process(self, batch: EngineCoreOutputs, i: int = 0) -> None:
        """Engine ``i``'s outputs of one step."""
        self._last_progress = time.monotonic()
        if self._dp is not None:
            self._dp.on_outputs(i, batch)
        index = self.engine_indexes[i]
        failed = [o.req_id for o in batch.outputs if o.finish_reason == FinishReason.ERROR]
        if failed:
            # Failed samples finish with reason "error" in the metrics; popped here, update()
            # below skips them.
            self._record(None, self.request_stats.abort(failed, reason="error"), index)
        processed = self.output_processor.process_outputs(batch.outputs,
                                                          batch.first_scheduled_times)
        if processed.reqs_to_stop:
            # A stop string ended these samples: the engine must stop them too.
            self.core.abort_requests(processed.reqs_to_stop, RequestStatus.FINISHED_STOPPED)
        if processed.reqs_to_abort:  # siblings of a failed sample
            self.core.abort_requests(processed.reqs_to_abort)
            self._record(None, self.request_stats.abort(processed.reqs_to_abort), index)
        it = self.request_stats.update(batch.outputs, batch.first_scheduled_times,
                                       processed.stopped_by_string)
        self._record(batch.scheduler_stats, it, index)

    def _engine_index_of(self, child_ids: list[str]) -> int:
        """The engine label of these samples (one request's: they run on one engine)."""
        return self.engine_indexes[0] if self._dp is None else \
            self._dp.engine_index_of(child_ids[0])

    def _record(self, stats: SchedulerStats | None, it: IterationMetrics | None,
                engine_index: int) -> None:
        """``stats``/``it`` of the engine of data-parallel rank ``engine_index``."""
        self.prometheus.record(stats, it, engine_index=engine_index)
        if stats is not None and self._dp is not None:
            stats = self._dp.merged_stats()  # the server's totals (on_outputs stored stats)
        if stats is not None:
            self.scheduler_stats = stats
        if self.stat_logger is not None:
            self.stat_logger.record(stats, it)

    async def _log_stats_loop(self) -> None:
        assert self.stat_logger is not None
        while True:
            await asyncio.sleep(self.stat_log_interval_s)
            self.stat_logger.log()


def _clip(prompt: str | None, ids: list[int], max_len: int | None) -> str:
    """The prompt for the request log (its token ids when it came as ids), clipped to
    ``max_len`` characters or ids."""
    if prompt is not None:
        return repr(prompt if max_len is None else prompt[:max_len])
    return f"token ids {ids if max_len is None else ids[:max_len]}"
