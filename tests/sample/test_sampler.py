"""Sampler: greedy, top_k=1, seeded reproducibility, min_tokens, logit_bias, fast paths."""

from __future__ import annotations

import pytest
import torch

from pagellm.sample.metadata import SamplingMetadata, make_generator, validate_token_ids
from pagellm.sample.sampler import Sampler
from pagellm.sampling_params import SamplingParams

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def build(params: list[SamplingParams], vocab: int, device: str, *,
          outputs: list[list[int]] | None = None, prompts: list[list[int]] | None = None,
          generators: list[torch.Generator | None] | None = None,
          eos: int | None = None) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata.build(
        params, prompts or [[]] * n, outputs or [[]] * n, generators or [None] * n, [eos] * n,
        vocab, device)


def sample(logits: torch.Tensor, meta: SamplingMetadata) -> list[int]:
    return Sampler()(logits.clone(), meta).sampled_token_ids.tolist()


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_is_argmax(device: str) -> None:
    torch.manual_seed(0)
    logits = torch.randn(32, 500, device=device)
    meta = build([SamplingParams(temperature=0.0)] * 32, 500, device)
    # Fast path: nothing but an argmax to do.
    assert meta.all_greedy and meta.top_k is None and meta.top_p is None and meta.min_p is None
    assert meta.penalties is None and meta.logit_bias is None and meta.min_tokens_mask is None
    out = Sampler()(logits.clone(), meta)
    assert out.sampled_token_ids.dtype == torch.long and out.logprobs is None
    assert out.sampled_token_ids.tolist() == logits.argmax(-1).tolist()


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_rows_in_a_mixed_batch_stay_argmax(device: str) -> None:
    torch.manual_seed(1)
    logits = torch.randn(40, 300, device=device)
    params = [SamplingParams(temperature=0.0) if i % 2 else
              SamplingParams(temperature=1.5, top_p=0.9, top_k=50) for i in range(40)]
    meta = build(params, 300, device)
    assert not meta.all_greedy and not meta.all_random
    tokens = sample(logits, meta)
    argmax = logits.argmax(-1).tolist()
    assert all(tokens[i] == argmax[i] for i in range(1, 40, 2))
    # Random rows really sample: with 20 flat-ish rows some pick a non-argmax token.
    assert any(tokens[i] != argmax[i] for i in range(0, 40, 2))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_top_k_one_is_greedy_at_any_temperature(device: str, top_p: float) -> None:
    torch.manual_seed(2)
    logits = torch.randn(64, 1000, device=device)
    temps = [0.05, 0.5, 1.0, 3.0, 20.0, 100.0, 1.0, 2.0] * 8
    params = [SamplingParams(temperature=t, top_k=1, top_p=top_p) for t in temps]
    assert sample(logits, build(params, 1000, device)) == logits.argmax(-1).tolist()


def _run_steps(row_logits: list[torch.Tensor], params: list[SamplingParams], target: int,
               generators: list[torch.Generator | None], device: str) -> list[int]:
    """Sample len(row_logits) steps of a batch and return the tokens of row ``target``."""
    tokens = []
    for logits in row_logits:
        meta = build(params, logits.shape[1], device, generators=generators)
        tokens.append(sample(logits, meta)[target])
    return tokens


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_row_is_reproducible_whatever_the_batch(device: str) -> None:
    vocab, steps = 200, 12
    g = torch.Generator().manual_seed(5)
    target_logits = [torch.randn(vocab, generator=g) * 0.5 for _ in range(steps)]
    other_logits = [torch.randn(6, vocab, generator=g) for _ in range(steps)]
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)

    alone = _run_steps([t.unsqueeze(0).to(device) for t in target_logits], [seeded], 0,
                       [make_generator(1234, device)], device)

    torch.manual_seed(99)  # a different global RNG state must not matter
    others = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.7, seed=7, top_k=20),
              SamplingParams(temperature=1.2, min_p=0.05), SamplingParams(temperature=1.0)]
    for target in (0, 3, 5):
        params = others[:target] + [seeded] + others[target:]
        gens: list[torch.Generator | None] = [
            make_generator(p.seed, device) if p.seed is not None else None for p in params]
        batches = [torch.cat([o[:target], t.unsqueeze(0), o[target:5]]).to(device)
                   for t, o in zip(target_logits, other_logits, strict=True)]
        assert _run_steps(batches, params, target, gens, device) == alone, target

    other_seed = _run_steps([t.unsqueeze(0).to(device) for t in target_logits],
                            [seeded.clone(seed=4321)], 0, [make_generator(4321, device)], device)
    assert other_seed != alone


@pytest.mark.parametrize("device", DEVICES)
def test_unseeded_rows_differ_from_each_other(device: str) -> None:
    torch.manual_seed(3)
    logits = torch.zeros(1, 1000, device=device).repeat(8, 1)  # uniform: 1000 choices per row
    tokens = sample(logits, build([SamplingParams(temperature=1.0)] * 8, 1000, device))
    assert len(set(tokens)) > 4  # one shared draw, but independent noise per row


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_blocks_eos_and_stop_ids(device: str, temperature: float) -> None:
    vocab, eos, stop_id = 50, 7, 11
    logits = torch.full((1, vocab), -5.0, device=device)
    logits[0, eos], logits[0, stop_id], logits[0, 20] = 30.0, 25.0, 0.0
    params = SamplingParams(temperature=temperature, min_tokens=3, stop_token_ids=[stop_id])

    def tokens(num_out: int, p: SamplingParams, n: int = 200) -> set[int]:
        meta = build([p] * n, vocab, device, outputs=[[1] * num_out] * n, eos=eos)
        return set(sample(logits.repeat(n, 1), meta))

    for num_out in (0, 2):
        got = tokens(num_out, params)
        assert eos not in got and stop_id not in got, (num_out, got)
    assert tokens(3, params) == {eos}  # min_tokens reached: EOS is allowed again
    # ignore_eos: EOS does not stop the request, so it is not blocked; stop ids still are.
    assert tokens(0, params.clone(ignore_eos=True)) == {eos}
    assert tokens(0, params.clone(ignore_eos=True, stop_token_ids=[eos])) == {stop_id}


@pytest.mark.parametrize("device", DEVICES)
def test_logit_bias(device: str) -> None:
    torch.manual_seed(4)
    vocab = 100
    logits = torch.randn(1, vocab, device=device)
    top2 = logits[0].topk(2).indices.tolist()
    weakest = int(logits[0].argmin())
    greedy = SamplingParams(temperature=0.0)
    assert sample(logits, build([greedy.clone(logit_bias={weakest: 50.0})], vocab, device)) \
        == [weakest]
    assert sample(logits, build([greedy.clone(logit_bias={top2[0]: -100.0})], vocab, device)) \
        == [top2[1]]
    # Random rows: everything but two tokens pushed down by 100 is never drawn.
    allowed = {3, 42}
    bias = {t: -100.0 for t in range(vocab) if t not in allowed}
    n = 2000
    meta = build([SamplingParams(temperature=1.0, logit_bias=bias)] * n, vocab, device)
    assert set(sample(logits.repeat(n, 1), meta)) == allowed


def test_validate_token_ids_names_the_field() -> None:
    validate_token_ids(SamplingParams(stop_token_ids=[5], logit_bias={9: 1.0}), 10)
    with pytest.raises(ValueError, match="stop_token_ids"):
        validate_token_ids(SamplingParams(stop_token_ids=[10]), 10)
    with pytest.raises(ValueError, match="logit_bias"):
        validate_token_ids(SamplingParams(logit_bias={10: 1.0}), 10)
