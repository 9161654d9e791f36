"""``--speculative-config``: what speculative decoding the engine runs (vLLM's keys and checks).

Given as a JSON object on the command line or a dict (or JSON string) to ``LLM(...)``::

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
     "prompt_lookup_max": 5}
    {"method": "draft_model", "model": "/path/to/small-model", "num_speculative_tokens": 4}

Pure Python (the scheduler reads it too).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagellm.config_flags import json_object_flag

FLAG = "--speculative-config"
METHODS = ("ngram", "draft_model")
# vLLM's spellings of the n-gram method ("[ngram]" from its first, model-based syntax).
_NGRAM_ALIASES = ("ngram", "[ngram]")
# Without "disable_by_batch_size", proposals stop from this many running requests (vLLM never
# stops). Measured on a 2-core Zen 4 with the default model, k=4, copy-heavy prompts
# (benchmarks/copy_workload.py): 1.86x at batch 1, 1.52x at 2, 1.23x at 4, but 0.97x at 8 and
# 0.89x at 64: verifying k more tokens per request costs full price once the linears are
# compute-bound. JSON null keeps proposing at any batch.
DEFAULT_DISABLE_BY_BATCH_SIZE = 8
# vLLM's default n-gram length when neither bound is given.
DEFAULT_PROMPT_LOOKUP = 5
_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model",
         "disable_by_batch_size")


@dataclass(frozen=True)
class SpeculativeConfig:
    """A checked speculative-decoding setup (build it with ``parse_speculative_config``).

    ``disable_by_batch_size``: no proposals while the running batch holds at least this many
    requests (None: always propose; DEFAULT_DISABLE_BY_BATCH_SIZE when the key is absent)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None  # ngram only
    prompt_lookup_max: int | None = None  # ngram only
    model: str | None = None  # draft_model only: the draft's path
    disable_by_batch_size: int | None = None

    @property
    def num_lookahead_slots(self) -> int:
        """KV slots past a request's known tokens the proposer writes while proposing: a draft
        model runs the target's newest token and drafts 1..k-1 through its own cache at the
        target's block ids (positions num_tokens - 1 .. num_tokens + k - 2 after a step that
        may have added k + 1 tokens); an n-gram lookup writes nothing."""
        return self.num_speculative_tokens if self.method == "draft_model" else 0

    def enabled_for_batch(self, num_running: int) -> bool:
        return self.disable_by_batch_size is None or num_running < self.disable_by_batch_size


def _error(key: str, message: str) -> ValueError:
    return ValueError(f"{FLAG}: {key!r} {message}")


def _int(raw: dict[str, Any], key: str, minimum: int) -> int | None:
    value = raw.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _error(key, f"must be an integer, got {value!r}.")
    if value < minimum:
        raise _error(key, f"must be >= {minimum}, got {value}.")
    return value


def _method(raw: dict[str, Any]) -> str:
    method, model = raw.get("method"), raw.get("model")
    if method is not None and not isinstance(method, str):
        raise _error("method", f"must be a string, got {method!r}.")
    if model is not None and not isinstance(model, str):
        raise _error("model", f"must be a string (the draft model's path), got {model!r}.")
    if method is None:
        if model in _NGRAM_ALIASES:  # vLLM's older {"model": "[ngram]"}
            return "ngram"
        if model is None:
            raise _error("method", f"is required: one of {', '.join(METHODS)} (or give "
                         "'model' for a draft model).")
        return "draft_model"
    if method in _NGRAM_ALIASES:
        return "ngram"
    if method not in METHODS:
        raise _error("method", f"must be one of {', '.join(METHODS)}, got {method!r} "
                     "(eagle, medusa, mtp and suffix are not supported).")
    return method


def parse_speculative_config(value: Any) -> SpeculativeConfig | None:
    """The SpeculativeConfig of a JSON string, a dict, or an already parsed config; None for
    None or an empty string. ValueError, naming the key and ``--speculative-config``, on unknown
    keys, wrong types, missing or out-of-range values."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    value = json_object_flag(value, FLAG, _KEYS,
                             '{"method": "ngram", "num_speculative_tokens": 4}')
    if value is None:
        return None
    method = _method(value)
    k = _int(value, "num_speculative_tokens", 1)
    if k is None:
        raise _error("num_speculative_tokens", "is required (an integer >= 1).")
    lookup_min = _int(value, "prompt_lookup_min", 1)
    lookup_max = _int(value, "prompt_lookup_max", 1)
    model = value.get("model")
    if method == "ngram":
        if model not in (None, *_NGRAM_ALIASES):
            raise _error("model", "is only for method 'draft_model'.")
        model = None
        # vLLM's defaults: both 5 when neither is given, else the one given for both.
        if lookup_min is None and lookup_max is None:
            lookup_min = lookup_max = DEFAULT_PROMPT_LOOKUP
        lookup_min = lookup_max if lookup_min is None else lookup_min
        lookup_max = lookup_min if lookup_max is None else lookup_max
        if lookup_min > lookup_max:
            raise _error("prompt_lookup_min", f"({lookup_min}) must be <= prompt_lookup_max "
                         f"({lookup_max}).")
    else:
        if lookup_min is not None or lookup_max is not None:
            key = "prompt_lookup_min" if lookup_min is not None else "prompt_lookup_max"
            raise _error(key, "is only for method 'ngram'.")
        if not model:
            raise _error("model", "is required for method 'draft_model' (the draft's path).")
    disable = (_int(value, "disable_by_batch_size", 2)  # vLLM: a threshold of at least 2
               if "disable_by_batch_size" in value else DEFAULT_DISABLE_BY_BATCH_SIZE)
    return SpeculativeConfig(method=method, num_speculative_tokens=k,
                             prompt_lookup_min=lookup_min, prompt_lookup_max=lookup_max,
                             model=model, disable_by_batch_size=disable)


def check_speculative_combination(spec: SpeculativeConfig | None, tensor_parallel_size: int,
                                  async_scheduling: bool) -> None:
    """Refuse the engine options speculative decoding cannot run with."""
    if spec is None:
        return
    if async_scheduling:
        # The next step is scheduled before this one's proposals (and accepted count) exist.
        raise ValueError(f"--async-scheduling and {FLAG} cannot be used together (as in "
                         "vLLM's first versions): choose one.")
    if spec.method == "draft_model" and tensor_parallel_size > 1:
        raise ValueError(f"{FLAG} method 'draft_model' runs with --tensor-parallel-size 1 only "
                         f"(got {tensor_parallel_size}); the 'ngram' method works with any size.")
