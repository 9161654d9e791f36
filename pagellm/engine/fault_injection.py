"""A test hook: make chosen model steps raise, to test how the engine survives a worker error.

Set ``PAGELLM_FAULT_INJECT=<stage>:<token_id>`` in the environment of the process that builds the
executor (the engine core process, and the tensor-parallel workers, inherit it). A step raises
``InjectedFault`` when it schedules a request for the first time (or again after a preemption)
whose prompt contains ``token_id``; other steps run normally, so only the requests that share the
poisoned step fail. ``<stage>``:

- ``before``: raise in the executor, before the model runner sees the step;
- ``forward``: raise from the model's forward (a forward pre-hook), after the runner has already
  updated its persistent batch for the step. Such a step always has a prefill, so it runs the
  model eagerly (a replayed CUDA graph would skip the hook).

Read once, when the executor is built (``from_env(config.env)``: the value the engine config
holds). Unset (the default) costs nothing: no hook is installed. Never set it on a production
server.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagellm.config import EnvSettings, read_env

ENV_VAR = "PAGELLM_FAULT_INJECT"
_STAGES = ("before", "forward")


class InjectedFault(RuntimeError):
    """Raised on purpose by PAGELLM_FAULT_INJECT."""


@dataclass
class FaultInjector:
    stage: str
    token_id: int
    armed_message: str | None = None  # "forward": the next forward raises this

    @classmethod
    def from_env(cls, env: EnvSettings | None = None) -> FaultInjector | None:
        """The injector ``env.fault_inject`` asks for (``env``: the engine config's settings;
        None reads the environment now), or None."""
        spec = (env or read_env()).fault_inject
        if not spec:
            return None
        stage, _, token = spec.partition(":")
        if stage not in _STAGES or not token.strip().lstrip("-").isdigit():
            raise ValueError(f"{ENV_VAR}={spec!r}: expected '<stage>:<token_id>' with stage "
                             f"one of {_STAGES}.")
        return cls(stage, int(token))

    def install(self, model: Any) -> None:
        """Hook the model's forward (stage ``forward``)."""
        if self.stage == "forward":
            model.register_forward_pre_hook(self._pre_forward)

    def check_step(self, sched_output: Any) -> None:
        """Call before running ``sched_output``: raises now (``before``) or arms the hook."""
        self.armed_message = None
        hit = any(self.token_id in new.prompt_token_ids
                  for new in sched_output.scheduled_new_reqs)
        if not hit:
            return
        if self.stage == "before":
            raise InjectedFault(self._message(sched_output))
        self.armed_message = self._message(sched_output)

    def _pre_forward(self, module: Any, args: Any) -> None:
        message, self.armed_message = self.armed_message, None
        if message is not None:
            raise InjectedFault(message)

    def _message(self, sched_output: Any) -> str:
        ids = [n.req_id for n in sched_output.scheduled_new_reqs
               if self.token_id in n.prompt_token_ids]
        return (f"injected fault ({ENV_VAR}={self.stage}:{self.token_id}) in the step of "
                f"request(s) {ids}")
