"""Sampling parameters, with vLLM's field names and defaults."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from pagellm.structured_output.params import StructuredOutputsParams

__all__ = ["SamplingParams", "StructuredOutputsParams"]

_MAX_LOGPROBS = 20
# torch.Generator.manual_seed takes a signed or unsigned 64-bit value; keep seeds signed 64-bit.
_SEED_MIN, _SEED_MAX = -(2**63), 2**63 - 1
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty")


@dataclass
class SamplingParams:
    """How to sample one request's completion(s).

    temperature 0 means greedy. Every field is validated in ``__post_init__``; an invalid value
    raises ``ValueError`` naming the field.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    # Logprobs of each prompt token after the first, plus this many top tokens (vLLM's).
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    # False: outputs carry token ids only (text "", no decoding work), for RL rollouts.
    detokenize: bool = True
    # Constrain the output (JSON schema, regex, choice, EBNF grammar, JSON object); see
    # pagellm/structured_output/ and docs/structured_output.md.
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's: words never generated (each word's token sequences, with and without a leading
    # space, are banned; sample/bad_words.py), and the only token ids that may be sampled.
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    # vLLM's: keep only the last k prompt tokens (-1: the last max_model_len); None: all.
    truncate_prompt_tokens: int | None = None
    # Arguments for --logits-processors plugins (a request's vllm_xargs), JSON values.
    extra_args: dict[str, Any] | None = None
    # Filled by the engine: every stop string as a list, and the eos-equivalent token ids.
    _stop_strs: list[str] = field(default_factory=list, repr=False, init=False)
    # Filled by the engine (InputProcessor) from bad_words with the tokenizer.
    _bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False, init=False)

    def __post_init__(self) -> None:
        if self.stop is None:
            self._stop_strs = []
        elif isinstance(self.stop, str):
            self._stop_strs = [self.stop]
        else:
            self._stop_strs = list(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        else:
            self.stop_token_ids = list(self.stop_token_ids)
        self._validate()

    @property
    def stop_strs(self) -> list[str]:
        return self._stop_strs

    @property
    def bad_words_token_ids(self) -> list[list[int]]:
        return self._bad_words_token_ids

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def _validate(self) -> None:
        def bad(name: str, why: str) -> None:
            raise ValueError(f"SamplingParams.{name} {why}, got {getattr(self, name)!r}.")

        if not isinstance(self.n, int) or self.n < 1:
            bad("n", "must be an integer >= 1")
        for name in _FLOAT_FIELDS:  # NaN passes every comparison below, so refuse it first
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value):
                bad(name, "must be a finite number")
        if self.temperature < 0.0:
            bad("temperature", "must be >= 0 (0 means greedy)")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad("top_k", "must be an integer; 0 or -1 disables it")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "must be in [0, 1]")
        if self.seed is not None and (not isinstance(self.seed, int)
                                      or not _SEED_MIN <= self.seed <= _SEED_MAX):
            bad("seed", "must be a 64-bit signed integer or None")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int)
                                            or self.max_tokens < 1):
            bad("max_tokens", "must be an integer >= 1 (or None for the rest of the context)")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", "must be in [-2, 2]")
        if not 0.0 < self.repetition_penalty <= 2.0:
            bad("repetition_penalty", "must be in (0, 2]")
        if self.logprobs is not None and not 0 <= self.logprobs <= _MAX_LOGPROBS:
            bad("logprobs", f"must be in [0, {_MAX_LOGPROBS}]")
        if self.prompt_logprobs is not None and (
                not isinstance(self.prompt_logprobs, int)
                or not 0 <= self.prompt_logprobs <= _MAX_LOGPROBS):
            bad("prompt_logprobs", f"must be in [0, {_MAX_LOGPROBS}]")
        if any(not isinstance(s, str) or s == "" for s in self._stop_strs):
            bad("stop", "must be non-empty strings")
        if not isinstance(self.detokenize, bool):
            bad("detokenize", "must be a bool")
        if not self.detokenize and self._stop_strs:
            bad("stop", "needs detokenize=True (stop strings are matched on the text); use "
                "stop_token_ids with detokenize=False")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids or []):
            bad("stop_token_ids", "must be non-negative integers")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                bad("structured_outputs", "must be a StructuredOutputsParams")
            if self.ignore_eos:
                bad("ignore_eos", "cannot be combined with structured_outputs (the grammar "
                    "decides where the output ends)")
        if self.logit_bias is not None:
            for tok, b in self.logit_bias.items():
                if not isinstance(tok, int) or tok < 0:
                    bad("logit_bias", "keys must be non-negative token ids")
                if not isinstance(b, int | float) or not -100.0 <= float(b) <= 100.0:
                    bad("logit_bias", "values must be in [-100, 100]")
        self._validate_lists(bad)

    def _validate_lists(self, bad: Any) -> None:
        if self.bad_words is not None and (
                not isinstance(self.bad_words, list)
                or any(not isinstance(w, str) or not w.strip() for w in self.bad_words)):
            bad("bad_words", "must be a list of non-empty strings")
        ids = self.allowed_token_ids
        if ids is not None and (not isinstance(ids, list) or not ids or any(
                not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in ids)):
            bad("allowed_token_ids", "must be a non-empty list of non-negative token ids")
        k = self.truncate_prompt_tokens
        if k is not None and (not isinstance(k, int) or isinstance(k, bool)
                              or not (k == -1 or k >= 1)):
            bad("truncate_prompt_tokens", "must be an integer >= 1, or -1 (max_model_len)")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            bad("extra_args", "must be a dict")

    def clone(self, **changes: object) -> SamplingParams:
        """A copy with some fields changed (validated again); the engine-filled bad-word ids
        stay unless bad_words changes."""
        copy = replace(self, **changes)  # type: ignore[arg-type]
        if "bad_words" not in changes:
            copy._bad_words_token_ids = self._bad_words_token_ids
        return copy
