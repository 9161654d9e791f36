"""The xgrammar backend: StructuredOutputsParams -> a compiled grammar, cached by spec and cache
namespace.

One ``GrammarCompiler`` per process and tokenizer. The frontend compiles each request's spec
before the request is queued (so a bad schema, regex or grammar is a ValueError first; the server
compiles on its grammar threads, never on the event loop); the engine core compiles again in its
thread pool (a cache hit when both live in one process, as in the offline ``LLM``).

The cache is keyed by the request's cache namespace (its ``cache_salt``: the server sets one per
API-key tenant) as well as the spec: a hit answers in a fraction of a compile's time, so a shared
entry would tell one tenant which schemas another one sent. It is bounded in entries and in
bytes (xgrammar's ``memory_size_bytes``: a large enum compiles to tens of MiB).
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

from pagellm.structured_output.params import JSON_KINDS, StructuredOutputsParams
from pagellm.structured_output.structural_tag import structural_tag_json

logger = logging.getLogger("pagellm")

STRUCTURED_OUTPUT_CACHE_ENTRIES = 256  # compiled grammars kept (LRU), per process
# ... and their memory (memory_size_bytes), per process: the API server and the engine
# core each keep one cache. A grammar larger than this is used but never cached.
STRUCTURED_OUTPUT_CACHE_BYTES = 256 * 2**20
# xgrammar prefixes its messages with "[hh:mm:ss] /path/file.cc:123: ".
_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")
# ... and some with the failed C++ check: "Check failed: (...) is false: ".
_XGRAMMAR_CHECK = re.compile(r"^Check failed: .*? is false:\s*")
_KIND_NAMES = {"json": "invalid JSON schema", "json_object": "invalid JSON schema",
               "regex": "invalid regex", "choice": "invalid choice",
               "grammar": "invalid EBNF grammar", "structural_tag": "invalid structural tag"}
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
    text = _XGRAMMAR_CHECK.sub("", _XGRAMMAR_PREFIX.sub("", text).strip(), count=1)
    return text.strip() or type(error).__name__


# (cache namespace, kind, canonical text, whitespace: "compact", a cap per run, or None)
CacheKey = tuple[str | None, str, str, str | int | None]


class GrammarCompiler:
    """Compiles specs for one tokenizer and logits width, caching the results (thread-safe).

    ``tokenizer_factory`` is called once, on the first compile: engines that never see a
    structured request never build xgrammar's tokenizer info. ``vocab_size`` is the width of
    the model's logits (it may exceed the tokenizer's: those ids are never allowed).
    ``stop_token_ids`` end a complete output (the EOS ids). The cache keeps at most
    ``max_entries`` grammars and ``max_bytes`` of them (least recently used out first).
    """

    def __init__(self, tokenizer_factory: Callable[[], Any], vocab_size: int,
                 stop_token_ids: list[int], max_threads: int = 1,
                 max_entries: int = STRUCTURED_OUTPUT_CACHE_ENTRIES,
                 max_bytes: int = STRUCTURED_OUTPUT_CACHE_BYTES) -> None:
        self._tokenizer_factory = tokenizer_factory
        self.vocab_size = vocab_size
        self.stop_token_ids = list(dict.fromkeys(stop_token_ids))
        self.max_threads = max_threads
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.stats = CompileStats()
        self._cache: OrderedDict[CacheKey, tuple[Any, int]] = OrderedDict()  # -> (grammar, bytes)
        self._cache_bytes = 0
        self._lock = threading.Lock()
        # Apart from _lock: cache hits do not wait while the tokenizer info is built.
        self._build_lock = threading.Lock()
        self._compiler: Any = None

    def xgrammar_compiler(self) -> Any:
        """xgrammar's compiler, built (with its tokenizer info) on first use."""
        with self._build_lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer_factory(), vocab_size=self.vocab_size,
                    stop_token_ids=self.stop_token_ids or None)
                # Our cache holds the results: xgrammar's own would keep a second copy.
                self._compiler = xgr.GrammarCompiler(info, max_threads=self.max_threads,
                                                     cache_enabled=False)
            return self._compiler

    @staticmethod
    def cache_key(spec: StructuredOutputsParams, namespace: str | None = None) -> CacheKey:
        return (namespace, *spec.cache_key())

    def compile(self, spec: StructuredOutputsParams, namespace: str | None = None) -> Any:
        """The xgrammar CompiledGrammar of ``spec``, cached for ``namespace`` (the request's
        cache_salt) alone; ValueError "structured_outputs.<kind>: invalid ...: <xgrammar's
        reason>" when it does not compile."""
        key = self.cache_key(spec, namespace)
        with self._lock:
            entry = self._cache.get(key)
            if entry is not None:
                self._cache.move_to_end(key)
                self.stats.hits += 1
                return entry[0]
        compiler = self.xgrammar_compiler()
        start = time.perf_counter()
        _, kind, text, whitespace = key
        try:
            compiled = _compile(compiler, kind, text, whitespace)
        except Exception as e:  # xgrammar raises RuntimeError (and subclasses) for bad specs
            raise ValueError(f"structured_outputs.{kind}: {_KIND_NAMES[kind]}: "
                             f"{xgrammar_reason(e)}") from None
        elapsed = time.perf_counter() - start
        size = int(compiled.memory_size_bytes)
        with self._lock:
            self.stats.misses += 1
            self.stats.compile_seconds += elapsed
            self._store(key, compiled, size)
        return compiled

    def _store(self, key: CacheKey, compiled: Any, size: int) -> None:
        if size > self.max_bytes:
            return  # it would evict everything and still not fit
        old = self._cache.pop(key, None)  # compiled twice at once: keep the newer copy
        if old is not None:
            self._cache_bytes -= old[1]
        self._cache[key] = (compiled, size)
        self._cache_bytes += size
        while len(self._cache) > self.max_entries or self._cache_bytes > self.max_bytes:
            _, (_, evicted) = self._cache.popitem(last=False)
            self._cache_bytes -= evicted

    def cache_size(self) -> int:
        with self._lock:
            return len(self._cache)

    def cache_bytes(self) -> int:
        """The memory of the cached grammars (memory_size_bytes), at most ``max_bytes``."""
        with self._lock:
            return self._cache_bytes


def _compile(compiler: Any, kind: str, text: str, whitespace: str | int | None) -> Any:
    if kind in JSON_KINDS:
        schema = text if kind == "json" else _ANY_OBJECT_SCHEMA
        if whitespace == "compact":
            return compiler.compile_json_schema(schema, any_whitespace=False)
        # A cap applies to each run of free whitespace (between tokens, after a separator).
        return compiler.compile_json_schema(schema, any_whitespace=True,
                                            max_whitespace_cnt=whitespace)
    if kind == "regex":
        return compiler.compile_regex(text)
    if kind == "choice":
        return compiler.compile_grammar(choice_grammar(json.loads(text)))
    if kind == "structural_tag":
        return compiler.compile_structural_tag(structural_tag_json(json.loads(text), whitespace))
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
