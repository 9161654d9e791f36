"""SamplingMetadata: the batched sampling inputs of one step, built once by the model runner."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagellm.sample.allowed_tokens import allowed_ids_tensor, allowed_tokens_mask
from pagellm.sample.bad_words import bad_words_mask
from pagellm.sample.grammar import GrammarMask
from pagellm.sample.penalties import PenaltyTensors
from pagellm.sampling_params import SamplingParams


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """The per-request generator of a seeded request (kept by the runner for its lifetime)."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def validate_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """Raise ValueError when ``stop_token_ids`` or ``logit_bias`` name a token outside the
    vocabulary. Meant for the input processor; the sampler itself ignores such ids."""
    for tok in params.stop_token_ids or []:
        if tok >= vocab_size:
            raise ValueError(f"SamplingParams.stop_token_ids: token id {tok} is out of the "
                             f"vocabulary (size {vocab_size}).")
    for tok in params.logit_bias or {}:
        if tok >= vocab_size:
            raise ValueError(f"SamplingParams.logit_bias: token id {tok} is out of the "
                             f"vocabulary (size {vocab_size}).")
    for tok in params.allowed_token_ids or []:
        if tok >= vocab_size:  # as vLLM: refused, not dropped
            raise ValueError(f"SamplingParams.allowed_token_ids: token id {tok} is out of the "
                             f"vocabulary (size {vocab_size}).")


@dataclass(slots=True)
class SamplingMetadata:
    """Per-step sampling tensors, one row per sequence that samples this step.

    Optional parts are None when no row needs them, so the sampler skips that work; an all-greedy
    batch without penalties, bias or min_tokens is a bare argmax.
    """

    temperature: torch.Tensor  # float32 [B]; 0.0 on greedy rows
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None = None  # int64 [B]; vocab size where unlimited
    top_p: torch.Tensor | None = None  # float32 [B]; 1.0 where unlimited
    min_p: torch.Tensor | None = None  # float32 [B]; 0.0 where unused
    max_top_k: int = 0  # the largest limited top_k (lets top-k alone skip a full sort)
    # Row -> generator, for seeded rows that sample randomly (greedy rows need none).
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    penalties: PenaltyTensors | None = None
    # (rows, token ids) forced to -inf: EOS / stop ids of rows still short of min_tokens.
    min_tokens_mask: tuple[torch.Tensor, torch.Tensor] | None = None
    # allowed_token_ids: True where a row may not sample (bool [B, V]).
    allowed_tokens_mask: torch.Tensor | None = None
    # bad_words: (rows, token ids) that would complete a banned word, forced to -inf.
    bad_words_mask: tuple[torch.Tensor, torch.Tensor] | None = None
    # --logits-processors plugins (sample/logits_processors.py): the ones that may change
    # the argmax run before greedy rows pick, the argmax-invariant ones after temperature.
    logits_processors: tuple = ()
    argmax_invariant_processors: tuple = ()
    # (rows, token ids, bias values) added to the logits.
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # Largest number of top logprobs any row asked for; None when no row wants logprobs.
    max_num_logprobs: int | None = None
    num_logprobs: list[int | None] = field(default_factory=list)  # per row, as requested
    # Structured outputs: the allowed tokens of the constrained rows (sample/grammar.py).
    grammar_bitmask: GrammarMask | None = None

    @property
    def batch_size(self) -> int:
        return self.temperature.shape[0]

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        generators: list[torch.Generator | None],
        eos_token_ids: list[int | None],
        vocab_size: int,
        device: torch.device | str,
    ) -> SamplingMetadata:
        """Gather the rows' parameters into tensors on ``device``.

        Lists are in batch order, one entry per row. ``vocab_size`` is the width of the logits
        the sampler will see; token ids outside it are ignored (see ``validate_token_ids``).
        """
        assert len(prompt_token_ids) == len(output_token_ids) == len(params)
        return cls.assemble(
            params, [len(ids) for ids in output_token_ids], generators, eos_token_ids,
            vocab_size, device,
            penalties=PenaltyTensors.build(params, prompt_token_ids, output_token_ids,
                                           vocab_size, device),
            logit_bias=_logit_bias(params, vocab_size, device),
            allowed_tokens=allowed_tokens_mask(
                [None if p.allowed_token_ids is None
                 else allowed_ids_tensor(p.allowed_token_ids, device) for p in params],
                vocab_size, device),
            bad_words=bad_words_mask([p.bad_words_token_ids for p in params],
                                     output_token_ids, device))

    @classmethod
    def assemble(
        cls,
        params: list[SamplingParams],
        num_output_tokens: list[int],
        generators: list[torch.Generator | None],
        eos_token_ids: list[int | None],
        vocab_size: int,
        device: torch.device | str,
        penalties: PenaltyTensors | None,
        logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
        allowed_tokens: torch.Tensor | None = None,
        bad_words: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> SamplingMetadata:
        """Like ``build``, with the penalty, bias, allowed-token and bad-word tensors already
        made (the model runner keeps the first three in its persistent batch)."""
        num_rows = len(params)
        assert num_rows > 0
        assert len(num_output_tokens) == len(generators) == len(eos_token_ids) == num_rows

        greedy = [p.greedy for p in params]
        all_greedy, all_random = all(greedy), not any(greedy)
        meta = cls(
            temperature=torch.tensor([0.0 if p.greedy else p.temperature for p in params],
                                     dtype=torch.float32, device=device),
            all_greedy=all_greedy,
            all_random=all_random,
            generators={i: gen for i, gen in enumerate(generators)
                        if gen is not None and not greedy[i]},
            penalties=penalties,
            min_tokens_mask=_min_tokens_mask(params, num_output_tokens, eos_token_ids,
                                             vocab_size, device),
            logit_bias=logit_bias,
            allowed_tokens_mask=allowed_tokens,
            bad_words_mask=bad_words,
        )
        if not all_greedy:
            _set_filters(meta, params, vocab_size, device)
        requested = [p.logprobs for p in params]
        meta.num_logprobs = requested
        if any(n is not None for n in requested):
            meta.max_num_logprobs = max(n for n in requested if n is not None)
        return meta


def _set_filters(meta: SamplingMetadata, params: list[SamplingParams], vocab_size: int,
                 device: torch.device | str) -> None:
    # Filters never change a greedy row's argmax, so greedy rows are left unlimited.
    top_k = [vocab_size if p.greedy or p.top_k <= 0 else min(p.top_k, vocab_size)
             for p in params]
    limited = [k for k in top_k if k < vocab_size]
    if limited:
        meta.top_k = torch.tensor(top_k, dtype=torch.long, device=device)
        meta.max_top_k = max(limited)
    top_p = [1.0 if p.greedy else p.top_p for p in params]
    if any(p < 1.0 for p in top_p):
        meta.top_p = torch.tensor(top_p, dtype=torch.float32, device=device)
    min_p = [0.0 if p.greedy else p.min_p for p in params]
    if any(p > 0.0 for p in min_p):
        meta.min_p = torch.tensor(min_p, dtype=torch.float32, device=device)


def _min_tokens_mask(
    params: list[SamplingParams],
    num_output_tokens: list[int],
    eos_token_ids: list[int | None],
    vocab_size: int,
    device: torch.device | str,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    rows: list[int] = []
    tokens: list[int] = []
    for i, (p, num_out, eos) in enumerate(zip(params, num_output_tokens, eos_token_ids,
                                              strict=True)):
        if num_out >= p.min_tokens or p.structured_outputs is not None:
            continue  # a constrained row's bitmask holds its stop tokens back itself
        blocked = set(p.stop_token_ids or [])
        if eos is not None and not p.ignore_eos:
            blocked.add(eos)
        for tok in blocked:
            if 0 <= tok < vocab_size:
                rows.append(i)
                tokens.append(tok)
    if not rows:
        return None
    return (torch.tensor(rows, dtype=torch.long, device=device),
            torch.tensor(tokens, dtype=torch.long, device=device))


def _logit_bias(
    params: list[SamplingParams], vocab_size: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    rows: list[int] = []
    tokens: list[int] = []
    values: list[float] = []
    for i, p in enumerate(params):
        for tok, bias in (p.logit_bias or {}).items():
            if 0 <= tok < vocab_size:
                rows.append(i)
                tokens.append(tok)
                values.append(float(bias))
    if not rows:
        return None
    return (torch.tensor(rows, dtype=torch.long, device=device),
            torch.tensor(tokens, dtype=torch.long, device=device),
            torch.tensor(values, dtype=torch.float32, device=device))
