"""Draft-model proposals (``--speculative-config '{"method": "draft_model", "model": ...}'``).

A smaller model sharing the target's tokenizer proposes ``k`` tokens greedily. It keeps its own
paged KV cache with as many blocks as the target's, addressed by the target's block ids: the
scheduler's allocation serves both models, and a request's draft K/V live in the draft cache at
exactly the slots its target K/V use in the target cache.

Per request the proposer remembers how many of its tokens have right K/V in the draft cache
(``_DraftState.num_computed``). A call runs, for all requests in one flat batch, a catch-up
forward over the tokens from there to the last known one (the whole prompt the first time) and
takes the argmax at the last position as draft 1; then ``k - 1`` one-token forwards (the decode
path) give drafts 2..k. Those forwards write K/V of drafts 1..k-1 past the known tokens. The
K/V at a position depend only on the tokens up to it, so next time the drafts the target
accepted (the known tokens that equal them, from the first on) keep theirs: the catch-up starts
at the first rejected draft, whose slot the target's token overwrites. After a step that
accepted some drafts it is one token, like any decode.

Slots: the last of those writes is at position ``num_tokens + k - 2``. Right after a step that
verified ``s`` drafts and accepted all of them, ``num_tokens`` is one past the last position
that step scheduled, so the scheduler must allocate ``k`` slots past its scheduled tokens
(``num_lookahead_slots``). A request whose slots fall short (near max_model_len) gets fewer
drafts; one whose last known token has no slot yet gets none this time.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from pagellm.config import EngineConfig, check_model_shape
from pagellm.core.kv_cache_groups import KVCacheLayout
from pagellm.forward_context import set_forward_context
from pagellm.models.llama_cpu_fused import enable_fused_cpu_forward
from pagellm.spec_decode.config import SpeculativeConfig
from pagellm.worker.flat_batch import flat_positions, paged_attention_metadata
from pagellm.worker.input_batch import CachedRequestState, InputBatch
from pagellm.worker.kv_cache import (
    allocate_kv_caches,
    allocate_kv_quant,
    config_kv_bytes_per_token,
    kv_cache_bytes,
    kv_quant_bytes,
    layer_kv_scales,
)
from pagellm.worker.runner_model import load_runner_model

logger = logging.getLogger("pagellm")

FLAG = "--speculative-config"


@dataclass(slots=True)
class _DraftState:
    """What the draft cache holds for one request."""

    num_computed: int  # tokens whose K/V are right (all known)
    lookahead: list[int]  # the drafts whose K/V follow them (right where they were accepted)


@dataclass(slots=True)
class _Pending:
    """One request in a propose call."""

    index: int  # in the call's ``states``
    row: int  # of the persistent batch
    computed: int  # tokens with trusted K/V in the draft cache
    num_tokens: int  # known tokens
    num_drafts: int  # drafts it gets (k, or fewer where its slots end)


def draft_engine_config(target: EngineConfig, model: str | None,
                        dtype: torch.dtype) -> EngineConfig:
    """The target's config with the draft model in place of the model (same cache, scheduler,
    device and parallel settings): what loading the draft and sizing its cache need. Refuses
    a draft that cannot share the target's tokenizer and block tables."""
    from pagellm.models.loader import load_hf_config, resolve_model_source

    if not model:
        raise ValueError(f"{FLAG}: method 'draft_model' needs the key 'model': the path of a "
                         "draft model sharing the target's tokenizer.")
    from pagellm.models.registry import get_model_cls

    try:
        source = resolve_model_source(model)
        hf_config = load_hf_config(source)
        check_model_shape(hf_config)
        get_model_cls(hf_config)  # an architecture pagellm runs
    except (ValueError, OSError) as e:
        raise ValueError(f"{FLAG}: key 'model' {model!r}: {e}") from None
    vocab, target_vocab = int(hf_config.vocab_size), target.model.vocab_size
    if vocab != target_vocab:
        raise ValueError(
            f"{FLAG}: key 'model' {model!r}: the draft model's vocabulary has {vocab} tokens, "
            f"the target's {target_vocab}; a draft model must share the target's tokenizer.")
    # A draft checkpoint is loaded the way its files say; random weights when the target's are
    # (tests and shape-only benchmarks).
    load_format = "dummy" if target.model.load_format == "dummy" else "auto"
    draft = dataclasses.replace(target.model, model=model, source=source, hf_config=hf_config,
                                dtype=dtype, load_format=load_format, generation_config=None)
    return dataclasses.replace(target, model=draft)


def draft_block_table_group(target: KVCacheLayout, draft: KVCacheLayout, model: str) -> int:
    """The target's KV cache group whose block table the draft writes through: the first full
    attention one (a windowed group frees blocks behind its window, which the draft's catch-up
    over a whole prompt would write)."""
    if draft.num_groups > 1:
        raise ValueError(f"{FLAG}: key 'model' {model!r}: the draft model keeps KV in "
                         f"{draft.num_groups} cache groups (sliding-window and full attention "
                         "layers); a draft model needs one.")
    for index, group in enumerate(target.groups):
        if group.sliding_window is None:
            return index
    raise ValueError(f"{FLAG}: the target model has only sliding-window attention layers; a "
                     "draft model needs the target's full-length block tables.")


