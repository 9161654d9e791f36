"""LLMEngine: the synchronous engine behind the offline ``LLM`` API.

InputProcessor (tokenize, validate, fan out n) -> EngineCore (schedule, run, sample) ->
OutputProcessor (detokenize, stop strings, RequestOutput), all in this process.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch

from pagellm.config import EngineConfig
from pagellm.engine.core import EngineCore
from pagellm.engine.input_processor import InputProcessor, PromptType
from pagellm.engine.output_processor import OutputKind, OutputProcessor
from pagellm.engine_args import EngineArgs
from pagellm.outputs import RequestOutput
from pagellm.request import RequestStatus
from pagellm.sampling_params import SamplingParams

logger = logging.getLogger("pagellm")


def load_tokenizer_and_eos(config: EngineConfig) -> tuple[Any, int | None]:
    from pagellm.models.loader import load_tokenizer

    tokenizer = load_tokenizer(config.model.source, config.model.tokenizer)
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        eos = getattr(config.model.hf_config, "eos_token_id", None)
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    return tokenizer, eos


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        if config.parallel.data_parallel_size > 1:
            raise ValueError("--data-parallel-size (data_parallel_size) is for `pagellm serve`, "
                             "which runs one engine per rank behind one API server; offline, "
                             "run one LLM per process instead.")
        self.config = config
        self.tokenizer, self.eos_token_id = load_tokenizer_and_eos(config)
        self.input_processor = InputProcessor(config, self.tokenizer, self.eos_token_id)
        # One process: the core shares the frontend's compiled-grammar cache.
        self.engine_core = EngineCore(config, self.eos_token_id,
                                      self.input_processor.grammar_compiler)
        self.output_processor = OutputProcessor(self.tokenizer)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args.create_engine_config())

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                    kind: OutputKind = OutputKind.FINAL_ONLY, arrival_time: float | None = None,
                    priority: int = 0) -> None:
        """Validate and queue one prompt (raises ValueError for bad input)."""
        if request_id in self.output_processor.requests:
            raise ValueError(f"Request id {request_id!r} is already in use.")
        processed, children = self.input_processor.process(request_id, prompt, params,
                                                           arrival_time, priority)
        self.output_processor.add_request(
            request_id, processed.prompt, processed.prompt_token_ids, params,
            [c.request_id for c in children], kind, arrival_time=children[0].arrival_time)
        try:
            for child in children:
                self.engine_core.add_request(child)
        except BaseException:
            # All or nothing: no half-admitted request stays behind.
            self.abort_request(request_id)
            raise

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else request_ids
        child_ids = [c for rid in ids for c in self.output_processor.abort_request(rid)]
        self.engine_core.abort_requests(child_ids)

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        core_outputs = self.engine_core.step()
        processed = self.output_processor.process_outputs(core_outputs)
        self.engine_core.abort_requests(processed.reqs_to_stop, RequestStatus.FINISHED_STOPPED)
        self.engine_core.abort_requests(processed.reqs_to_abort)
        return processed.request_outputs

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def collective_rpc(self, method: str | Callable[..., Any], args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        return self.engine_core.collective_rpc(method, args, kwargs)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        return self.engine_core.load_weights(weights)

    def sleep(self, level: int = 1) -> None:
        self.engine_core.sleep(level)

    def wake_up(self) -> None:
        self.engine_core.wake_up()

    def is_sleeping(self) -> bool:
        return self.engine_core.is_sleeping()

    def shutdown(self) -> None:
        self.engine_core.shutdown()
