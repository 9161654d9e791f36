"""Async scheduling (``--async-scheduling``): one model step stays in flight while the engine
schedules the next and processes the previous one's tokens.

Each ``EngineCore.step`` schedules and submits step N+1, then waits for step N (the previous
call's submission) and returns its outputs, so scheduling and output processing leave the
critical path of a device that computes on its own.

NOTE: blocks freed while a step is in flight (a request finished by step N's tokens, an abort, a
preemption, a sliding window moving on) may still be written by that step, and are handed out
again only by a later schedule(). The runner runs steps strictly in submission order, so the new
owner's step starts after the old owner's last write: zeroing of new blocks happens at the start
of its step, after those writes, and a prefix hit on a block hashed for step N (cached at
allocation) is read by a step after N. If step N fails, the step after it (which may have read
N's K/V or taken N's sampled tokens as input) fails with it; see ``OverlappedSteps._fail``.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from pagellm.core.sched_output import EngineCoreOutput, SchedulerOutput
from pagellm.errors import WorkerFailedError

if TYPE_CHECKING:
    from pagellm.core.scheduler import Scheduler
    from pagellm.worker.executor import Executor, StepFuture


class StepHost(Protocol):
    """What the overlapped steps need of their engine (EngineCore provides it): its scheduler
    and executor, the step counters, and how a failed step's requests are finished."""

    scheduler: Scheduler
    executor: Executor
    num_consecutive_step_failures: int

    def num_prefill_tokens(self, so: SchedulerOutput) -> int: ...

    def count(self, num_prefill: int, outputs: list[EngineCoreOutput]) -> None: ...

    def fail_step(self, sched_output: SchedulerOutput, error: Exception,
                  later: SchedulerOutput | None = None) -> list[EngineCoreOutput]: ...


@dataclass(slots=True)
class InFlightStep:
    """A step submitted but not yet processed."""

    sched_output: SchedulerOutput
    num_prefill_tokens: int  # counted at schedule time (EngineCore.num_prefill_tokens)
    future: StepFuture


class OverlappedSteps:
    """One engine's step in flight, and outputs of a step processed between steps (``drain``),
    which the next ``EngineCore.step`` sends."""

    def __init__(self, core: StepHost) -> None:
        self.core = core
        self.in_flight: InFlightStep | None = None
        self._drained: list[EngineCoreOutput] = []

    @property
    def pending(self) -> bool:
        """A step in flight, or drained outputs not sent yet."""
        return self.in_flight is not None or bool(self._drained)

    def take_drained(self) -> list[EngineCoreOutput]:
        out, self._drained = self._drained, []
        return out

    def step(self) -> list[EngineCoreOutput]:
        """Schedule and submit step N+1, then process step N's tokens while N+1 runs; returns
        N's outputs (none on the first call)."""
        core = self.core
        sched_output = core.scheduler.schedule()
        if sched_output.total_num_scheduled_tokens == 0 and self.in_flight is not None:
            # Nothing to run until the tokens in flight come back: no empty step; the ids it
            # tells the runner to drop go with the next one.
            core.scheduler.defer_to_next_step(sched_output)
            return self.collect_in_flight()
        num_prefill = core.num_prefill_tokens(sched_output)
        try:
            future = core.executor.execute_model_async(sched_output)
        except WorkerFailedError:
            raise
        except Exception as e:  # collected, and failed, like a step that raised
            future = Future()
            future.set_exception(e)
        previous, self.in_flight = self.in_flight, InFlightStep(sched_output, num_prefill,
                                                                future)
        return self._collect(previous) if previous is not None else []

    def collect_in_flight(self) -> list[EngineCoreOutput]:
        step, self.in_flight = self.in_flight, None
        return self._collect(step) if step is not None else []

    def drain(self) -> None:
        """Process the step in flight before anything else uses the runner or the block pool
        wholesale; its outputs go out with the next step."""
        self._drained += self.collect_in_flight()

    def _collect(self, step: InFlightStep) -> list[EngineCoreOutput]:
        """Wait for a submitted step and process its tokens."""
        core = self.core
        try:
            runner_output = step.future.result()
        except WorkerFailedError:
            raise
        except Exception as e:
            return self._fail(step, e)
        core.num_consecutive_step_failures = 0
        outputs = core.scheduler.update_from_output(step.sched_output, runner_output)
        core.count(step.num_prefill_tokens, outputs)
        return outputs

    def _fail(self, step: InFlightStep, error: Exception) -> list[EngineCoreOutput]:
        """A submitted step raised: wait for the one submitted after it (if any) and fail
        both steps' requests (the later one ran on the failed step's K/V and tokens)."""
        later, self.in_flight = self.in_flight, None
        if later is not None:
            try:
                later.future.result()
            except WorkerFailedError:
                raise
            except Exception:
                pass  # its requests fail below in any case
        return self.core.fail_step(step.sched_output, error,
                                   later.sched_output if later is not None else None)
