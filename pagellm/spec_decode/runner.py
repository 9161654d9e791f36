"""The model runner's speculative-decoding part: drafts into the batch, verification, proposals.

Each step: the scheduled drafts of a verifying request are written after its known tokens in
its persistent token row, so the flat batch gathers "last known token, drafts" like any other
tokens (positions and KV slots follow); its logits rows are all 1 + d of them; the rejection
sampler (rejection.py) picks the emitted tokens; after sampling, the proposer drafts for the
requests that sampled. Tensor parallel: every rank runs the forward and the LM head, rank 0
samples and proposes; the emitted tokens are broadcast, the proposals travel to the scheduler in
ModelRunnerOutput and come back to every rank in the next SchedulerOutput.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from pagellm.config import EngineConfig
from pagellm.core.sched_output import Logprobs, SchedulerOutput
from pagellm.distributed.communication import broadcast_from_rank0
from pagellm.sample.metadata import SamplingMetadata
from pagellm.sample.sampler import gather_logprobs
from pagellm.sampling_params import SamplingParams
from pagellm.spec_decode.config import SpeculativeConfig
from pagellm.spec_decode.proposer import Proposer
from pagellm.spec_decode.rejection import draft_layout, rejection_sample
from pagellm.worker.input_batch import CachedRequestState, InputBatch


def gets_proposals(params: SamplingParams, num_output_tokens: int) -> bool:
    """Whether the rejection sampler verifies this request exactly. Penalties, logit bias and
    min_tokens change the distribution with every emitted token (or per position), a grammar
    must see each token before the next is allowed, prompt logprobs are scored by the plain
    path, bad words and allowed ids are masks of the plain sampler: such requests decode one
    token per step as without speculation."""
    return (params.presence_penalty == 0.0 and params.frequency_penalty == 0.0
            and params.repetition_penalty == 1.0 and not params.logit_bias
            and not params.bad_words and params.allowed_token_ids is None
            and params.structured_outputs is None and params.prompt_logprobs is None
            and num_output_tokens >= params.min_tokens)


def make_proposer(config: EngineConfig) -> Proposer:
    spec: SpeculativeConfig = config.speculative_config
    if spec.method == "ngram":
        from pagellm.spec_decode.ngram import NgramProposer

        return NgramProposer(spec, config.scheduler.max_model_len)
    from pagellm.spec_decode.draft_model import DraftModelProposer

    return DraftModelProposer(config, spec, config.device.device, config.model.dtype)


@dataclass(slots=True)
class VerifyPlan:
    """The step's verifying requests: their index in the step's request order, their drafts
    and the rows of the step's hidden states their logits come from (1 + d each, in order)."""

    state_indices: list[int]
    drafts: list[list[int]]
    logits_indices: np.ndarray


