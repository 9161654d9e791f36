"""The sampler: logits [B, V] + SamplingMetadata -> one token per row (and logprobs)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagellm.core.sched_output import Logprobs
from pagellm.sample.argmax import argmax_rows
from pagellm.sample.filters import apply_min_p, apply_top_k_top_p, exponential_sample
from pagellm.sample.grammar import apply_grammar_mask
from pagellm.sample.metadata import SamplingMetadata
from pagellm.sample.penalties import apply_penalties

_NEG_INF = float("-inf")


@dataclass(slots=True)
class SamplerOutput:
    """``sampled_token_ids`` int64 [B]. With logprobs (any row asked), ``logprobs_token_ids`` and
    ``logprobs`` are [B, 1 + K] (column 0: the sampled token; then the top-K of the raw
    distribution, K = the largest number asked) and ``sampled_token_ranks`` [B] (1 = most
    likely)."""

    sampled_token_ids: torch.Tensor
    logprobs_token_ids: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    sampled_token_ranks: torch.Tensor | None = None

    def to_host(self, num_logprobs: list[int | None]
                ) -> tuple[list[int], list[Logprobs | None]]:
        """``(sampled token ids, one Logprobs record per row)`` (None where the row asked for
        none) with a single device->host copy for the whole step: everything the host needs is
        packed into one int64 tensor first (float32 logprobs travel as their bit patterns)."""
        batch = self.sampled_token_ids.shape[0]
        assert len(num_logprobs) == batch
        parts = [self.sampled_token_ids.unsqueeze(1)]
        if self.logprobs is not None:
            assert self.logprobs_token_ids is not None and self.sampled_token_ranks is not None
            assert self.logprobs.dtype == torch.float32
            parts += [self.logprobs_token_ids, self.logprobs.view(torch.int32).long(),
                      self.sampled_token_ranks.unsqueeze(1)]
        host = (parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)).cpu()
        tokens = host[:, 0].tolist()
        if self.logprobs is None:
            return tokens, [None] * batch
        width = self.logprobs.shape[1]
        ids = host[:, 1:1 + width].tolist()
        lps = host[:, 1 + width:1 + 2 * width].int().view(torch.float32).tolist()
        ranks = host[:, -1].tolist()
        return tokens, [None if n is None else _record(ids[i], lps[i], ranks[i], n)
                        for i, n in enumerate(num_logprobs)]

    def logprobs_records(self, num_logprobs: list[int | None]) -> list[Logprobs | None]:
        """One record per row (None where the row asked for none), in one device->host copy."""
        return self.to_host(num_logprobs)[1]


def logprobs_record(out: SamplerOutput, row: int, num_logprobs: int) -> Logprobs:
    """Row ``row`` of ``out`` as a Logprobs record with its own ``num_logprobs`` top entries.
    (Copies that row to the host; ``to_host`` does the whole batch in one copy.)"""
    assert out.logprobs is not None and out.logprobs_token_ids is not None
    assert out.sampled_token_ranks is not None
    ids = out.logprobs_token_ids[row].tolist()
    lps = out.logprobs[row].tolist()
    return _record(ids, lps, int(out.sampled_token_ranks[row]), num_logprobs)


def _record(ids: list[int], lps: list[float], rank: int, num_logprobs: int) -> Logprobs:
    return Logprobs(
        sampled_token_id=ids[0],
        sampled_logprob=lps[0],
        sampled_rank=rank,
        top_token_ids=ids[1:1 + num_logprobs],
        top_logprobs=lps[1:1 + num_logprobs],
    )


class Sampler:
    """Order: the grammar bitmask (structured outputs) -> allowed_token_ids and bad_words
    masks -> --logits-processors that may change the argmax -> logit bias and min_tokens
    masking -> penalties -> greedy rows take the argmax -> temperature -> argmax-invariant
    processors -> min-p -> top-k / top-p -> softmax -> exponential-noise sampling.

    Logprobs come from the raw logits (before any of that but the grammar bitmask, as in vLLM:
    a constrained row's logprobs are those of what its grammar allows). ``logits`` [B, V] are
    upcast to float32; float32 logits are modified in place.

    Unseeded random rows draw from ``generator`` (an engine's own, seeded with its
    ``--seed``); None: torch's global generator.
    """

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator

    @staticmethod
    def greedy(logits: torch.Tensor) -> torch.Tensor:
        """Plain argmax, int64 [B] (warm-up and profiling)."""
        return argmax_rows(logits)

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        assert logits.dim() == 2 and logits.shape[0] == meta.batch_size
        # Sampling math is float32 whatever the model dtype (no-op when already float32).
        logits = logits.float()
        if meta.grammar_bitmask is not None:
            # First, as vLLM: logprobs are then those of the distribution the grammar allows,
            # and nothing after (bias, penalties: -inf stays -inf) re-enables a masked token.
            apply_grammar_mask(logits, meta.grammar_bitmask)
        raw_logprobs = None
        if meta.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits, dim=-1)

        logits = self._process(logits, meta)
        sampled = self._sample(logits, meta)

        if raw_logprobs is None:
            return SamplerOutput(sampled_token_ids=sampled)
        return gather_logprobs(raw_logprobs, sampled, meta.max_num_logprobs)

    @staticmethod
    def _process(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        # The masks first: a bias or penalty added to -inf leaves it -inf.
        if meta.allowed_tokens_mask is not None:
            logits.masked_fill_(meta.allowed_tokens_mask, _NEG_INF)
        if meta.bad_words_mask is not None:
            logits[meta.bad_words_mask] = _NEG_INF
        for processor in meta.logits_processors:
            logits = processor.apply(logits)
        if meta.logit_bias is not None:
            rows, tokens, values = meta.logit_bias
            logits.index_put_((rows, tokens), values, accumulate=True)
        if meta.min_tokens_mask is not None:
            logits[meta.min_tokens_mask] = _NEG_INF
        if meta.penalties is not None:
            logits = apply_penalties(logits, meta.penalties)
        return logits

    def _sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        if meta.all_greedy:
            return argmax_rows(logits)
        greedy = None if meta.all_random else argmax_rows(logits)
        probs = sampling_probs(logits, meta)
        sampled = exponential_sample(probs, meta.generators, self.generator)

        if greedy is None:
            return sampled
        return torch.where(meta.temperature > 0, sampled, greedy)


def sampling_probs(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """The distribution random rows draw from: temperature, then min-p, then top-k / top-p,
    then softmax (greedy rows divided by 1: finite, and decided elsewhere). Modifies
    ``logits`` (float32) in place. Speculative decoding's rejection sampler uses it too."""
    temperature = meta.temperature
    if not meta.all_random:
        temperature = torch.where(temperature > 0, temperature, 1.0)
    logits = logits.div_(temperature.unsqueeze(1))
    for processor in meta.argmax_invariant_processors:
        logits = processor.apply(logits)
    if meta.min_p is not None:
        logits = apply_min_p(logits, meta.min_p)
    if meta.top_k is not None or meta.top_p is not None:
        logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p, meta.max_top_k)
    return logits.softmax(dim=-1)


def gather_logprobs(logprobs: torch.Tensor, sampled: torch.Tensor,
                    num_logprobs: int) -> SamplerOutput:
    """The sampled token's logprob and rank plus the top-``num_logprobs`` of ``logprobs``.

    Rank = 1 + the number of tokens strictly more likely (ties share the better rank).
    """
    sampled_col = sampled.unsqueeze(1)
    sampled_lp = logprobs.gather(1, sampled_col)
    ranks = (logprobs > sampled_lp).sum(dim=-1) + 1
    token_ids, values = sampled_col, sampled_lp
    if num_logprobs > 0:
        top_lp, top_ids = logprobs.topk(num_logprobs, dim=-1)
        token_ids = torch.cat([sampled_col, top_ids], dim=1)
        values = torch.cat([sampled_lp, top_lp], dim=1)
    return SamplerOutput(sampled_token_ids=sampled, logprobs_token_ids=token_ids,
                         logprobs=values, sampled_token_ranks=ranks)
