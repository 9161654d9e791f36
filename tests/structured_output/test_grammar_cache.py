"""The compiled-grammar cache (bounded in bytes and entries, keyed by cache namespace) in the
API-process compiler and the engine core's manager, and the server's compile pool (off the
event loop, bounded, deduplicated, with a timeout)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from pagellm.request import Request
from pagellm.sampling_params import SamplingParams, StructuredOutputsParams
from pagellm.structured_output.compile_pool import CompilePoolFullError, GrammarCompilePool
from pagellm.structured_output.compiler import (
    STRUCTURED_OUTPUT_CACHE_BYTES,
    STRUCTURED_OUTPUT_CACHE_ENTRIES,
    GrammarCompiler,
)
from pagellm.structured_output.manager import StructuredOutputManager

SPECS = [StructuredOutputsParams(regex=r) for r in
         ("[a-z]{1,3}", "[0-9]{2,8}@[a-z]+", "(ab|cd|ef)+x[0-9]{4,9}", "q")]


def make_compiler(tokenizer, **kwargs) -> GrammarCompiler:
    return GrammarCompiler(lambda: tokenizer, len(tokenizer), [tokenizer.eos_token_id], **kwargs)


def is_cached(compiler: GrammarCompiler, spec: StructuredOutputsParams,
              namespace: str | None = None) -> bool:
    """Compile ``spec`` again; whether that was a hit."""
    hits = compiler.stats.hits
    compiler.compile(spec, namespace)
    return compiler.stats.hits == hits + 1


def test_defaults_are_bounded() -> None:
    assert STRUCTURED_OUTPUT_CACHE_BYTES == 256 * 2**20 and STRUCTURED_OUTPUT_CACHE_ENTRIES == 256
    compiler = GrammarCompiler(lambda: None, 10, [])
    assert (compiler.max_bytes, compiler.max_entries) == (256 * 2**20, 256)


def test_byte_budget_evicts_least_recently_used(tiny_tokenizer) -> None:
    sizes = {id(s): make_compiler(tiny_tokenizer).compile(s).memory_size_bytes for s in SPECS}
    a, b, c = sorted(SPECS[:3], key=lambda s: -sizes[id(s)])  # c: the smallest
    budget = sizes[id(a)] + sizes[id(b)]  # room for a and b, not for c as well
    compiler = make_compiler(tiny_tokenizer, max_bytes=budget)
    compiler.compile(a)
    compiler.compile(b)
    assert compiler.cache_bytes() == budget and compiler.cache_size() == 2
    assert is_cached(compiler, a)  # a is now the most recently used
    compiler.compile(c)
    assert compiler.cache_bytes() <= budget
    assert compiler.cache_bytes() == sizes[id(a)] + sizes[id(c)]
    assert is_cached(compiler, a) and is_cached(compiler, c)
    assert not is_cached(compiler, b)  # evicted: compiled again (and cached, evicting others)
    assert compiler.cache_bytes() <= budget
    for spec in SPECS * 2:
        compiler.compile(spec)
        assert compiler.cache_bytes() <= budget


def test_a_grammar_larger_than_the_budget_is_not_cached(tiny_tokenizer) -> None:
    spec = SPECS[1]
    size = make_compiler(tiny_tokenizer).compile(spec).memory_size_bytes
    compiler = make_compiler(tiny_tokenizer, max_bytes=size - 1)
    compiler.compile(SPECS[3])
    small = compiler.cache_bytes()
    assert 0 < small < size
    first = compiler.compile(spec)
    assert first.memory_size_bytes == size  # still usable
    assert compiler.compile(spec) is not first  # compiled again
    assert compiler.stats.misses == 3 and compiler.cache_bytes() == small  # nothing evicted


def test_entry_limit_is_kept(tiny_tokenizer) -> None:
    compiler = make_compiler(tiny_tokenizer, max_entries=2)
    for spec in SPECS:
        compiler.compile(spec)
    assert compiler.cache_size() == 2
    assert is_cached(compiler, SPECS[3]) and not is_cached(compiler, SPECS[0])


def test_the_cache_is_keyed_by_namespace(tiny_tokenizer) -> None:
    compiler = make_compiler(tiny_tokenizer)
    spec = SPECS[0]
    a = compiler.compile(spec, "tenant-a")
    b = compiler.compile(spec, "tenant-b")
    assert a is not b and (compiler.stats.hits, compiler.stats.misses) == (0, 2)
    assert compiler.compile(StructuredOutputsParams(regex=spec.regex), "tenant-a") is a
    assert (compiler.stats.hits, compiler.stats.misses) == (1, 2)
    assert not is_cached(compiler, spec)  # no namespace is a namespace of its own
    assert compiler.cache_size() == 3


def constrained(req_id: str, spec: StructuredOutputsParams, salt: str | None) -> Request:
    return Request(req_id, [1, 2, 3], SamplingParams(max_tokens=4, structured_outputs=spec),
                   eos_token_id=0, cache_salt=salt, max_tokens=4)


def test_the_engine_core_manager_keys_by_the_requests_cache_salt(tiny_tokenizer) -> None:
    compiler = make_compiler(tiny_tokenizer)
    manager = StructuredOutputManager(compiler)
    spec = SPECS[2]
    try:
        requests = []
        for i, salt in enumerate(["tenant-a", "tenant-b", "tenant-a"]):
            requests.append(constrained(f"r{i}", spec, salt))
            manager.add_request(requests[-1])
            requests[-1].grammar.future.result(60)  # one at a time: no race to the cache
        assert (compiler.stats.misses, compiler.stats.hits) == (2, 1)
        futures = [r.grammar.future for r in requests]
        assert futures[0].result() is futures[2].result() is not futures[1].result()
    finally:
        manager.shutdown()


class GatedCompiler(GrammarCompiler):
    """A compiler whose compiles wait for ``gate`` (a slow compile, without the seconds)."""

    def __init__(self, tokenizer) -> None:
        super().__init__(lambda: tokenizer, len(tokenizer), [tokenizer.eos_token_id])
        self.gate = threading.Event()
        self.started = 0

    def compile(self, spec, namespace=None):
        self.started += 1
        assert self.gate.wait(60)
        return super().compile(spec, namespace)


def test_pool_bounds_pending_compiles_and_joins_the_same_spec(tiny_tokenizer) -> None:
    async def main() -> None:
        compiler = GatedCompiler(tiny_tokenizer)
        pool = GrammarCompilePool(compiler, threads=1)
        try:
            first = asyncio.ensure_future(pool.compile(SPECS[0], "t", max_pending=2))
            second = asyncio.ensure_future(pool.compile(SPECS[1], "t", max_pending=2))
            joined = asyncio.ensure_future(pool.compile(SPECS[0], "t", max_pending=2))
            await asyncio.sleep(0.05)
            assert pool.num_pending == 2
            with pytest.raises(CompilePoolFullError):
                await pool.compile(SPECS[2], "t", max_pending=2)
            # The same spec in another namespace is another compile: refused too.
            with pytest.raises(CompilePoolFullError):
                await pool.compile(SPECS[0], "u", max_pending=2)
            compiler.gate.set()
            await asyncio.wait_for(asyncio.gather(first, second, joined), 60)
            assert pool.num_pending == 0 and compiler.started == 2
            assert compiler.stats.misses == 2 and compiler.cache_size() == 2
            with pytest.raises(ValueError, match=r"^structured_outputs\.regex: invalid regex"):
                await pool.compile(StructuredOutputsParams(regex="(ab"))
            assert pool.num_pending == 0
        finally:
            compiler.gate.set()
            pool.shutdown()

    asyncio.run(main())


def test_pool_timeout_leaves_the_compile_running_and_cached(tiny_tokenizer) -> None:
    async def main() -> None:
        compiler = GatedCompiler(tiny_tokenizer)
        pool = GrammarCompilePool(compiler, threads=1)
        try:
            with pytest.raises(TimeoutError):
                await pool.compile(SPECS[0], "t", timeout_s=0.05)
            assert pool.num_pending == 1  # the thread cannot be stopped: it keeps its slot
            # A client that left before its compile started drops it from the queue.
            queued = asyncio.ensure_future(pool.compile(SPECS[1], "t"))
            await asyncio.sleep(0.05)
            assert pool.num_pending == 2
            queued.cancel()
            await asyncio.gather(queued, return_exceptions=True)
            assert pool.num_pending == 1
            compiler.gate.set()
            for _ in range(600):
                if not pool.num_pending:
                    break
                await asyncio.sleep(0.01)
            assert pool.num_pending == 0 and compiler.started == 1
            await pool.compile(SPECS[0], "t", timeout_s=5)  # the retry: a cache hit
            assert (compiler.stats.misses, compiler.stats.hits) == (1, 1)
        finally:
            compiler.gate.set()
            pool.shutdown()

    asyncio.run(main())
