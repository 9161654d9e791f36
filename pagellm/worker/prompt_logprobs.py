"""Prompt logprobs (``SamplingParams.prompt_logprobs``), scored in the prefill's own forward.

A step that runs positions ``[start, end)`` of a request's prompt has the hidden state of each;
position ``p`` predicts prompt token ``p + 1``. So the step scores prompt tokens ``start + 1 ..
min(end, num_prompt)-1``: the last position of a chunk scores the first token of the next chunk
(its id is already in the persistent batch), and the prompt's last position is the sampler's
(it predicts the first output token, not a prompt token). Only the rows of requests that asked
go through the LM head, in slices of at most ``max_rows`` rows, so the float32 ``[rows, vocab]``
buffers stay as large as a sampling step's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagellm.core.sched_output import PromptLogprobs
from pagellm.sample.sampler import SamplerOutput, gather_logprobs
from pagellm.worker.input_batch import CachedRequestState


@dataclass(slots=True)
class PromptLogprobsPlan:
    """Which rows of a step's flat batch score prompt tokens, and for whom."""

    batch_rows: np.ndarray  # int64 [R]: the rows (positions p) to run through the LM head
    target_token_ids: np.ndarray  # int64 [R]: prompt token p + 1 of each row
    num_logprobs: list[int]  # [R]: the top-k each row's request asked for
    # (req_id, index of its first prompt token scored here, number of rows), in row order.
    spans: list[tuple[str, int, int]]


def plan_prompt_logprobs(states: list[CachedRequestState], num_computed: np.ndarray,
                         num_scheduled: np.ndarray, query_start: np.ndarray,
                         token_ids: np.ndarray) -> PromptLogprobsPlan | None:
    """The step's prompt-scoring rows (None when no request of the step scores any).
    ``query_start[i]`` is the batch row of ``states[i]``'s first token this step; ``token_ids``
    is the persistent batch's token buffer."""
    rows: list[np.ndarray] = []
    spans: list[tuple[str, int, int]] = []
    num_logprobs: list[int] = []
    targets: list[np.ndarray] = []
    for i, state in enumerate(states):
        k = state.sampling_params.prompt_logprobs
        if k is None:
            continue
        start = int(num_computed[i])
        last = min(start + int(num_scheduled[i]), state.num_prompt_tokens - 1)
        if last <= start:
            continue
        count = last - start
        rows.append(np.arange(count, dtype=np.int64) + int(query_start[i]))
        targets.append(token_ids[state.row, start + 1:last + 1])
        spans.append((state.req_id, start + 1, count))
        num_logprobs += [k] * count
    if not spans:
        return None
    return PromptLogprobsPlan(batch_rows=np.concatenate(rows),
                              target_token_ids=np.concatenate(targets).astype(np.int64),
                              num_logprobs=num_logprobs, spans=spans)


@torch.inference_mode()
def compute_prompt_logprobs(model: torch.nn.Module, hidden: torch.Tensor,
                            plan: PromptLogprobsPlan, max_rows: int, scores: bool
                            ) -> dict[str, PromptLogprobs]:
    """Each span's records: the prompt token's logprob under float32 log_softmax of its logits,
    its rank, and the top-k. Every tensor-parallel rank calls this (the LM head gathers the
    vocabulary across ranks); only the rank that ``scores`` does the rest and gets records."""
    device = hidden.device
    rows = torch.from_numpy(plan.batch_rows).to(device)
    targets = torch.from_numpy(plan.target_token_ids).to(device)
    max_k = max(plan.num_logprobs)
    parts: list[SamplerOutput] = []
    for lo in range(0, rows.numel(), max(max_rows, 1)):
        sl = slice(lo, lo + max(max_rows, 1))
        logits = model.compute_logits(hidden.index_select(0, rows[sl]))
        if scores:
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            parts.append(gather_logprobs(logprobs, targets[sl], max_k))
        del logits
    if not scores:
        return {}
    merged = SamplerOutput(
        sampled_token_ids=targets,
        logprobs_token_ids=torch.cat([_present(p.logprobs_token_ids) for p in parts]),
        logprobs=torch.cat([_present(p.logprobs) for p in parts]),
        sampled_token_ranks=torch.cat([_present(p.sampled_token_ranks) for p in parts]),
    )
    _, records = merged.to_host(list(plan.num_logprobs))  # one device->host copy
    out: dict[str, PromptLogprobs] = {}
    offset = 0
    for req_id, first, count in plan.spans:
        chunk = [r for r in records[offset:offset + count] if r is not None]
        assert len(chunk) == count
        out[req_id] = PromptLogprobs(start=first, records=chunk)
        offset += count
    return out


def _present(t: torch.Tensor | None) -> torch.Tensor:
    assert t is not None
    return t
