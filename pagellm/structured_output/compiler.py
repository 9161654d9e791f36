"""The xgrammar backend: StructuredOutputsParams -> a compiled grammar, cached by spec.

One ``GrammarCompiler`` per process and tokenizer. The frontend compiles each request's spec when
the request is added (so a bad schema, regex or grammar is a ValueError before anything is
queued); the engine core compiles again in its thread pool (a cache hit when both live in one
process, as in the offline ``LLM``).
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pagellm.structured_output.params import StructuredOutputsParams

logger = logging.getLogger("pagellm")

STRUCTURED_OUTPUT_CACHE_ENTRIES = 256  # compiled grammars kept (LRU), per process
# xgrammar prefixes its messages with "[hh:mm:ss] /path/file.cc:123: ".
_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")
_KIND_NAMES = {"json": "invalid JSON schema", "json_object": "invalid JSON schema",
               "regex": "invalid regex", "choice": "invalid choice",
               "grammar": "invalid EBNF grammar"}
_ANY_OBJECT_SCHEMA = '{"type": "object"}'


@dataclass(slots=True)
class CompileStats:
    hits: int = 0
    misses: int = 0
    compile_seconds: float = 0.0  # total time spent compiling (misses)


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly ``choices`` (JSON string escapes, which
    xgrammar's string literals read the same way)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def xgrammar_reason(error: BaseException) -> str:
    """xgrammar's message without its timestamp and source-file prefix."""
    text = str(error).strip()
    return _XGRAMMAR_PREFIX.sub("", text).strip() or type(error).__name__


class GrammarCompiler:
    """Compiles specs for one tokenizer and logits width, caching the results (thread-safe).

    ``tokenizer_factory`` is called once, on the first compile: engines that never see a
    structured request never build xgrammar's tokenizer info. ``vocab_size`` is the width of
    the model's logits (it may exceed the tokenizer's: those ids are never allowed).
    ``stop_token_ids`` end a complete output (the EOS ids).
    """

    def __init__(self, tokenizer_factory: Callable[[], Any], vocab_size: int,
                 stop_token_ids: list[int], max_threads: int = 1,
                 max_entries: int = STRUCTURED_OUTPUT_CACHE_ENTRIES) -> None:
        self._tokenizer_factory = tokenizer_factory
        self.vocab_size = vocab_size
        self.stop_token_ids = list(dict.fromkeys(stop_token_ids))
        self.max_threads = max_threads
        self.max_entries = max_entries
        self.stats = CompileStats()
        self._cache: OrderedDict[tuple[str, str, bool], Any] = OrderedDict()
        self._lock = threading.Lock()
        self._compiler: Any = None

    def xgrammar_compiler(self) -> Any:
        """xgrammar's compiler, built (with its tokenizer info) on first use."""
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer_factory(), vocab_size=self.vocab_size,
                    stop_token_ids=self.stop_token_ids or None)
                # Our cache holds the results: xgrammar's own would keep a second copy.
                self._compiler = xgr.GrammarCompiler(info, max_threads=self.max_threads,
                                                     cache_enabled=False)
            return self._compiler

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """The xgrammar CompiledGrammar of ``spec``; ValueError "structured_outputs.<kind>:
        invalid ...: <xgrammar's reason>" when it does not compile."""
        key = spec.cache_key()
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                self.stats.hits += 1
                return compiled
        compiler = self.xgrammar_compiler()
        start = time.perf_counter()
        kind, text, compact = key
        try:
            compiled = _compile(compiler, kind, text, compact)
        except Exception as e:  # xgrammar raises RuntimeError (and subclasses) for bad specs
            raise ValueError(f"structured_outputs.{kind}: {_KIND_NAMES[kind]}: "
                             f"{xgrammar_reason(e)}") from None
        elapsed = time.perf_counter() - start
        with self._lock:
            self.stats.misses += 1
            self.stats.compile_seconds += elapsed
            self._cache[key] = compiled
            while len(self._cache) > self.max_entries:
                self._cache.popitem(last=False)
        return compiled

    def cache_size(self) -> int:
        with self._lock:
            return len(self._cache)


def _compile(compiler: Any, kind: str, text: str, compact: bool) -> Any:
    if kind == "json":
        return compiler.compile_json_schema(text, any_whitespace=not compact)
    if kind == "json_object":
        return compiler.compile_json_schema(_ANY_OBJECT_SCHEMA, any_whitespace=not compact)
    if kind == "regex":
        return compiler.compile_regex(text)
    if kind == "choice":
        return compiler.compile_grammar(choice_grammar(json.loads(text)))
    assert kind == "grammar", kind
    return compiler.compile_grammar(text)


def grammar_compiler_for(config: Any, tokenizer_factory: Callable[[], Any],
                         eos_token_id: int | None) -> GrammarCompiler:
    """The compiler of an engine: the model's logits width, and its EOS ids (the tokenizer's
    and generation_config.json's) as the tokens that end a complete output."""
    from pagellm.config import STRUCTURED_OUTPUTS_BACKENDS

    backend = getattr(config, "structured_outputs_backend", "auto")
    assert backend in STRUCTURED_OUTPUTS_BACKENDS, backend  # "auto" and "xgrammar": xgrammar
    generation = getattr(config.model, "generation_config", None)
    stops = [] if eos_token_id is None else [eos_token_id]
    stops += list(getattr(generation, "eos_token_ids", ()) or ())
    return GrammarCompiler(tokenizer_factory, config.model.vocab_size, stops)