class DraftModelProposer:
    """Greedy drafts from a smaller model over its own paged KV cache (see the module doc)."""

    def __init__(self, engine_config: EngineConfig, spec_config: SpeculativeConfig,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.num_speculative_tokens = int(spec_config.num_speculative_tokens)
        self.config = draft_engine_config(engine_config, spec_config.model, dtype)
        self.device = torch.device(device)
        self.dtype = dtype
        self.block_size = engine_config.cache.block_size
        self.max_model_len = engine_config.model.max_model_len
        self.max_num_batched_tokens = engine_config.scheduler.max_num_batched_tokens
        model_name = str(spec_config.model)
        layout = self.config.model.kv_cache_layout()
        self.table_group = draft_block_table_group(engine_config.model.kv_cache_layout(),
                                                   layout, model_name)
        self._attention_backend = engine_config.device.attention_backend
        self._layout = layout
        start = time.perf_counter()
        self.model: torch.nn.Module | None = self._load()
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        logger.info("Loaded draft model %s (%s) in %.1f s: %.1f MiB of weights",
                    model_name, self.config.model.architecture, time.perf_counter() - start,
                    self.weight_bytes / 2**20)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        # The draft cache follows the target's --kv-cache-dtype (its config's cache is the
        # target's): the scales of an 8-bit one, else None.
        self.kv_quant: list | None = None
        self.num_blocks = 0
        self.requests: dict[str, _DraftState] = {}

    # ---- the Proposer protocol ----------------------------------------------------------------
    @property
    def num_lookahead_slots(self) -> int:
        # k, not k - 1: after a step that accepted every draft, the known tokens already end
        # one past the step's scheduled ones (the module doc works it out).
        return self.num_speculative_tokens

    @property
    def kv_bytes_per_token(self) -> int:
        """The draft cache's bytes per block-table slot (added to the target's when the KV
        budget is split into blocks, so one budget bounds both caches)."""
        return config_kv_bytes_per_token(self.config)

    def initialize(self, num_blocks: int) -> None:
        self.kv_caches = allocate_kv_caches(self.config, num_blocks, self.device, self.dtype)
        self.kv_quant = allocate_kv_quant(self.config, num_blocks, self.device,
                                          layer_kv_scales(self.model))
        self.num_blocks = num_blocks
        self.requests.clear()
        per_token = self.kv_bytes_per_token
        logger.info("Draft model KV cache: %d blocks of %d tokens, %d bytes/token, %.1f MiB",
                    num_blocks, self.block_size, per_token,
                    per_token * self.block_size * (num_blocks + 2) / 2**20)

    def remove_request(self, req_id: str) -> None:
        self.requests.pop(req_id, None)

    # ---- sleep mode (worker/sleep.py does the same for the target) ----------------------------
    def sleep(self, level: int) -> int:
        """Free the draft cache and, at level 2, the draft's weights; returns the bytes freed.
        The engine sleeps only when idle, so no request's draft K/V are lost."""
        freed = kv_cache_bytes(self.kv_caches) + kv_quant_bytes(self.kv_quant)
        self.kv_caches = []
        self.kv_quant = None
        self.requests.clear()
        if level == 2 and self.model is not None:
            freed += self.weight_bytes
            self.model = None
        elif self.model is not None:
            enable_fused_cpu_forward(self.model)  # a fresh fused step: the old one's held KV
        return freed

    def wake_up(self) -> None:
        """Bring back what ``sleep`` freed: the weights from the draft's checkpoint and a cache
        of as many blocks as before."""
        if self.model is None:
            self.model = self._load()
        else:
            enable_fused_cpu_forward(self.model)
        if not self.kv_caches:
            self.initialize(self.num_blocks)

    def _load(self) -> torch.nn.Module:
        return load_runner_model(self.config.model, self.device, self._attention_backend,
                                 self._layout)

    @torch.inference_mode()
    def propose(self, batch: InputBatch, states: list[CachedRequestState],
                num_tokens: int) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in states]
        k = min(num_tokens, self.num_speculative_tokens)
        if k <= 0 or not self.kv_caches:
            return drafts
        pending = self._plan(batch, states, k)
        if not pending:
            return drafts
        table = (batch.block_table if self.table_group == 0
                 else batch.group_block_tables[self.table_group - 1])
        first = self._catch_up(batch, table, pending)
        steps = self._decode(table, pending, first, k)
        # One device -> host copy for every draft of the call.
        flat = torch.cat([tokens for _, tokens in steps]).tolist()
        offset = 0
        for members, _ in steps:
            for p in members:
                drafts[p.index].append(flat[offset])
                offset += 1
        for p in pending:
            # Drafts 1..n-1 went through the draft model: their K/V follow the known tokens.
            self.requests[states[p.index].req_id] = _DraftState(
                p.num_tokens, drafts[p.index][:p.num_drafts - 1])
        return drafts

    # ---- one call's forwards --------------------------------------------------------------
    def _plan(self, batch: InputBatch, states: list[CachedRequestState],
              k: int) -> list[_Pending]:
        """The requests that get drafts, and how many each (bounded by its allocated slots:
        draft j needs K/V up to position num_tokens + j - 2, and max_model_len)."""
        bs, max_len = self.block_size, self.max_model_len
        pending: list[_Pending] = []
        for index, s in enumerate(states):
            known = s.num_tokens
            slots = min(s.num_blocks * bs, max_len)
            n = min(k, slots - known + 1, max_len - known)
            if n <= 0:
                continue
            state = self.requests.get(s.req_id)
            computed = 0 if state is None else _num_right(batch, s.row, state, known - 1)
            pending.append(_Pending(index, s.row, computed, known, n))
        return pending

    def _catch_up(self, batch: InputBatch, table: np.ndarray,
                  pending: list[_Pending]) -> torch.Tensor:
        """Run every request's tokens from its computed ones to its last known one (forwards of
        at most max_num_batched_tokens tokens); return draft 1 of each (``pending`` order)."""
        budget = self.max_num_batched_tokens
        firsts: list[torch.Tensor] = []
        todo = list(pending)
        while todo:
            chunk: list[tuple[_Pending, int]] = []
            used = 0
            for p in todo:
                take = min(p.num_tokens - p.computed, budget - used)
                if take <= 0:
                    break
                chunk.append((p, take))
                used += take
            rows = np.fromiter((p.row for p, _ in chunk), dtype=np.int64, count=len(chunk))
            computed = np.fromiter((p.computed for p, _ in chunk), dtype=np.int64,
                                   count=len(chunk))
            num_sched = np.fromiter((n for _, n in chunk), dtype=np.int64, count=len(chunk))
            hidden, cu = self._forward(table, rows, computed, num_sched, batch, None)
            done = computed + num_sched >= np.fromiter(
                (p.num_tokens for p, _ in chunk), dtype=np.int64, count=len(chunk))
            if done.any():
                idx = torch.from_numpy(cu[1:][done] - 1).to(self.device, non_blocking=True)
                logits = self.model.compute_logits(hidden.index_select(0, idx))
                firsts.append(logits.argmax(dim=-1))
            for p, n in chunk:
                p.computed += n
            todo = [p for p in todo if p.computed < p.num_tokens]
        return torch.cat(firsts)

    def _decode(self, table: np.ndarray, pending: list[_Pending], first: torch.Tensor,
                k: int) -> list[tuple[list[_Pending], torch.Tensor]]:
        """Drafts 2..k: one-token forwards of the previous draft of every request that gets
        another. Returns each step's (requests, their drafts), draft 1 first."""
        steps = [(pending, first)]
        members, tokens = pending, first
        for j in range(1, k):
            active = [i for i, p in enumerate(members) if p.num_drafts > j]
            if not active:
                break
            if len(active) < len(members):
                tokens = tokens.index_select(
                    0, torch.tensor(active, dtype=torch.long, device=self.device))
                members = [members[i] for i in active]
            rows = np.fromiter((p.row for p in members), dtype=np.int64, count=len(members))
            # Draft j sits at position num_tokens + j - 1.
            computed = np.fromiter((p.num_tokens + j - 1 for p in members), dtype=np.int64,
                                   count=len(members))
            hidden, _ = self._forward(table, rows, computed, np.ones_like(computed), None,
                                      tokens)
            tokens = self.model.compute_logits(hidden).argmax(dim=-1)
            steps.append((members, tokens))
        return steps

    def _forward(self, table: np.ndarray, rows: np.ndarray, num_computed: np.ndarray,
                 num_sched: np.ndarray, batch: InputBatch | None,
                 input_ids: torch.Tensor | None) -> tuple[torch.Tensor, np.ndarray]:
        """Hidden states of one flat batch (its token ids from ``batch``'s rows unless given)
        over the draft cache, and its cu_seqlens."""
        dev = self.device
        cu, token_seq, positions = flat_positions(num_computed, num_sched)
        token_rows = rows[token_seq]
        if input_ids is None:
            assert batch is not None
            input_ids = torch.from_numpy(batch.token_ids[token_rows, positions]).to(
                dev, non_blocking=True)
        # The draft cache's blocks are not zeroed when handed out: attention must mask.
        meta = paged_attention_metadata(table, rows, token_rows, positions, cu, num_sched,
                                        num_computed + num_sched, self.block_size, dev,
                                        padding_is_zero=False)
        with set_forward_context(meta, self.kv_caches, self.kv_quant):
            hidden = self.model(input_ids, torch.from_numpy(positions).to(dev, non_blocking=True))
        return hidden, cu


def _num_right(batch: InputBatch, row: int, state: _DraftState, limit: int) -> int:
    """Tokens of ``row`` whose draft K/V are right: those computed, then the lookahead drafts
    the known tokens agree with; at most ``limit`` (the last known token always runs)."""
    computed = min(state.num_computed, limit)
    n = min(len(state.lookahead), limit - computed)
    if n > 0 and computed == state.num_computed:
        same = batch.token_ids[row, computed:computed + n] == state.lookahead[:n]
        computed += n if same.all() else int(same.argmin())
    return computed
