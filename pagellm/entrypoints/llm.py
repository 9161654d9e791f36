"""The offline ``LLM`` API, with vLLM's names and shapes."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from pagellm.engine.input_processor import PromptType
from pagellm.engine.llm_engine import LLMEngine
from pagellm.engine_args import EngineArgs
from pagellm.entrypoints.openai.chat_template_args import check_template_kwargs
from pagellm.errors import RequestFailedError
from pagellm.outputs import RequestOutput
from pagellm.request import FinishReason
from pagellm.sampling_params import SamplingParams

ChatMessages = list[dict[str, Any]]


class LLM:
    """Generate completions for many prompts at once, with continuous batching.

    ``LLM(model=None)`` loads the default model (SmolLM2-135M-Instruct, GGUF). Every other engine
    option is a keyword argument: exactly ``EngineArgs``' fields, with vLLM's names
    (``max_model_len``, ``max_num_seqs``, ...) and the same defaults.
    """

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        unknown = set(engine_args) - EngineArgs.field_names()
        if unknown:
            raise TypeError(f"LLM() got unknown engine options: {sorted(unknown)}")
        self.llm_engine = LLMEngine.from_engine_args(EngineArgs(model=model, **engine_args))
        self._counter = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate``/``chat`` use when given no sampling_params: SamplingParams' own
        defaults, with the model's generation_config.json defaults over them (as vLLM; not
        with --generation-config vllm). Explicit SamplingParams get none of them."""
        generation = self.llm_engine.config.model.generation_config
        return SamplingParams() if generation is None else generation.default_sampling_params()

    def reset_prefix_cache(self) -> bool:
        return self.llm_engine.reset_prefix_cache()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Replace the model's weights in place, e.g. from a trainer between rollouts.

        ``weights``: ``(name, tensor)`` pairs named as in the transformers checkpoint (what
        ``named_parameters()`` of its model yields), all of them or some (only those change).
        They are fused, sharded over tensor-parallel ranks, re-packed for the CPU kernels and
        re-quantized (``quantization=...``) as at start-up; the prefix cache is reset. Returns
        how many tensors were loaded, once the next ``generate`` will use them. Call it between
        ``generate`` calls, never while one runs in another thread.
        """
        return self.llm_engine.load_weights(weights)

    def sleep(self, level: int = 1) -> None:
        """Free memory between rollouts (needs ``enable_sleep_mode=True``). Level 1 frees the
        KV cache; level 2 the weights too, and ``wake_up`` reloads them from the model's
        checkpoint (weights given by ``load_weights`` are lost: load them again after waking).
        The prefix cache is reset. Raises RuntimeError while requests are unfinished; generate
        raises EngineSleepingError until ``wake_up``."""
        self.llm_engine.sleep(level)

    def wake_up(self) -> None:
        """Reallocate what ``sleep`` freed; greedy outputs are then the same as before it."""
        self.llm_engine.wake_up()

    def is_sleeping(self) -> bool:
        return self.llm_engine.is_sleeping()

    def collective_rpc(self, method: str | Callable[..., Any], args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Run ``method`` on every tensor-parallel rank; the results, one per rank in rank
        order. ``method``: the name of a ModelRunner method (or the rank worker's), or a
        callable taking the ModelRunner first (picklable, e.g. module-level, when TP > 1)."""
        return self.llm_engine.collective_rpc(method, args, kwargs)

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order. Raises
        RequestFailedError (with every output in ``.outputs``) if the engine failed while
        running some of them; the others still ran to completion."""
        if isinstance(prompts, str | Mapping):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            params_list = [self.get_default_sampling_params()] * len(prompts)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"Got {len(params_list)} sampling_params for {len(prompts)} "
                                 "prompts; pass one, or one per prompt.")
        return self._run(prompts, params_list, use_tqdm)

    def chat(self, messages: ChatMessages | Sequence[ChatMessages],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None,
             add_generation_prompt: bool = True,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to each conversation, then generate.
        ``chat_template_kwargs``: extra template variables (``enable_thinking``...), JSON data
        whose keys are not the renderer's own (ValueError naming the key otherwise)."""
        template_kwargs = check_template_kwargs(chat_template_kwargs, None)
        conversations: list[ChatMessages]
        if messages and isinstance(messages[0], Mapping):
            conversations = [list(messages)]  # type: ignore[list-item]
        else:
            conversations = [list(c) for c in messages]  # type: ignore[arg-type]
        tok = self.get_tokenizer()
        prompts: list[PromptType] = []
        for conv in conversations:
            ids = tok.apply_chat_template(conv, chat_template=chat_template,
                                          add_generation_prompt=add_generation_prompt,
                                          tokenize=True, **template_kwargs)
            if isinstance(ids, Mapping):  # some transformers versions return a BatchEncoding
                ids = ids["input_ids"]
            prompts.append({"prompt_token_ids": list(ids)})
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, prompts: list[PromptType], params_list: list[SamplingParams],
             use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        ids = [str(next(self._counter)) for _ in prompts]
        added: list[str] = []
        try:
            for rid, prompt, params in zip(ids, prompts, params_list, strict=True):
                engine.add_request(rid, prompt, params)
                added.append(rid)
        except Exception:
            engine.abort_request(added)
            raise
        results: dict[str, RequestOutput] = {}
        bar = _progress(len(prompts)) if use_tqdm else None
        start = time.perf_counter()
        n_in = n_out = 0
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        if bar is not None:
                            n_in += len(out.prompt_token_ids)
                            n_out += sum(len(c.token_ids) for c in out.outputs)
                            elapsed = max(time.perf_counter() - start, 1e-9)
                            bar.set_postfix_str(f"in: {n_in / elapsed:.0f} tok/s, "
                                                f"out: {n_out / elapsed:.0f} tok/s")
                            bar.update(1)
        except BaseException:
            engine.abort_request([r for r in ids if r not in results])
            raise
        finally:
            if bar is not None:
                bar.close()
        outputs = [results[r] for r in ids]
        failed = [i for i, out in enumerate(outputs)
                  if any(c.finish_reason == FinishReason.ERROR for c in out.outputs)]
        if failed:
            raise RequestFailedError(
                f"{len(failed)} of {len(outputs)} prompts failed: the engine raised while running "
                f"them (the cause is in the log). Failed prompt indices: {failed[:20]}"
                f"{' ...' if len(failed) > 20 else ''}; e.outputs holds every output.",
                [ids[i] for i in failed], outputs)
        return outputs


def _progress(total: int) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)
