"""EngineCore: the scheduler and the model runner, one step at a time (no tokenizer here).

The offline LLMEngine runs it in-process; the server runs it in its own process behind a
transport, so HTTP and detokenization never contend with the model loop for the GIL.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from pagellm.config import EngineConfig
from pagellm.core.sched_output import EngineCoreOutput, SchedulerOutput
from pagellm.core.scheduler import Scheduler
from pagellm.engine.kv_events import kv_events_enabled, make_publisher
from pagellm.engine.overlap import OverlappedSteps
from pagellm.errors import (
    EngineDeadError,
    EngineSleepingError,
    EngineStepsFailedError,
    WeightUpdateError,
    WorkerFailedError,
)
from pagellm.metrics.stats import SchedulerStats
from pagellm.request import FinishReason, Request, RequestStatus
from pagellm.structured_output.compiler import GrammarCompiler, grammar_compiler_for
from pagellm.structured_output.manager import StructuredOutputManager
from pagellm.worker.state_cache import snapshot_layout

logger = logging.getLogger("pagellm")

# A model step that raises fails the requests it ran and the engine goes on; this many failed
# steps in a row (no step succeeding between them) mean the fault is not in the requests but in
# the engine (a broken device, a bug on every path), and the engine stops.
MAX_CONSECUTIVE_STEP_FAILURES = 3
# How long a step with nothing to run but grammars still compiling waits for one of them.
_GRAMMAR_WAIT_S = 0.05


@dataclass(slots=True)
class IterationStats:
    """Totals since start-up, updated every step."""

    num_steps: int = 0
    num_prompt_tokens: int = 0  # prompt tokens computed (prefix-cache hits excluded)
    num_generation_tokens: int = 0
    num_finished: dict[str, int] = field(default_factory=dict)
    step_time_s: float = 0.0


class EngineCore:
    def __init__(self, config: EngineConfig, eos_token_id: int | None = None,
                 grammar_compiler: GrammarCompiler | None = None) -> None:
        """``grammar_compiler``: the frontend's, when it lives in this process (its cache then
        serves both); by default the core makes its own, loading the tokenizer on first use."""
        from pagellm.worker.executor import make_executor

        self.config = config
        start = time.perf_counter()
        self.executor = make_executor(config, eos_token_id)
        num_blocks = self.executor.initialize_kv_cache()
        self.scheduler = Scheduler(config.scheduler, config.cache, num_blocks,
                                   config.model.kv_cache_layout().windows,
                                   speculative_config=config.speculative_config,
                                   enable_kv_cache_events=kv_events_enabled(config),
                                   num_state_slots=config.num_state_slots,
                                   state_snapshots=snapshot_layout(config, num_blocks))
        self.num_blocks = num_blocks
        self.stats = IterationStats()
        self.num_consecutive_step_failures = 0
        self.num_failed_steps = 0
        self.sleep_level = 0  # see sleep()
        # Why the engine refuses every request (a weight update it could not undo), or None.
        self.out_of_service: str | None = None
        if grammar_compiler is None:
            grammar_compiler = grammar_compiler_for(
                config, lambda: _load_tokenizer(config), eos_token_id)
        self.structured_output = StructuredOutputManager(grammar_compiler)
        # Async scheduling (engine/overlap.py): the step submitted and not processed yet.
        self.async_scheduling = config.scheduler.async_scheduling
        self.overlap = OverlappedSteps(self)
        # KV cache events (--kv-events-config; engine/kv_events.py): None when off. Last, so a
        # failed start-up leaves no socket bound.
        self.kv_event_publisher = make_publisher(config)
        logger.info("Engine ready in %.1f s", time.perf_counter() - start)

    def add_request(self, request: Request) -> None:
        if self.out_of_service is not None:
            raise EngineDeadError(self.out_of_service)
        if self.sleep_level:
            raise EngineSleepingError("The engine is sleeping (its KV cache is freed): call "
                                      "wake_up() before sending requests.")
        self.scheduler.add_request(request)
        if request.sampling_params.structured_outputs is not None:
            # Queued now, admitted by the scheduler once its grammar has compiled.
            self.structured_output.add_request(request)

    def abort_requests(self, req_ids: list[str],
                       status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        if req_ids:
            self.scheduler.finish_requests(req_ids, status)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self.overlap.pending

    def step(self) -> list[EngineCoreOutput]:
        if not self.has_unfinished_requests():
            return []
        start = time.perf_counter()
        outputs = self.overlap.take_drained() + self._update_grammars()
        if not self.scheduler.has_unfinished_requests():
            outputs += self.overlap.collect_in_flight()  # a step of finished requests only
        elif self._only_compiling() and self.overlap.in_flight is None:
            # Nothing can run until a grammar compiles: wait for one (not a busy loop).
            self.structured_output.wait_for_compiles(_GRAMMAR_WAIT_S)
            return outputs
        elif self.async_scheduling and not self.structured_output.num_requests:
            outputs += self.overlap.step()
        else:
            # A constrained request's bitmask needs its grammar fed every token so far: no
            # step may be in flight when one is scheduled.
            outputs += self.overlap.collect_in_flight()
            if self.scheduler.has_unfinished_requests() and not self._only_compiling():
                outputs += self._step_sync()
        self.publish_kv_events()
        self.stats.step_time_s += time.perf_counter() - start
        return outputs

    def _step_sync(self) -> list[EngineCoreOutput]:
        sched_output = self.scheduler.schedule()
        if self.structured_output.num_requests:
            sched_output.grammar_bitmask = self.structured_output.grammar_bitmask(
                sched_output, self.scheduler.requests)
        num_prefill = self.num_prefill_tokens(sched_output)  # before finished requests go
        try:
            runner_output = self.executor.execute_model(sched_output)
        except WorkerFailedError:
            raise  # a tensor-parallel rank is gone: the executor cannot run another step
        except Exception as e:
            return self.fail_step(sched_output, e)
        self.num_consecutive_step_failures = 0
        outputs = self.scheduler.update_from_output(sched_output, runner_output)
        self.count(num_prefill, outputs)
        return outputs

    def drain(self) -> None:
        """Process the step in flight (async scheduling) before anything else uses the runner
        or the block pool wholesale; its outputs go out with the next step()."""
        self.overlap.drain()

    def _update_grammars(self) -> list[EngineCoreOutput]:
        """Admit the requests whose grammar compiled; finish those whose compile failed (the
        frontend compiled the same spec, so only an engine fault gets here)."""
        failed = self.structured_output.update()
        if not failed:
            return []
        ids = [r.request_id for r in failed]
        self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ERROR)
        reason = FinishReason.ERROR.value
        finished = self.stats.num_finished
        finished[reason] = finished.get(reason, 0) + len(ids)
        return [EngineCoreOutput(req_id=r, new_token_ids=[], finish_reason=reason) for r in ids]

    def _only_compiling(self) -> bool:
        """Every unfinished request waits for its grammar."""
        sched = self.scheduler
        return (not sched.running and self.structured_output.num_compiling > 0
                and self.structured_output.num_compiling == len(sched.waiting))

    def fail_step(self, sched_output: SchedulerOutput, error: Exception,
                  later: SchedulerOutput | None = None) -> list[EngineCoreOutput]:
        """Finish the step's requests (and those of ``later``, the step scheduled after it with
        async scheduling) with finish_reason "error" (blocks freed, the scheduler consistent),
        or raise EngineStepsFailedError after too many failed steps in a row."""
        self.num_consecutive_step_failures += 1
        self.num_failed_steps += 1
        failed = self.scheduler.fail_step(sched_output)
        if later is not None:
            failed += self.scheduler.fail_step(later)
        # NOTE: ids only: the step's prompts are user data and stay out of the log.
        logger.error("Model step failed (%d in a row, at most %d): %s: %s; failing its %d "
                     "request(s): %s", self.num_consecutive_step_failures,
                     MAX_CONSECUTIVE_STEP_FAILURES, type(error).__name__, error, len(failed),
                     ", ".join(failed), exc_info=error)
        if self.num_consecutive_step_failures >= MAX_CONSECUTIVE_STEP_FAILURES:
            raise EngineStepsFailedError(
                f"{self.num_consecutive_step_failures} model steps in a row raised (the last: "
                f"{type(error).__name__}: {error}); the engine stops.") from error
        reason = FinishReason.ERROR.value
        outputs = [EngineCoreOutput(req_id=r, new_token_ids=[], finish_reason=reason)
                   for r in failed]
        self.count(0, outputs)
        return outputs

    def num_prefill_tokens(self, so: SchedulerOutput) -> int:
        """Scheduled tokens at prompt positions: prompt tokens computed this step (prefix-cache
        hits are never scheduled; a 1-token last prefill chunk still counts, recomputed output
        tokens after a preemption do not)."""
        counts = so.num_scheduled_tokens
        n = sum(max(0, min(counts[r.req_id], len(r.prompt_token_ids) - r.num_computed_tokens))
                for r in so.scheduled_new_reqs)
        cached = so.scheduled_cached_reqs
        for req_id, num_computed in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
            num_prompt = self.scheduler.requests[req_id].num_prompt_tokens
            n += max(0, min(counts[req_id], num_prompt - num_computed))
        return n

    def count(self, num_prefill: int, outputs: list[EngineCoreOutput]) -> None:
        st = self.stats
        st.num_steps += 1
        num_gen = 0
        for out in outputs:
            num_gen += len(out.new_token_ids)
            if out.finish_reason is not None:
                st.num_finished[out.finish_reason] = st.num_finished.get(out.finish_reason, 0) + 1
        st.num_generation_tokens += num_gen
        st.num_prompt_tokens += num_prefill

    def make_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    def reset_prefix_cache(self) -> bool:
        self.drain()
        reset = self.scheduler.reset_prefix_cache()
        self.publish_kv_events()
        return reset

    def publish_kv_events(self) -> None:
        """Send the block pool's KV cache events since the last call as one batch (none: no
        batch), after each step and each prefix-cache reset."""
        if self.kv_event_publisher is not None:
            events = self.scheduler.kv_cache_manager.take_events()
            if events:
                self.kv_event_publisher.publish(events)

    def collective_rpc(self, method: str | Callable[..., Any], args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        self.drain()
        return self.executor.collective_rpc(method, args, kwargs)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Update the model's weights on every rank, between steps with no request unfinished
        (their K/V would mix the two models), then forget the prefix cache: no K/V computed
        with the old weights is reused. Returns how many tensors were loaded.

        All or nothing: ValueError (nothing changed) for a name, dtype or shape the model does
        not take, every tensor checked before the first is copied; WeightUpdateError when it
        failed after weights began to change (see ``_update``)."""
        self._check_in_service()
        if self.scheduler.has_unfinished_requests():
            raise RuntimeError("load_weights needs an idle engine: requests are still running")
        self.drain()
        # CPU copies for the other ranks' processes (pickled through the broadcast).
        tp = self.config.parallel.tensor_parallel_size > 1
        batch = []
        for item in weights:
            if not (isinstance(item, tuple | list) and len(item) == 2
                    and isinstance(item[0], str) and isinstance(item[1], torch.Tensor)):
                raise ValueError("load_weights takes (name, tensor) pairs")
            name, t = item
            batch.append((name, t.detach().cpu() if tp else t.detach()))
        try:
            return self._update(lambda: self.executor.collective_rpc("stage_weights", (batch,)))
        finally:
            self.publish_kv_events()  # the prefix cache was reset

    def update_weights_from_disk(self, model_path: str) -> int:
        """``load_weights`` from a safetensors checkpoint of the same architecture (ValueError
        naming model_path for anything else, or for a tensor the model does not take: checked
        from the files' headers before any data is read); each rank reads the files itself."""
        from pagellm.worker.weight_checkpoint import check_same_architecture, load_checkpoint

        self._check_in_service()
        files = check_same_architecture(self.config.model.hf_config, model_path)
        if self.scheduler.has_unfinished_requests():
            raise RuntimeError("update_weights_from_disk needs an idle engine")
        self.drain()
        try:
            return self._update(
                lambda: self.executor.collective_rpc(load_checkpoint, (files, model_path)))
        finally:
            self.publish_kv_events()  # the prefix cache was reset

    def _check_in_service(self) -> None:
        if self.out_of_service is not None:
            raise EngineDeadError(self.out_of_service)

    def _update(self, stage: Callable[[], list[int]]) -> int:
        """Stage an update on every rank, then commit it on all or roll it back on all (one
        rank's failure undoes the others' loads). Raises ValueError when it was refused and no
        rank changed anything; otherwise WeightUpdateError: ``restored`` (every rank back on
        the previous weights) or not (the engine goes out of service: every later request
        fails). The prefix cache is reset after every update that changed weights, whether it
        succeeded or was undone."""
        try:
            counts = stage()
        except WorkerFailedError as e:  # a rank died: its weights are unknown
            raise self._go_out_of_service("a tensor-parallel worker failed during a weight "
                                          "update") from e
        except Exception as e:
            error = self._undo_update(e)
            if error is e:
                raise
            raise error from e
        try:
            self.executor.collective_rpc("end_weight_update", (True,))
        except Exception as e:  # committing only drops backups: a rank died
            raise self._go_out_of_service("committing a weight update failed") from e
        if not self.scheduler.reset_prefix_cache():
            raise self._go_out_of_service("the prefix cache could not be reset after a weight "
                                          "update")
        return counts[0]

    def _undo_update(self, error: Exception) -> Exception:
        """Roll every rank back after ``error`` (the first failing rank's); returns what to
        raise: ``error`` itself when it is a ValueError (a refused update) and no rank is left
        changed, else a WeightUpdateError (no cause text: the cause is logged)."""
        try:
            states = self.executor.collective_rpc("end_weight_update", (False,))
        except Exception as e:
            logger.critical("Rolling back a failed weight update failed: %s: %s",
                            type(e).__name__, e, exc_info=e)
            states = ["broken"]
        if all(s == "unchanged" for s in states):
            if isinstance(error, ValueError):
                return error  # refused before anything changed: the caller's own problem
            logger.error("Weight update failed before any weight changed: %s: %s",
                         type(error).__name__, error, exc_info=error)
            return WeightUpdateError("The weight update failed before any weight changed (the "
                                     "cause is in the server's log); the engine serves the "
                                     "previous weights.", restored=True)
        if "broken" in states:
            return self._go_out_of_service("a failed weight update could not be undone")
        if not self.scheduler.reset_prefix_cache():  # idle: cannot fail, yet never serve stale K/V
            return self._go_out_of_service("the prefix cache could not be reset after a failed "
                                           "weight update")
        logger.warning("Weight update failed (%s: %s); every rank's previous weights were "
                       "restored (rank states: %s) and the prefix cache reset",
                       type(error).__name__, error, ", ".join(states))
        if isinstance(error, ValueError):
            return error  # refused by a rank while another loaded: undone, nothing changed
        return WeightUpdateError("The weight update failed (the cause is in the server's log); "
                                 "the previous weights were restored and the engine serves "
                                 "them.", restored=True)

    def _go_out_of_service(self, reason: str) -> WeightUpdateError:
        """Refuse every request from now on (the weights may be a mix of two models); returns
        the error the update raises."""
        self.out_of_service = (f"The engine is out of service: {reason} and its weights may be "
                               "inconsistent; restart it.")
        logger.critical("%s", self.out_of_service)
        try:
            self.scheduler.reset_prefix_cache()
        except Exception:  # best effort: no request is admitted any more anyway
            logger.exception("Resetting the prefix cache failed")
        return WeightUpdateError("The weight update failed and the previous weights could not "
                                 "be restored: the engine is out of service (every request "
                                 "fails until it is restarted).", restored=False)

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache (level 1) and the weights (level 2) on every rank, with no request
        unfinished (refused otherwise: their K/V would be lost); the prefix cache is reset, as
        the cached blocks' contents go. See worker/sleep.py."""
        from pagellm.worker.sleep import SLEEP_LEVELS

        if not self.config.enable_sleep_mode:
            raise RuntimeError("Sleep mode is off: start the engine with enable_sleep_mode=True "
                               "(--enable-sleep-mode) to use sleep() and wake_up().")
        if level not in SLEEP_LEVELS:
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        if self.scheduler.has_unfinished_requests():
            raise RuntimeError("sleep needs an idle engine: requests are still running (let "
                               "them finish or abort them first)")
        self.drain()
        if not self.scheduler.reset_prefix_cache():
            raise RuntimeError("the prefix cache could not be reset before sleeping")
        self.publish_kv_events()
        self.executor.collective_rpc("sleep", (level,))
        self.sleep_level = max(self.sleep_level, level)

    def wake_up(self) -> None:
        """Bring back what sleep() freed (level 2: the weights from the model's checkpoint)."""
        if not self.config.enable_sleep_mode:
            raise RuntimeError("Sleep mode is off: start the engine with enable_sleep_mode=True "
                               "(--enable-sleep-mode) to use sleep() and wake_up().")
        if self.sleep_level:
            self.executor.collective_rpc("wake_up")
            self.sleep_level = 0

    def is_sleeping(self) -> bool:
        return self.sleep_level > 0

    def shutdown(self) -> None:
        self.overlap.in_flight = None  # the executor's shutdown waits for it or stops its workers
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.shutdown()
        self.structured_output.shutdown()
        self.executor.shutdown()


def _load_tokenizer(config: EngineConfig) -> Any:
    from pagellm.models.loader import load_tokenizer

    return load_tokenizer(config.model.source, config.model.tokenizer)
