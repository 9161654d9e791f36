"""Truncation filters (min-p, top-k, top-p) and exponential-noise sampling over logits [B, V].

Filters set removed tokens to -inf in place and return the (possibly new) logits tensor.
"""

from __future__ import annotations

import torch

from pagellm.sample.argmax import argmax_rows

_NEG_INF = float("-inf")


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p`` times the row's top probability.

    p_i / p_max = exp(l_i - l_max), so this needs no softmax; min_p == 0 gives log 0 = -inf and
    removes nothing.
    """
    top = logits.amax(dim=-1, keepdim=True)
    logits.masked_fill_(logits - top < torch.log(min_p).unsqueeze(1), _NEG_INF)
    return logits


def apply_top_k_top_p(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    max_top_k: int = 0,
) -> torch.Tensor:
    """Keep each row's ``top_k`` largest logits (ties at the k-th value kept), then the smallest
    set of most likely tokens whose probability mass reaches ``top_p``.

    ``top_k`` is int64 [B] with the vocabulary size on rows without a limit; ``max_top_k`` is the
    largest limit among the other rows (it lets top-k alone use a partial ``topk`` instead of a
    full sort). ``top_p`` is float32 [B], 1.0 meaning no limit. Top-k and top-p share one sort.
    """
    vocab_size = logits.shape[-1]
    if top_p is None:
        if top_k is None:
            return logits
        return _apply_top_k_only(logits, top_k, max_top_k)

    sorted_logits, order = logits.sort(dim=-1, descending=False)
    if top_k is not None:
        # Ascending order: the k-th largest sits at index V - k.
        kth_pos = (vocab_size - top_k).clamp(min=0).unsqueeze(1)
        kth = sorted_logits.gather(1, kth_pos)
        sorted_logits.masked_fill_(sorted_logits < kth, _NEG_INF)
    probs = sorted_logits.softmax(dim=-1)
    # Inclusive ascending cumsum <= 1 - p  <=>  the mass strictly above the token already >= p.
    drop = probs.cumsum(dim=-1) <= (1.0 - top_p).unsqueeze(1)
    drop[:, -1] = False  # the most likely token always survives
    sorted_logits.masked_fill_(drop, _NEG_INF)
    return logits.scatter_(1, order, sorted_logits)


def _apply_top_k_only(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    vocab_size = logits.shape[-1]
    if max_top_k <= 0 or max_top_k >= vocab_size:
        max_top_k = vocab_size
    top_values = logits.topk(max_top_k, dim=-1).values  # descending
    kth = top_values.gather(1, (top_k.clamp(max=max_top_k) - 1).unsqueeze(1))
    # Rows without a limit keep everything.
    kth.masked_fill_((top_k >= vocab_size).unsqueeze(1), _NEG_INF)
    logits.masked_fill_(logits < kth, _NEG_INF)
    return logits


def exponential_sample(probs: torch.Tensor, generators: dict[int, torch.Generator],
                       default_generator: torch.Generator | None = None) -> torch.Tensor:
    """argmax(probs / E) with E ~ Exp(1) i.i.d. draws a token with probability ``probs``.

    Rows in ``generators`` draw their noise from their own generator, so a seeded request gets
    the same tokens whatever else is in the batch; all other rows share one draw from
    ``default_generator`` (None: torch's global one).
    Overwrites ``probs``. Returns int64 [B].
    """
    noise = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        noise.exponential_(generator=default_generator)
    # NOTE: the only per-row Python loop of the sampler, over seeded rows only.
    for row, generator in generators.items():
        noise[row].exponential_(generator=generator)
    # An Exp(1) draw of exactly 0 would give 0/0 = nan on removed tokens, and argmax favors nan.
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)
    return argmax_rows(probs.div_(noise))
