"""pagellm: a Python LLM inference and serving engine (paged KV cache, continuous batching)."""

from pagellm.config import EngineArgs
from pagellm.entrypoints.llm import LLM
from pagellm.outputs import CompletionOutput, RequestOutput
from pagellm.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "EngineArgs"]
__version__ = "0.1.0"
