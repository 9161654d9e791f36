"""``pagellm bench throughput --structured-output json``: the cost of structured outputs.

The same offline workload runs twice on one engine, unconstrained and with every request under a
typical JSON schema, and the output-token throughput ratio is reported; plus the compile time of
that schema, cold (a fresh cache) and cached, and of xgrammar's tokenizer info (once per engine).
Constrained requests end where their JSON ends (no ignore_eos), so both runs' tokens/s are
reported, not only their times.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

# A typical API-style schema: nested object, array, enum, number, required fields.
TYPICAL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "name": {"type": "string"},
        "status": {"enum": ["active", "inactive", "pending"]},
        "score": {"type": "number"},
        "address": {"type": "object",
                    "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["street", "city", "zip"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
    },
    "required": ["id", "name", "status", "score", "address", "tags"],
}


def run_requests(engine: Any, reqs: list[Any], make_params: Callable[[Any], Any],
                 prefix: str) -> tuple[float, int]:
    """Add every request, step until all finish: (elapsed seconds, output tokens)."""
    start = time.perf_counter()
    for i, r in enumerate(reqs):
        engine.add_request(f"{prefix}{i}", {"prompt_token_ids": r.prompt_token_ids},
                           make_params(r))
    num_out = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                num_out += sum(len(c.token_ids) for c in out.outputs)
    return time.perf_counter() - start, num_out


def compile_times(engine: Any) -> dict[str, float]:
    """Milliseconds: xgrammar tokenizer info, TYPICAL_SCHEMA cold, then cached (fresh cache)."""
    from pagellm.sampling_params import StructuredOutputsParams
    from pagellm.structured_output.compiler import grammar_compiler_for

    compiler = grammar_compiler_for(engine.config, lambda: engine.tokenizer,
                                    engine.eos_token_id)
    spec = StructuredOutputsParams(json=TYPICAL_SCHEMA)
    t0 = time.perf_counter()
    compiler.xgrammar_compiler()  # tokenizer info: once per engine, on its first request
    t1 = time.perf_counter()
    compiler.compile(spec)
    t2 = time.perf_counter()
    compiler.compile(StructuredOutputsParams(json=TYPICAL_SCHEMA))
    t3 = time.perf_counter()
    return {"tokenizer_info_ms": round((t1 - t0) * 1e3, 2),
            "compile_cold_ms": round((t2 - t1) * 1e3, 2),
            "compile_cached_ms": round((t3 - t2) * 1e3, 3)}


def benchmark_structured(engine: Any, reqs: list[Any], free_elapsed: float,
                         free_out: int) -> dict[str, Any]:
    """Run ``reqs`` again under TYPICAL_SCHEMA and compare with the free run's figures."""
    from pagellm.sampling_params import SamplingParams, StructuredOutputsParams

    times = compile_times(engine)
    spec = StructuredOutputsParams(json=TYPICAL_SCHEMA)
    elapsed, num_out = run_requests(
        engine, reqs,
        lambda r: SamplingParams(temperature=0.0, max_tokens=r.max_tokens,
                                 structured_outputs=spec), "json-")
    free_rate = free_out / free_elapsed
    json_rate = num_out / elapsed
    return {"json_elapsed_s": round(elapsed, 3), "json_output_tokens": num_out,
            "json_output_tokens_per_s": round(json_rate, 1),
            "free_output_tokens_per_s": round(free_rate, 1),
            "json_vs_free_throughput": round(json_rate / free_rate, 3), **times}


def format_structured(r: dict[str, Any]) -> str:
    return (f"Structured (JSON schema): {r['json_output_tokens_per_s']:.1f} output tokens/s vs "
            f"{r['free_output_tokens_per_s']:.1f} unconstrained: ratio "
            f"{r['json_vs_free_throughput']:.3f} ({r['json_output_tokens']} tokens in "
            f"{r['json_elapsed_s']:.1f} s); schema compile {r['compile_cold_ms']:.1f} ms cold, "
            f"{r['compile_cached_ms']:.3f} ms cached; tokenizer info "
            f"{r['tokenizer_info_ms']:.0f} ms once per engine")
