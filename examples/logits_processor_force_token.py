"""An example --logits-processors plugin: a request that passes ``force_token_id`` in its
``vllm_xargs`` (SamplingParams.extra_args) only ever samples that token id.

    PYTHONPATH=examples pagellm serve MODEL \\
        --logits-processors logits_processor_force_token:ForceTokenProcessor
    curl .../v1/completions -d '{"prompt": "hi", "vllm_xargs": {"force_token_id": 42}}'

The interface is vLLM V1's (pagellm/sample/logits_processors.py, docs/serving.md).
"""

from __future__ import annotations

from typing import Any

import torch

from pagellm.sample.logits_processors import BatchUpdate, LogitsProcessor


class ForceTokenProcessor(LogitsProcessor):
    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.vocab_size = int(vllm_config.model.vocab_size)
        self.forced: dict[int, int] = {}  # row -> token id

    def is_argmax_invariant(self) -> bool:
        return False  # it decides the argmax of greedy rows too

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index, params, _, _ in batch_update.added:
            token = (params.extra_args or {}).get("force_token_id")
            if isinstance(token, int) and 0 <= token < self.vocab_size:
                self.forced[index] = token
            else:
                self.forced.pop(index, None)  # the row's new request forces nothing
        for index in batch_update.removed:
            self.forced.pop(index, None)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.forced:
            return logits
        rows = torch.tensor(list(self.forced), dtype=torch.long, device=logits.device)
        tokens = torch.tensor(list(self.forced.values()), dtype=torch.long, device=logits.device)
        kept = logits[rows, tokens]
        logits[rows] = float("-inf")
        logits[rows, tokens] = kept
        return logits
