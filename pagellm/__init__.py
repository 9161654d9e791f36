"""pagellm: a Python LLM inference and serving engine (paged KV cache, continuous batching).

The top-level names load on first use (PEP 562), so importing a torch-free part of the package
(``pagellm.core.scheduler``, ``pagellm.sampling_params``) does not import the engine or torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagellm.engine_args import EngineArgs
    from pagellm.entrypoints.llm import LLM
    from pagellm.outputs import CompletionOutput, RequestOutput
    from pagellm.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput",
           "CompletionOutput", "EngineArgs"]
__version__ = "0.1.0"

_LAZY_MODULES = {
    "LLM": "pagellm.entrypoints.llm",
    "SamplingParams": "pagellm.sampling_params",
    "StructuredOutputsParams": "pagellm.sampling_params",
    "RequestOutput": "pagellm.outputs",
    "CompletionOutput": "pagellm.outputs",
    "EngineArgs": "pagellm.engine_args",
}


def __getattr__(name: str) -> Any:
    module = _LAZY_MODULES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
