"""Executors run the model runner(s): in-process for one rank; one process per rank for TP
(``MultiprocExecutor``, in multiproc_executor.py)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

from pagellm.config import EngineConfig
from pagellm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagellm.worker.rpc import run_method


class StepFuture(Protocol):
    """A step submitted with ``execute_model_async``: ``result()`` waits for its output (or
    raises its error). Steps run, and their results are collected, in submission order."""

    def result(self) -> ModelRunnerOutput: ...


class Executor(Protocol):
    def initialize_kv_cache(self) -> int: ...

    def execute_model(self, sched_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def execute_model_async(self, sched_output: SchedulerOutput) -> StepFuture:
        """Start the step and return at once (async scheduling: the engine schedules the next
        step meanwhile)."""
        ...

    def collective_rpc(self, method: str | Callable[..., Any], args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]: ...

    def shutdown(self) -> None: ...


class UniProcExecutor:
    """One model runner in this process (tensor_parallel_size == 1)."""

    def __init__(self, config: EngineConfig, eos_token_id: int | None) -> None:
        from pagellm.engine.fault_injection import FaultInjector
        from pagellm.worker.model_runner import ModelRunner

        self.config = config
        self.runner = ModelRunner(config, eos_token_id)
        # A test hook; None unless asked for.
        self.fault_injector = FaultInjector.from_env(config.env)
        if self.fault_injector is not None:
            self.fault_injector.install(self.runner.model)
        # Async scheduling: steps run in one background thread, in submission order (torch
        # releases the GIL in its kernels, so the engine schedules meanwhile). Made on first
        # use; once it exists every step runs there.
        self._step_thread: ThreadPoolExecutor | None = None

    def initialize_kv_cache(self) -> int:
        return self.runner.initialize_kv_cache()

    def execute_model(self, sched_output: SchedulerOutput) -> ModelRunnerOutput:
        if self._step_thread is not None:
            return self._step_thread.submit(self._run_step, sched_output).result()
        return self._run_step(sched_output)

    def execute_model_async(self, sched_output: SchedulerOutput) -> Future[ModelRunnerOutput]:
        if self._step_thread is None:
            import torch

            self._step_thread = ThreadPoolExecutor(
                1, thread_name_prefix="pagellm-step", initializer=_init_step_thread,
                initargs=(self.config.device.device, torch.get_num_threads()))
        return self._step_thread.submit(self._run_step, sched_output)

    def _run_step(self, sched_output: SchedulerOutput) -> ModelRunnerOutput:
        if self.fault_injector is not None:
            self.fault_injector.check_step(sched_output)
        return self.runner.execute_model(sched_output)

    def collective_rpc(self, method: str | Callable[..., Any], args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        return [run_method((self.runner,), method, args, kwargs)]

    def shutdown(self) -> None:
        if self._step_thread is not None:
            self._step_thread.shutdown(wait=True, cancel_futures=True)
            self._step_thread = None


def _init_step_thread(device: Any, num_threads: int) -> None:
    """The step thread computes like the thread that built the engine: OpenMP's thread count
    is per thread, and so is CUDA's current device."""
    import torch

    torch.set_num_threads(num_threads)
    if device.type == "cuda":
        torch.cuda.set_device(device)


def make_executor(config: EngineConfig, eos_token_id: int | None) -> Executor:
    if config.parallel.tensor_parallel_size > 1:
        from pagellm.worker.multiproc_executor import MultiprocExecutor

        return MultiprocExecutor(config, eos_token_id)
    return UniProcExecutor(config, eos_token_id)
