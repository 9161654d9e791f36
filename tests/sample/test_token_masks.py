"""bad_words, allowed_token_ids and --logits-processors in the sampler, against plain torch
references of the masks (and the BatchUpdate bookkeeping against the rows it describes)."""

from __future__ import annotations

import pytest
import torch

from pagellm.engine.input_processor import truncate_prompt
from pagellm.entrypoints.openai.chat_template_args import (
    TemplateArgsError,
    check_documents,
    check_template_kwargs,
)
from pagellm.sample.bad_words import bad_words_token_ids, banned_next_tokens
from pagellm.sample.logits_processors import LogitsProcessors, StepRow
from pagellm.sample.metadata import SamplingMetadata, validate_token_ids
from pagellm.sample.sampler import Sampler
from pagellm.sampling_params import SamplingParams

V = 50


def _reference_banned(seqs: list[list[int]], output: list[int]) -> set[int]:
    # Brute force: a token is banned when appending it makes output end with a banned sequence.
    return {t for t in range(V) for s in seqs
            if len(output) + 1 >= len(s) and (output + [t])[-len(s):] == s}


@pytest.mark.parametrize("output", [[], [3], [1, 2], [7, 1, 2], [1, 2, 9], [5, 5, 5]])
def test_banned_next_tokens_match_brute_force(output):
    seqs = [[4], [1, 2, 3], [2, 6], [5, 5, 8], [9, 9, 9, 9]]
    assert banned_next_tokens(seqs, output) == _reference_banned(seqs, output)


def _meta(params, outputs, device="cpu"):
    return SamplingMetadata.build(params, [[0]] * len(params), outputs, [None] * len(params),
                                  [None] * len(params), V, device)


def test_sampler_masks_equal_torch_reference():
    torch.manual_seed(0)
    logits = torch.randn(4, V)
    allowed = [3, 17, 40]
    p_allowed = SamplingParams(temperature=0.0, allowed_token_ids=allowed)
    p_bad = SamplingParams(temperature=0.0, bad_words=["x"])
    p_bad._bad_words_token_ids = [[int(logits[1].argmax())], [8, 9]]
    p_plain = SamplingParams(temperature=0.0)
    p_both = SamplingParams(temperature=0.0, allowed_token_ids=[1, 9, 30])
    p_both._bad_words_token_ids = [[8, 9]]
    params = [p_allowed, p_bad, p_plain, p_both]
    outputs = [[], [2, 8], [], [8]]
    out = Sampler()(logits.clone(), _meta(params, outputs))

    ref = logits.clone()
    keep = torch.full((V,), float("-inf"))
    keep[allowed] = 0.0
    ref[0] += keep
    ref[1, int(logits[1].argmax())] = float("-inf")
    ref[1, 9] = float("-inf")  # [8, 9]: the output ends with 8
    keep3 = torch.full((V,), float("-inf"))
    keep3[[1, 9, 30]] = 0.0
    ref[3] += keep3
    ref[3, 9] = float("-inf")
    assert out.sampled_token_ids.tolist() == ref.argmax(dim=-1).tolist()
    assert int(out.sampled_token_ids[0]) in allowed


def test_random_rows_sample_only_allowed_ids():
    logits = torch.zeros(2, V)
    params = [SamplingParams(temperature=1.0, seed=1, allowed_token_ids=[5, 6]),
              SamplingParams(temperature=1.0, seed=2)]
    seen = set()
    for _ in range(30):
        meta = _meta(params, [[], []])
        meta.generators = {}
        seen.add(int(Sampler()(logits.clone(), meta).sampled_token_ids[0]))
    assert seen <= {5, 6} and seen


def test_unused_features_build_nothing():
    meta = _meta([SamplingParams(temperature=0.0)], [[1, 2]])
    assert meta.allowed_tokens_mask is None and meta.bad_words_mask is None


def test_bad_words_token_ids_and_validation(tiny_tokenizer):
    seqs = bad_words_token_ids(["hello"], tiny_tokenizer, len(tiny_tokenizer))
    plain = tiny_tokenizer.encode("hello", add_special_tokens=False)
    spaced = tiny_tokenizer.encode(" hello", add_special_tokens=False)
    assert seqs[0] == plain
    assert (spaced in seqs) == (spaced[0] != plain[0] and len(spaced) == len(plain))
    with pytest.raises(ValueError, match="bad_words"):
        bad_words_token_ids(["hello"], tiny_tokenizer, 3)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        validate_token_ids(SamplingParams(allowed_token_ids=[V]), V)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=0)


def test_clone_keeps_bad_word_ids():
    p = SamplingParams(bad_words=["a"])
    p._bad_words_token_ids = [[1, 2]]
    assert p.clone(n=1).bad_words_token_ids == [[1, 2]]
    assert p.clone(bad_words=["b"]).bad_words_token_ids == []


def test_truncate_prompt():
    ids = list(range(10))
    assert truncate_prompt(ids, 3, 100) == [7, 8, 9]
    assert truncate_prompt(ids, -1, 4) == [6, 7, 8, 9]
    assert truncate_prompt(ids, None, 4) == ids
    with pytest.raises(ValueError, match="max_model_len"):
        truncate_prompt(ids, 5, 4)


class _Recorder:
    """Keeps, per row, the request's extra_args["tag"] as update_state says."""

    instances: list[_Recorder] = []

    def __init__(self, config, device, is_pin_memory):
        self.rows: dict[int, str] = {}
        _Recorder.instances.append(self)

    def is_argmax_invariant(self):
        return False

    def update_state(self, update):
        if update is None:
            return
        for index, params, _, _ in update.added:
            self.rows[index] = params.extra_args["tag"]
        for index in update.removed:
            self.rows.pop(index)

    def apply(self, logits):
        return logits


def test_batch_update_tracks_the_rows():
    procs = LogitsProcessors([f"{__name__}:_Recorder"], None, torch.device("cpu"))
    rec = _Recorder.instances[-1]

    def rows(*tags):
        return [StepRow(t, SamplingParams(extra_args={"tag": t}), lambda: [0], []) for t in tags]

    for step in [("a", "b", "c"), ("a", "c"), ("c", "a", "d"), ("d",), ("d", "e", "f", "a")]:
        procs.step(rows(*step))
        assert rec.rows == dict(enumerate(step))


def test_template_args_checks():
    assert check_template_kwargs({"enable_thinking": False}, 100) == {"enable_thinking": False}
    for bad, key in [({"messages": []}, "messages"), ({"add_generation_prompt": 1}, "add_")]:
        with pytest.raises(TemplateArgsError, match=key):
            check_template_kwargs(bad, 100)
    with pytest.raises(TemplateArgsError, match="JSON data"):
        check_template_kwargs({"x": object()}, None)
    with pytest.raises(TemplateArgsError, match="--max-chat-template-kwargs-bytes"):
        check_template_kwargs({"x": "y" * 200}, 100)
    with pytest.raises(TemplateArgsError, match="--max-documents"):
        check_documents([{"t": 1}] * 3, 2)
    assert check_documents([], 2) is None