class SpecDecodeRunner:
    def __init__(self, config: EngineConfig, generator: torch.Generator,
                 step_seed: Callable[[int | None, int], int], eos_token_id: int | None,
                 tp_rank: int, tp_size: int) -> None:
        """``generator``: the runner's noise for unseeded rows; ``step_seed(seed, position)``:
        how the runner seeds a seeded request's generator for an output position."""
        self.spec: SpeculativeConfig = config.speculative_config
        self.device = config.device.device
        self.vocab_size = config.model.vocab_size
        self.generator = generator
        self.step_seed = step_seed
        self.eos_token_id = eos_token_id
        self.tp_rank, self.tp_size = tp_rank, tp_size
        # Only the sampling rank proposes (its proposals reach the other ranks as scheduled).
        self.proposer: Proposer | None = make_proposer(config) if tp_rank == 0 else None

    def initialize(self, num_blocks: int) -> None:
        if self.proposer is not None:
            self.proposer.initialize(num_blocks)

    def sleep(self, level: int) -> int:
        """Sleep mode: the proposer frees what it holds (a draft model's cache and weights)."""
        return self.proposer.sleep(level) if self.proposer is not None else 0

    def wake_up(self) -> None:
        if self.proposer is not None:
            self.proposer.wake_up()

    def update_states(self, so: SchedulerOutput, batch: InputBatch) -> None:
        """After the runner's own state update: forget gone requests, write the drafts."""
        if self.proposer is not None:
            for req_id in so.finished_req_ids | so.preempted_req_ids:
                self.proposer.remove_request(req_id)
        for req_id, drafts in so.scheduled_spec_decode_tokens.items():
            state = batch.requests[req_id]
            batch.token_ids[state.row, state.num_tokens:state.num_tokens + len(drafts)] = drafts

    def plan(self, so: SchedulerOutput, states: list[CachedRequestState],
             query_start_loc: list[int], logits_indices: np.ndarray, sample_rows: np.ndarray
             ) -> tuple[VerifyPlan, np.ndarray, np.ndarray]:
        """Split the step's sampling requests: the verifying ones (a VerifyPlan) and the
        others (their ``logits_indices`` and ``sample_rows``, returned)."""
        drafts_of = so.scheduled_spec_decode_tokens
        indices: list[int] = []
        drafts: list[list[int]] = []
        rows: list[np.ndarray] = []
        for i, state in enumerate(states):
            d = drafts_of.get(state.req_id)
            if d:
                assert so.num_scheduled_tokens[state.req_id] == len(d) + 1, state.req_id
                indices.append(i)
                drafts.append(d)
                end = query_start_loc[i + 1]
                rows.append(np.arange(end - len(d) - 1, end))
        keep = ~np.isin(sample_rows, indices)
        plan = VerifyPlan(indices, drafts, np.concatenate(rows))
        return plan, logits_indices[keep], sample_rows[keep]

    def verify(self, model: torch.nn.Module, hidden: torch.Tensor, plan: VerifyPlan,
               states: list[CachedRequestState], batch: InputBatch, sampled: list[list[int]],
               logprobs: list) -> None:
        """Verify the drafts; append each request's emitted tokens to its row and fill its
        entries of ``sampled`` and ``logprobs``; roll its ``num_computed_tokens`` back over
        the rejected drafts (their positions are computed again next step)."""
        idx = torch.from_numpy(plan.logits_indices).to(self.device)
        logits = model.compute_logits(hidden.index_select(0, idx))
        verifying = [states[i] for i in plan.state_indices]
        width = max(len(d) for d in plan.drafts) + 1
        records: list[list[Logprobs] | None] = [None] * len(verifying)
        if self.tp_rank == 0:
            emitted, records = self._sample(logits, verifying, plan.drafts)
        else:
            emitted = torch.empty((len(verifying), width), dtype=torch.long, device=self.device)
        if self.tp_size > 1:
            emitted = broadcast_from_rank0(emitted)
        for j, tokens in enumerate(emitted.cpu().tolist()):
            i, state = plan.state_indices[j], verifying[j]
            tokens = [t for t in tokens if t >= 0]
            for token in tokens:
                batch.append_token(state, token)
            sampled[i] = tokens
            rec = records[j]
            logprobs[i] = rec[:len(tokens)] if rec is not None else None
            state.num_computed_tokens -= len(plan.drafts[j]) + 1 - len(tokens)

    def _sample(self, logits: torch.Tensor, verifying: list[CachedRequestState],
                drafts: list[list[int]]) -> tuple[torch.Tensor, list[list[Logprobs] | None]]:
        """Rank 0: the emitted tokens ``[N, K + 1]`` (-1 after each request's) and, for the
        requests that asked, one Logprobs record per emitted token (of the raw logits)."""
        params: list[SamplingParams] = []
        num_output: list[int] = []
        generators: list[torch.Generator | None] = []
        for state, d in zip(verifying, drafts, strict=True):
            n = len(state.output_token_ids)
            params += [state.sampling_params] * (len(d) + 1)
            num_output += range(n, n + len(d) + 1)
            if state.generator is not None:
                # As the plain path: the seed and the output position decide the draws.
                state.generator.manual_seed(self.step_seed(state.sampling_params.seed, n))
            generators.append(state.generator)
        meta = SamplingMetadata.assemble(
            params=params, num_output_tokens=num_output, generators=[None] * len(params),
            eos_token_ids=[self.eos_token_id] * len(params), vocab_size=self.vocab_size,
            device=self.device, penalties=None, logit_bias=None)
        logits = logits.float()
        raw_logprobs = (torch.log_softmax(logits, dim=-1) if meta.max_num_logprobs is not None
                        else None)
        emitted = rejection_sample(logits, drafts, meta, generators, self.generator)
        if raw_logprobs is None:
            return emitted, [None] * len(verifying)
        assert meta.max_num_logprobs is not None
        req_of_row, pos_of_row = draft_layout([len(d) for d in drafts], self.device)
        row_tokens = emitted[req_of_row, pos_of_row].clamp(min=0)
        _, row_records = gather_logprobs(raw_logprobs, row_tokens,
                                         meta.max_num_logprobs).to_host(meta.num_logprobs)
        records: list[list[Logprobs] | None] = []
        start = 0
        for state, d in zip(verifying, drafts, strict=True):
            rows = row_records[start:start + len(d) + 1]
            start += len(d) + 1
            records.append(None if state.sampling_params.logprobs is None
                           else [r for r in rows if r is not None])
        return emitted, records

    def propose(self, batch: InputBatch, states: list[CachedRequestState],
                sampled: list[list[int]]) -> dict[str, list[int]]:
        """Drafts for the requests that sampled this step and can be verified exactly, while
        the running batch is below ``disable_by_batch_size``."""
        if self.proposer is None or not self.spec.enabled_for_batch(len(batch.requests)):
            return {}
        candidates = [s for s, tokens in zip(states, sampled, strict=True)
                      if tokens and gets_proposals(s.sampling_params, len(s.output_token_ids))]
        if not candidates:
            return {}
        drafts = self.proposer.propose(batch, candidates, self.spec.num_speculative_tokens)
        return {s.req_id: d for s, d in zip(candidates, drafts, strict=True) if d}
