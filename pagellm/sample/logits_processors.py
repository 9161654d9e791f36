"""--logits-processors: server-side plugin classes, with vLLM V1's interface.

A plugin is a class named by its fully qualified name (``package.module:Class`` or
``package.module.Class``), imported once at start-up (never from a request). The model runner
makes one instance per engine, ``Class(config, device, is_pin_memory)`` (pagellm's EngineConfig
where vLLM passes its VllmConfig), and then at every sampling step:

* ``update_state(batch_update)``: how the step's rows changed since the previous step; None
  when nothing did. Row ``i`` is row ``i`` of the logits ``apply`` gets next. ``added`` holds
  ``(index, SamplingParams, prompt token ids, output token ids)`` (the output list is the
  request's live one: it grows as tokens are sampled); an added index replaces whatever held
  it; ``removed`` lists indices no request holds any more; ``moved`` is always empty here
  (a request that changes row is added at its new index).
* ``apply(logits)``: the float32 [rows, vocab] logits, modified in place or returned anew.
  Processors that may change the argmax (``is_argmax_invariant()`` False) run before greedy
  rows pick their token; the argmax-invariant ones run after temperature, on rows that sample
  randomly only (vLLM's order).

Per-request arguments are in ``SamplingParams.extra_args`` (a request's ``vllm_xargs``).
See docs/serving.md and examples/logits_processor_force_token.py.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

from pagellm.sampling_params import SamplingParams

FLAG = "--logits-processors"
_METHODS = ("apply", "is_argmax_invariant", "update_state")


class MoveDirectionality(Enum):
    UNIDIRECTIONAL = 0  # a -> b, a left empty
    SWAP = 1  # a <-> b


AddedRequest = tuple[int, SamplingParams, list[int], list[int]]


@dataclass(frozen=True)
class BatchUpdate:
    batch_size: int  # rows of the next apply's logits
    removed: Sequence[int] = ()
    added: Sequence[AddedRequest] = ()
    moved: Sequence[tuple[int, int, MoveDirectionality]] = field(default=())


class LogitsProcessor(ABC):
    """The interface (subclassing it is optional: the three methods are what is called)."""

    @abstractmethod
    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        ...

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        ...

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        ...

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        ...


def load_logits_processor_class(name: str) -> type:
    """The class ``name`` names; ValueError naming the flag when it cannot be imported or
    lacks the interface's methods."""
    module_name, sep, attr = name.partition(":")
    if not sep:
        module_name, _, attr = name.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{FLAG}: {name!r} is not a fully qualified class name "
                         "(package.module:Class or package.module.Class).")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{FLAG}: cannot load {name!r}: {e}") from None
    missing = [m for m in _METHODS if not callable(getattr(cls, m, None))]
    if not isinstance(cls, type) or missing:
        raise ValueError(f"{FLAG}: {name!r} is not a logits processor class (it needs "
                         f"{', '.join(_METHODS)}; missing {', '.join(missing) or 'a class'}).")
    return cls


def check_logits_processors(names: Sequence[str]) -> tuple[str, ...]:
    """The flag's names, each checked to load (at start-up, before any engine starts)."""
    for name in names:
        load_logits_processor_class(name)
    return tuple(names)


@dataclass(frozen=True)
class StepRow:
    """One sampling row of a step, as the runner knows it."""

    req_id: str
    params: SamplingParams
    prompt_token_ids: Any  # a callable returning the list: built only for added rows
    output_token_ids: list[int]


class LogitsProcessors:
    """The loaded processors of one model runner, and the row bookkeeping of BatchUpdate."""

    def __init__(self, names: Sequence[str], config: Any, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.processors = [load_logits_processor_class(n)(config, device, pin) for n in names]
        self.invariant = tuple(p for p in self.processors if p.is_argmax_invariant())
        self.variant = tuple(p for p in self.processors if not p.is_argmax_invariant())
        self._rows: list[str] = []  # the previous step's request id per row

    def step(self, rows: Sequence[StepRow]) -> tuple[tuple, tuple]:
        """Tell every processor how the rows changed; (argmax-changing, argmax-invariant)
        processors to apply to this step's logits."""
        added: list[AddedRequest] = []
        for i, row in enumerate(rows):
            if i >= len(self._rows) or self._rows[i] != row.req_id:
                added.append((i, row.params, row.prompt_token_ids(), row.output_token_ids))
        removed = list(range(len(rows), len(self._rows)))
        self._rows = [r.req_id for r in rows]
        update = BatchUpdate(len(rows), removed, added) if added or removed else None
        for p in self.processors:
            p.update_state(update)
        return self.variant, self.invariant
