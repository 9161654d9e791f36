"""Prompts -> validated engine Requests (tokenization, limits, n > 1 fan-out)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pagellm.config import EngineConfig
from pagellm.models.generation_config import extra_stop_ids
from pagellm.request import Request
from pagellm.sample.bad_words import bad_words_token_ids
from pagellm.sample.metadata import validate_token_ids
from pagellm.sampling_params import SamplingParams
from pagellm.structured_output.compiler import grammar_compiler_for

# A prompt is text, or a dict with "prompt" (text) or "prompt_token_ids", and maybe "cache_salt".
PromptType = str | Mapping[str, Any]


@dataclass(slots=True)
class ProcessedPrompt:
    prompt: str | None
    prompt_token_ids: list[int]
    cache_salt: str | None


def truncate_prompt(ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """truncate_prompt_tokens (vLLM's): the last ``keep`` tokens (-1: the last max_model_len);
    None: all of them. ValueError past max_model_len, as vLLM."""
    if keep is None:
        return ids
    if keep == -1:
        keep = max_model_len
    elif keep > max_model_len:
        raise ValueError(f"truncate_prompt_tokens ({keep}) is greater than max_model_len "
                         f"({max_model_len}); ask for a smaller truncation size.")
    return ids[-keep:]


def child_request_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{index}_{request_id}"


class InputProcessor:
    def __init__(self, config: EngineConfig, tokenizer: Any, eos_token_id: int | None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        self.max_model_len = config.model.max_model_len
        self.vocab_size = config.model.vocab_size
        # generation_config.json's EOS ids (a fake config in tests may have none)
        self.generation_config = getattr(config.model, "generation_config", None)
        # Structured outputs: each spec compiles (cached per cache namespace) when its request
        # is added, or before (the server's grammar pool), so a bad schema, regex or grammar is
        # a ValueError before anything is queued.
        self.grammar_compiler = grammar_compiler_for(config, lambda: tokenizer, eos_token_id)

    def tokenize(self, prompt: PromptType) -> ProcessedPrompt:
        if isinstance(prompt, str):
            text, ids, salt = prompt, None, None
        elif isinstance(prompt, Mapping):
            unknown = set(prompt) - {"prompt", "prompt_token_ids", "cache_salt"}
            if unknown:
                raise ValueError(f"Unknown prompt keys {sorted(unknown)}; expected 'prompt' or "
                                 "'prompt_token_ids', and optionally 'cache_salt'.")
            text, ids, salt = prompt.get("prompt"), prompt.get("prompt_token_ids"), \
                prompt.get("cache_salt")
            if salt is not None and not isinstance(salt, str):
                raise ValueError("cache_salt must be a string.")
        else:
            raise ValueError(f"A prompt must be a string or a dict, got {type(prompt).__name__}.")
        if ids is None:
            if not isinstance(text, str):
                raise ValueError("A prompt dict needs 'prompt' (a string) or 'prompt_token_ids'.")
            ids = self.tokenizer.encode(text)
        else:
            if isinstance(ids, str | bytes) or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise ValueError("prompt_token_ids must be a list of integers.")
            ids = list(ids)
        return ProcessedPrompt(text, ids, salt or None)

    def validate(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("The prompt is empty: it must have at least one token.")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"Token id {bad[0]} is out of vocabulary (size {self.vocab_size}).")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"The prompt has {len(ids)} tokens, but this model's context "
                f"(max_model_len) is {self.max_model_len} tokens and at least one must be left "
                "for the output. Shorten the prompt or raise --max-model-len.")

    def process(self, request_id: str, prompt: PromptType, params: SamplingParams,
                arrival_time: float | None = None, priority: int = 0,
                grammar_compiled: bool = False) -> tuple[ProcessedPrompt, list[Request]]:
        """Tokenize and validate one prompt; returns it and its n child Requests.
        ``grammar_compiled``: the caller compiled the spec with ``grammar_compiler`` already
        (off the event loop), so it is known to compile."""
        processed = self.tokenize(prompt)
        ids = truncate_prompt(processed.prompt_token_ids, params.truncate_prompt_tokens,
                              self.max_model_len)
        if len(ids) != len(processed.prompt_token_ids):
            # The text no longer matches the ids the request runs on.
            processed = ProcessedPrompt(None, ids, processed.cache_salt)
        self.validate(ids)
        validate_token_ids(params, self.vocab_size)
        if params.bad_words and not params.bad_words_token_ids:
            if self.tokenizer is None:
                raise ValueError("SamplingParams.bad_words needs the model's tokenizer.")
            params = params.clone()
            params._bad_words_token_ids = bad_words_token_ids(params.bad_words, self.tokenizer,
                                                              self.vocab_size)
        if params.structured_outputs is not None and not grammar_compiled:
            self.grammar_compiler.compile(params.structured_outputs, processed.cache_salt)
        # Every EOS id of generation_config.json stops, not only the tokenizer's (Llama 3.1).
        params = extra_stop_ids(params, self.generation_config, self.eos_token_id)
        room = self.max_model_len - len(ids)
        # Offline, as vLLM's LLM: generation ends at the context's end (finish "length"); the
        # server refuses a max_tokens past it with a 400 before this (limits, check_prompt).
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        children = []
        for i in range(params.n):
            seed = None if params.seed is None else params.seed + i
            # n > 1: sample 0 alone scores the prompt (the siblings' scores would be the same);
            # the others may then read the prompt's blocks from the prefix cache.
            child_params = params if params.n == 1 else params.clone(
                n=1, seed=seed, prompt_logprobs=params.prompt_logprobs if i == 0 else None)
            children.append(Request(
                request_id=child_request_id(request_id, i, params.n),
                prompt_token_ids=list(ids), sampling_params=child_params,
                eos_token_id=self.eos_token_id, arrival_time=arrival,
                cache_salt=processed.cache_salt,
                group_id=request_id if params.n > 1 else None,
                priority=priority, max_tokens=max_tokens))
        return processed, children
