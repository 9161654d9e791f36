"""Penalty and logit-bias state kept in the persistent batch: equal, tensor for tensor, to
rebuilding it from the token lists each step, and updated incrementally, so a step's work does
not grow with the prompt (or output) of a penalized request."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from pagellm.sample.metadata import _logit_bias
from pagellm.sample.penalties import PenaltyTensors
from pagellm.sample.sampler import Sampler
from pagellm.sampling_params import SamplingParams
from pagellm.worker.input_batch import InputBatch
from pagellm.worker.model_runner import ModelRunner

VOCAB = 97
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def random_params(rng: random.Random) -> SamplingParams:
    kind = rng.randrange(5)
    return SamplingParams(
        temperature=rng.choice([0.0, 0.8]), max_tokens=64,
        presence_penalty=rng.choice([0.0, 0.5]) if kind in (1, 4) else 0.0,
        frequency_penalty=rng.choice([0.0, -0.3]) if kind in (2, 4) else 0.0,
        repetition_penalty=rng.choice([1.0, 1.3]) if kind in (3, 4) else 1.0,
        logit_bias={rng.randrange(VOCAB + 5): rng.uniform(-100, 100)
                    for _ in range(rng.randrange(4))} or None)


@pytest.mark.parametrize("device", DEVICES)
def test_equal_to_rebuilding_from_lists(device):
    """Random adds (with earlier output, as after a preemption), appends and removals; every
    step the persistent tensors equal the old per-step build, and so do the sampled logits."""
    rng = random.Random(0)
    batch = InputBatch(6, 256, 16, VOCAB, device)
    live: dict[str, tuple[list[int], SamplingParams]] = {}
    for step in range(60):
        for req_id in rng.sample(sorted(live), k=min(len(live), rng.randrange(3))):
            batch.remove_request(req_id)
            del live[req_id]
        while len(live) < 6 and rng.random() < 0.6:
            req_id, params = f"r{step}-{len(live)}", random_params(rng)
            prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 40))]
            output = [rng.randrange(VOCAB) for _ in range(rng.randrange(3))]
            batch.add_request(req_id, prompt, output, params, [], 0, None)
            live[req_id] = (prompt, params)
        if not live:
            continue
        order = rng.sample(sorted(live), k=len(live))
        states = [batch.requests[r] for r in order]
        params = [s.sampling_params for s in states]
        rows = np.array([s.row for s in states], dtype=np.int64)
        got = batch.sampling.penalty_tensors(rows, params)
        prompts = [live[r][0] if live[r][1].repetition_penalty != 1.0 else [] for r in order]
        want = PenaltyTensors.build(params, prompts, [s.output_token_ids for s in states],
                                    VOCAB, device)
        assert (got is None) == (want is None)
        if want is not None:
            for name in PenaltyTensors.__slots__:
                a, b = getattr(got, name), getattr(want, name)
                assert (a is None) == (b is None), name
                assert a is None or (a.device == b.device and torch.equal(a, b)), name
        got_bias, want_bias = batch.sampling.logit_bias(rows), _logit_bias(params, VOCAB, device)
        assert (got_bias is None) == (want_bias is None)
        if want_bias is not None:
            assert all(torch.equal(a, b) for a, b in zip(got_bias, want_bias, strict=True))
        for s in states:
            batch.append_token(s, rng.randrange(VOCAB))


def fake_runner(vocab: int) -> ModelRunner:
    """Just what ModelRunner._sample reads, without a model."""
    runner = ModelRunner.__new__(ModelRunner)
    runner.device = torch.device("cpu")
    runner.vocab_size = vocab
    runner.eos_token_id = None
    runner.sampler = Sampler()
    runner.logits_processors = None  # no --logits-processors plugins
    runner.input_batch = InputBatch(4, 4096, 16, vocab)
    return runner


@pytest.fixture
def host_elements(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Elements of every tensor made from host data (torch.tensor, torch.from_numpy)."""
    counted: list[int] = []
    for name in ("tensor", "from_numpy"):
        original = getattr(torch, name)

        def counting(*args, _original=original, **kwargs):
            out = _original(*args, **kwargs)
            counted.append(out.numel())
            return out

        monkeypatch.setattr(torch, name, counting)
    return counted


@pytest.mark.parametrize("prompt_len", [20, 2000])
def test_step_work_does_not_grow_with_the_prompt(prompt_len, host_elements):
    runner = fake_runner(VOCAB)
    batch = runner.input_batch
    plain = SamplingParams(temperature=0.0, max_tokens=100)
    penalized = SamplingParams(temperature=0.0, max_tokens=100, repetition_penalty=1.2,
                               frequency_penalty=0.5, presence_penalty=0.1)
    states = [batch.add_request("plain", [1, 2, 3], [], plain, [], 0, None),
              batch.add_request("long", [i % VOCAB for i in range(prompt_len)], [], penalized,
                                [], 0, None)]
    assert batch.sampling.ids_written == prompt_len  # scattered in once, when it joins
    per_step = []
    for step in range(8):
        host_elements.clear()
        out = runner._sample(torch.randn(2, VOCAB), states)
        per_step.append(sum(host_elements))
        # The last step's token (counted as this step gathers), nothing more.
        assert batch.sampling.ids_written == prompt_len + step
        for state, tok in zip(states, out.sampled_token_ids.tolist(), strict=True):
            batch.append_token(state, tok)
    # A few elements per row and step (parameters, slots, the last token), none per prompt token.
    assert max(per_step) <= 16, per_step


def test_ranks_that_do_not_sample_keep_no_state():
    batch = InputBatch(2, 64, 16, VOCAB, samples=False)
    penalized = SamplingParams(max_tokens=4, repetition_penalty=1.5, logit_bias={1: 2.0})
    state = batch.add_request("a", [1, 2, 3], [4], penalized, [], 0, None)
    batch.append_token(state, 5)
    batch.remove_request("a")
    assert batch.sampling is None and state.output_token_ids == [4, 5]
