"""SamplerOutput.to_host: the step's tokens and logprobs records in one device->host copy, equal
to reading each tensor separately. (Lives with the CUDA small-op tests: it is the sampling half
of the same GPU work.)"""

from __future__ import annotations

import math

import pytest
import torch

from pagellm.sample.metadata import SamplingMetadata
from pagellm.sample.sampler import Sampler, SamplerOutput, logprobs_record
from pagellm.sampling_params import SamplingParams

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _sample(params: list[SamplingParams], logits: torch.Tensor, device: str
            ) -> tuple[SamplerOutput, SamplingMetadata]:
    n, vocab = logits.shape
    meta = SamplingMetadata.build(params, [[]] * n, [[]] * n, [None] * n, [None] * n, vocab,
                                  device)
    return Sampler()(logits.clone().to(device), meta), meta


@pytest.fixture
def count_copies(monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """Every tensor ``.cpu()`` is called on (the only device->host path to_host may take)."""
    calls: list[torch.Tensor] = []
    original = torch.Tensor.cpu

    def counting(self: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        calls.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "cpu", counting)
    return calls


@pytest.mark.parametrize("device", DEVICES)
def test_tokens_and_logprobs_in_one_copy(device: str, count_copies: list) -> None:
    torch.manual_seed(0)
    vocab = 24
    params = [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.7, logprobs=0),
              SamplingParams(temperature=0.0, logprobs=20)]
    logits = torch.randn(len(params), vocab) * 3
    logits[3, :10] = -math.inf  # top-20 of 24 holds -inf: it must survive the bit packing
    out, meta = _sample(params, logits, device)
    count_copies.clear()
    tokens, records = out.to_host(meta.num_logprobs)
    assert len(count_copies) == 1 and count_copies[0].dtype == torch.int64
    count_copies.clear()

    assert tokens == out.sampled_token_ids.tolist()
    assert all(isinstance(t, int) for t in tokens)
    assert records[1] is None
    for row, p in enumerate(params):
        if p.logprobs is not None:
            assert records[row] == logprobs_record(out, row, p.logprobs)
    assert records[3] is not None and records[3].top_logprobs[-1] == -math.inf
    assert out.logprobs_records(meta.num_logprobs) == records


def test_without_logprobs_only_tokens_travel(count_copies: list) -> None:
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=1)]
    out, meta = _sample(params, torch.randn(2, 30), "cpu")
    count_copies.clear()
    tokens, records = out.to_host(meta.num_logprobs)
    assert len(count_copies) == 1
    assert tokens == out.sampled_token_ids.tolist() and records == [None, None]
