"""StructuredOutputsParams validation, the compiler's error messages, and the scheduler's side
of a grammar (fake matchers, no model)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from pagellm.core.sched_output import ModelRunnerOutput
from pagellm.core.scheduler import Scheduler
from pagellm.request import Request
from pagellm.sampling_params import SamplingParams, StructuredOutputsParams


@pytest.mark.parametrize("kwargs, message", [
    ({}, "exactly one of json, regex, choice, grammar, json_object, structural_tag must be "
         "set \\(got none\\)"),
    ({"json": {}, "regex": "a"}, "\\(got json, regex\\)"),
    ({"json_object": False}, "got none"),
    ({"json": "{not json"}, "structured_outputs.json: not valid JSON"),
    ({"json": "[1, 2]"}, "structured_outputs.json: a JSON schema must be an object"),
    ({"json": {"default": {1, 2}}}, "structured_outputs.json: not JSON-serializable"),
    ({"json": 5}, "structured_outputs.json must be a JSON schema"),
    ({"regex": ""}, "structured_outputs.regex must be a non-empty string"),
    ({"grammar": "  "}, "structured_outputs.grammar must be a non-empty EBNF string"),
    ({"choice": []}, "structured_outputs.choice must be a non-empty list"),
    ({"choice": "ab"}, "structured_outputs.choice must be a non-empty list"),
    ({"choice": ["a", ""]}, "structured_outputs.choice must be a non-empty list"),
    ({"json_object": "yes"}, "structured_outputs.json_object must be a bool"),
    ({"regex": "a", "disable_any_whitespace": True},
     "disable_any_whitespace applies to json, json_object and structural_tag only"),
])
def test_params_reject_bad_specs(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kwargs)


def test_params_kinds_keys_and_sampling_params() -> None:
    a = StructuredOutputsParams(json={"type": "object", "properties": {"b": {}, "a": {}}})
    b = StructuredOutputsParams(json='{"type": "object",\n "properties": {"b": {}, "a": {}}}')
    assert a.kind == "json" and a.cache_key() == b.cache_key()
    # Property order is kept: it is the order the output lists them in.
    c = StructuredOutputsParams(json={"type": "object", "properties": {"a": {}, "b": {}}})
    assert c.cache_key() != a.cache_key()
    assert StructuredOutputsParams(json_object=True).kind == "json_object"
    assert StructuredOutputsParams(choice=("x", "y")).choice == ["x", "y"]
    spec = StructuredOutputsParams(regex="[0-9]+")
    assert SamplingParams(structured_outputs=spec).clone(n=2).structured_outputs is spec
    with pytest.raises(ValueError, match="SamplingParams.ignore_eos cannot be combined"):
        SamplingParams(structured_outputs=spec, ignore_eos=True)
    with pytest.raises(ValueError, match="SamplingParams.structured_outputs must be a "):
        SamplingParams(structured_outputs={"regex": "a"})  # type: ignore[arg-type]
    import pagellm

    assert pagellm.StructuredOutputsParams is StructuredOutputsParams


def test_compiler_reasons_and_cache(tiny_tokenizer) -> None:
    from pagellm.structured_output.compiler import GrammarCompiler

    compiler = GrammarCompiler(lambda: tiny_tokenizer, len(tiny_tokenizer) + 7,
                               [tiny_tokenizer.eos_token_id])
    with pytest.raises(ValueError, match=r"^structured_outputs\.regex: invalid regex: .*"
                                         r"parenthesis is not closed"):
        compiler.compile(StructuredOutputsParams(regex="(ab"))
    with pytest.raises(ValueError, match=r"^structured_outputs\.grammar: invalid EBNF grammar: "
                                         r".*Rule \"nope\" is not defined"):
        compiler.compile(StructuredOutputsParams(grammar="root ::= nope"))
    with pytest.raises(ValueError, match=r"^structured_outputs\.json: invalid JSON schema: "):
        compiler.compile(StructuredOutputsParams(json={"type": 5}))
    assert compiler.stats.misses == 0 and compiler.cache_size() == 0  # failures are not cached
    first = compiler.compile(StructuredOutputsParams(regex="[ab]+"))
    assert compiler.compile(StructuredOutputsParams(regex="[ab]+")) is first
    assert (compiler.stats.hits, compiler.stats.misses) == (1, 1)
    # The logits are wider than the tokenizer: the compiled grammar's vocabulary follows them.
    assert first.tokenizer_info.vocab_size == len(tiny_tokenizer) + 7


# ---- the scheduler with fake grammars -----------------------------------------------------
class FakeGrammar:
    """Accepts tokens from ``allowed``; terminated once it accepted ``end``."""

    def __init__(self, allowed: set[int], end: int, ready: bool = True) -> None:
        self.allowed, self.end, self.ready = allowed, end, ready
        self.accepted: list[int] = []

    def accept_token(self, token_id: int) -> bool:
        if token_id not in self.allowed or self.is_terminated():
            return False
        self.accepted.append(token_id)
        return True

    def is_terminated(self) -> bool:
        return bool(self.accepted) and self.accepted[-1] == self.end


def _scheduler() -> Scheduler:
    sched = SimpleNamespace(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128)
    cache = SimpleNamespace(block_size=4, enable_prefix_caching=False,
                            prefix_caching_hash_algo="sha256")
    return Scheduler(sched, cache, num_blocks=64)


def _request(req_id: str, grammar: FakeGrammar | None, min_tokens: int = 0) -> Request:
    params = SamplingParams(max_tokens=10, min_tokens=min_tokens, structured_outputs=(
        StructuredOutputsParams(regex="x") if grammar is not None else None))
    request = Request(req_id, [1, 2, 3], params, eos_token_id=0, max_tokens=10)
    request.grammar = grammar
    return request


def _run(sched: Scheduler, token: int):
    out = sched.schedule()
    ids = list(out.num_scheduled_tokens)
    return out, sched.update_from_output(out, ModelRunnerOutput(ids, [[token] for _ in ids]))


def test_scheduler_skips_compiling_requests_and_keeps_their_place() -> None:
    sched = _scheduler()
    compiling = FakeGrammar({5, 0}, end=0, ready=False)
    sched.add_request(_request("a", compiling))
    sched.add_request(_request("b", None))
    out, _ = _run(sched, 5)
    assert list(out.num_scheduled_tokens) == ["b"]
    assert [r.request_id for r in sched.waiting] == ["a"] and compiling.accepted == []
    compiling.ready = True
    out, _ = _run(sched, 5)
    assert set(out.num_scheduled_tokens) == {"a", "b"} and compiling.accepted == [5]


def test_scheduler_stops_on_grammar_end_and_errors_on_refused_token() -> None:
    sched = _scheduler()
    grammar = FakeGrammar({5, 0}, end=0)
    sched.add_request(_request("a", grammar, min_tokens=5))
    _run(sched, 5)
    # The grammar ended (EOS accepted) short of min_tokens: the request stops all the same.
    _, outs = _run(sched, 0)
    assert outs[0].finish_reason == "stop" and outs[0].new_token_ids == [0]
    refused = FakeGrammar({5}, end=5)
    sched.add_request(_request("b", refused))
    _, outs = _run(sched, 9)
    assert outs[0].finish_reason == "error" and outs[0].new_token_ids == []
    assert not sched.has_unfinished_requests() and sched.kv_cache_manager.usage == 0.0


def test_bitmask_holds_stop_tokens_back_under_min_tokens() -> None:
    from pagellm.structured_output.manager import _hold_back_stop_tokens

    request = _request("a", FakeGrammar(set(), 0), min_tokens=3)
    request.sampling_params.stop_token_ids = [33]
    row = np.zeros(2, dtype=np.int32)
    row.view(np.uint32)[:] = [0b101, 1 << 1]  # tokens 0 (EOS), 2 and 33 allowed
    _hold_back_stop_tokens(row, request, vocab_size=64)
    assert row.view(np.uint32).tolist() == [0b100, 0]
    only_end = np.zeros(2, dtype=np.int32)
    only_end.view(np.uint32)[:] = [0b1, 0]  # the grammar allows nothing but EOS: kept
    _hold_back_stop_tokens(only_end, request, vocab_size=64)
    assert only_end.view(np.uint32).tolist() == [1, 0]
