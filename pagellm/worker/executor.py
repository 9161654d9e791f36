"""Executors run the model runner(s): in-process for one rank; one process per rank for TP
(``MultiprocExecutor``, in multiproc_executor.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from pagellm.config import EngineConfig
from pagellm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagellm.worker.rpc import run_method


class Executor(Protocol):
    def initialize_kv_cache(self) -> int: ...

    def execute_model(self, sched_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def collective_rpc(self, method: str | Callable[..., Any], args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]: ...

    def shutdown(self) -> None: ...


class UniProcExecutor:
    """One model runner in this process (tensor_parallel_size == 1)."""

    def __init__(self, config: EngineConfig, eos_token_id: int | None) -> None:
        from pagellm.engine.fault_injection import FaultInjector
        from pagellm.worker.model_runner import ModelRunner

        self.runner = ModelRunner(config, eos_token_id)
        # A test hook; None unless asked for.
        self.fault_injector = FaultInjector.from_env(config.env)
        if self.fault_injector is not None:
            self.fault_injector.install(self.runner.model)

    def initialize_kv_cache(self) -> int:
        return self.runner.initialize_kv_cache()

    def execute_model(self, sched_output: SchedulerOutput) -> ModelRunnerOutput:
        if self.fault_injector is not None:
            self.fault_injector.check_step(sched_output)
        return self.runner.execute_model(sched_output)

    def collective_rpc(self, method: str | Callable[..., Any], args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        return [run_method((self.runner,), method, args, kwargs)]

    def shutdown(self) -> None:
        pass


def make_executor(config: EngineConfig, eos_token_id: int | None) -> Executor:
    if config.parallel.tensor_parallel_size > 1:
        from pagellm.worker.multiproc_executor import MultiprocExecutor

        return MultiprocExecutor(config, eos_token_id)
    return UniProcExecutor(config, eos_token_id)
