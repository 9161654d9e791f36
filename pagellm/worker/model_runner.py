"""The model runner: SchedulerOutput -> one flat, unpadded batch -> forward -> sampled tokens."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import numpy as np
import torch

from pagellm.attention.backend import AttentionMetadata
from pagellm.config import EngineConfig
from pagellm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagellm.distributed.communication import all_reduce_min, broadcast_from_rank0
from pagellm.distributed.parallel_state import get_tp_rank, get_tp_size
from pagellm.forward_context import set_forward_context
from pagellm.memory_plan import STATE_SNAPSHOT_SHARE
from pagellm.sample.bad_words import bad_words_mask
from pagellm.sample.grammar import grammar_rows
from pagellm.sample.logits_processors import LogitsProcessors, StepRow
from pagellm.sample.metadata import SamplingMetadata
from pagellm.sample.sampler import Sampler, SamplerOutput
from pagellm.spec_decode.runner import SpecDecodeRunner
from pagellm.worker.cuda_graphs import (
    GraphMemoryReserve,
    GraphRunner,
    build_graph_runner,
    planned_capture_sizes,
)
from pagellm.worker.flat_batch import flat_positions, paged_attention_metadata
from pagellm.worker.input_batch import CachedRequestState, InputBatch
from pagellm.worker.kv_cache import (
    allocate_kv_caches,
    allocate_kv_quant,
    layer_kv_scales,
    plan_for_device,
    zero_new_blocks,
)
from pagellm.worker.prompt_logprobs import (
    PromptLogprobsPlan,
    compute_prompt_logprobs,
    plan_prompt_logprobs,
)
from pagellm.worker.runner_model import load_runner_model
from pagellm.worker.state_cache import (
    allocate_state_caches,
    restore_state_snapshots,
    snapshot_layout,
    state_bytes_per_slot,
    step_state_metadata,
    uses_state_snapshots,
)

logger = logging.getLogger("pagellm")


@dataclasses.dataclass(slots=True)
class PreparedInputs:
    """One step's flat batch on the device, and which of its sequences sample."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    # The batch row of each sampling sequence's last token (the LM head's input rows).
    logits_indices: np.ndarray
    # Each sampling sequence's index in the step's request order.
    sample_rows: np.ndarray
    # Rows that score prompt tokens (SamplingParams.prompt_logprobs); None: no request asked.
    prompt_logprobs: PromptLogprobsPlan | None = None
    # Structured outputs: the step's GrammarBitmask (SchedulerOutput.grammar_bitmask), or None.
    grammar_bitmask: Any = None
    # Recurrent layers' slots (models with such layers), or None.
    state_metadata: Any = None  # attention/state_metadata.StateMetadata


class ModelRunner:
    def __init__(self, config: EngineConfig, eos_token_id: int | None = None) -> None:
        from pagellm.attention import registry
        from pagellm.models.lazy_tensor import checkpoint_bytes_read

        self.config = config
        self.device = config.device.device
        self.dtype = config.model.dtype
        self.block_size = config.cache.block_size
        self.eos_token_id = eos_token_id
        self.vocab_size = config.model.vocab_size
        # KV cache groups (core/kv_cache_groups.py): one for most models; full and
        # sliding-window layers apart for hybrid ones (one block table per group).
        self.kv_layout = config.model.kv_cache_layout()
        self.attention_backend = config.device.attention_backend
        # Whether new blocks are zeroed (and attention told padding reads 0): only for
        # backends that gather whole blocks.
        self.zero_new_blocks = registry.get_attn_backend_cls(
            self.attention_backend, self.device).needs_zeroed_blocks(self.dtype)
        # This engine's noise for unseeded random sampling (torch's global generator would be
        # shared with, and reseeded by, any other engine in the process).
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(config.model.seed)
        # Tensor parallelism: every rank runs the forward; only rank 0 samples (see _sample).
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        read_before = checkpoint_bytes_read()
        start = time.perf_counter()
        self.model = self.load_model()
        self.load_seconds = time.perf_counter() - start
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.checkpoint_bytes_read = checkpoint_bytes_read() - read_before
        rank = f" (tp rank {self.tp_rank}/{self.tp_size})" if self.tp_size > 1 else ""
        logger.info("Loaded %s in %.1f s: %.1f MiB of weights as %s on %s%s; read %.1f MiB of "
                    "checkpoint", config.model.architecture, self.load_seconds,
                    self.weight_bytes / 2**20, str(self.dtype).removeprefix("torch.")
                    + (f" ({config.model.quantization} linears)" if config.model.quantization
                       else ""),
                    self.device, rank, self.checkpoint_bytes_read / 2**20)
        sched = config.scheduler
        self.input_batch = InputBatch(sched.max_num_seqs, sched.max_model_len, self.block_size,
                                      self.vocab_size, self.device, samples=self.tp_rank == 0)
        self.input_batch.set_num_kv_groups(self.kv_layout.num_groups)
        self.sampler = Sampler(self.generator)
        # --logits-processors plugins, on the rank that samples; None without the flag.
        self.logits_processors = (LogitsProcessors(config.logits_processors, config,
                                                   self.device)
                                  if config.logits_processors and self.tp_rank == 0 else None)
        # Speculative decoding (--speculative-config; spec_decode/runner.py), None when off.
        self.spec_decode = (SpecDecodeRunner(config, self.generator, _step_seed, eos_token_id,
                                             self.tp_rank, self.tp_size)
                            if config.speculative_config is not None else None)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        # Per layer, the scales of an 8-bit --kv-cache-dtype (attention/kv_quant.py); None else.
        self.kv_quant: list | None = None
        # Recurrent layers' state slots by layer index (worker/state_cache.py); empty else.
        self.state_caches: dict[int, tuple[torch.Tensor, ...]] = {}
        self.num_state_slots = 0  # running + snapshot slots (scratch slot not counted)
        self.num_blocks = 0
        self.graph_runner: GraphRunner | None = None  # decode CUDA graphs (initialize_kv_cache)
        self.sleep_level = 0  # 0 awake; 1 KV cache freed; 2 KV cache and weights freed
        # A weight update staged and not yet committed or rolled back (stage_weights).
        self._weight_backup: Any = None
        self._weight_update_status = "unchanged"

    def load_model(self) -> torch.nn.Module:
        """The model from its checkpoint, in the layouts the kernels read (start-up and
        ``wake_up`` after ``sleep(level=2)``)."""
        return load_runner_model(self.config.model, self.device, self.attention_backend,
                                 self.kv_layout)

    # ---- KV cache -------------------------------------------------------------------------
    def initialize_kv_cache(self) -> int:
        """Plan the KV budget for this device, refuse configurations that cannot serve one request
        of max_model_len, allocate the per-layer caches and return the number of blocks."""
        graph_sizes = planned_capture_sizes(self.config, self.tp_size)
        if self.kv_layout.num_groups > 1 and graph_sizes:
            # The graphs replay one block table per step.
            logger.info("Decode CUDA graphs are off: the model keeps KV in %d groups",
                        self.kv_layout.num_groups)
            graph_sizes = []
        if self.kv_layout.state_layers and graph_sizes:
            logger.info("Decode CUDA graphs are off: the model has recurrent layers")
            graph_sizes = []
        num_slots = self.config.num_state_slots
        state_bytes = (state_bytes_per_slot(self.config, self.dtype) * (num_slots + 1)
                       if num_slots else 0)
        share = STATE_SNAPSHOT_SHARE if uses_state_snapshots(self.config) else 0.0
        reserve = GraphMemoryReserve(graph_sizes, self.config.scheduler.max_num_batched_tokens)
        start = time.perf_counter()
        # A draft model's weights and KV (spec_decode/draft_model.py) share the budget.
        proposer = self.spec_decode.proposer if self.spec_decode is not None else None
        plan = plan_for_device(self.config,
                               self.weight_bytes + (proposer.weight_bytes if proposer else 0),
                               self._profile_peak_activation, reserve if graph_sizes else None,
                               proposer.kv_bytes_per_token if proposer else 0, state_bytes,
                               share)
        profile_seconds = time.perf_counter() - start
        if self.tp_size > 1:
            # Ranks may measure different free memory; the scheduler has one block pool.
            agreed = all_reduce_min(plan.num_blocks, self.device)
            if agreed != plan.num_blocks:
                logger.info("tp rank %d: %d KV blocks -> %d (the smallest rank's)",
                            self.tp_rank, plan.num_blocks, agreed)
                plan = dataclasses.replace(plan, num_blocks=agreed)
        start = time.perf_counter()
        self.kv_caches = allocate_kv_caches(self.config, plan.num_blocks, self.device, self.dtype)
        self.kv_quant = allocate_kv_quant(self.config, plan.num_blocks, self.device,
                                          layer_kv_scales(self.model))
        # Running sequences' slots, then the prefix-cache snapshots' (state_cache.py).
        self.num_state_slots = num_slots + snapshot_layout(self.config, plan.num_blocks)[0]
        self.state_caches = allocate_state_caches(self.config, self.num_state_slots,
                                                  self.device, self.dtype)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        kv_seconds = time.perf_counter() - start
        self.input_batch.set_null_block(plan.num_blocks)
        self.num_blocks = plan.num_blocks
        if self.spec_decode is not None:
            self.spec_decode.initialize(plan.num_blocks)
        self.kv_plan = plan
        self._graph_plan = (graph_sizes, reserve.reserved_bytes)  # for wake_up's re-capture
        self.capture_graphs()
        logger.info("Start-up phases: load %.2f s, memory profile %.2f s, KV allocation %.2f s, "
                    "CUDA graph capture %.2f s", self.load_seconds, profile_seconds, kv_seconds,
                    self.graph_runner.capture_seconds if self.graph_runner else 0.0)
        return plan.num_blocks

    def capture_graphs(self) -> None:
        """Capture the decode CUDA graphs (if on): after the KV cache exists, as the graphs
        hold its addresses."""
        sizes, reserved = self._graph_plan
        self.graph_runner = build_graph_runner(self.config, self.model, self.kv_caches,
                                               self.num_blocks, sizes, reserved, self.kv_quant)

    def sleep(self, level: int) -> int:
        """Free the KV cache (and at level 2 the weights); see worker/sleep.py."""
        from pagellm.worker.sleep import sleep_runner

        return sleep_runner(self, level)

    def wake_up(self) -> int:
        from pagellm.worker.sleep import wake_runner

        return wake_runner(self)

    @torch.inference_mode()
    def _profile_peak_activation(self) -> int:
        """Peak activation bytes of a forward over max_num_batched_tokens tokens (CUDA only)."""
        n = self.config.scheduler.max_num_batched_tokens
        input_ids = torch.zeros(n, dtype=torch.long, device=self.device)
        positions = torch.arange(n, device=self.device) % self.config.model.max_model_len
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        with set_forward_context(None, [], state_caches=self.state_caches or None):
            hidden = self.model(input_ids, positions)
            logits = self.model.compute_logits(hidden[-self.config.scheduler.max_num_seqs:])
            self.sampler.greedy(logits)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        del hidden, logits
        torch.cuda.empty_cache()
        return int(peak)

    # ---- one step -----------------------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> None:
        batch = self.input_batch
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            batch.remove_request(req_id)
        for new in so.scheduled_new_reqs:
            batch.remove_request(new.req_id)  # resumed after preemption: start over
            params = new.sampling_params
            gen = None
            if params.seed is not None:
                gen = torch.Generator(device=self.device)
            batch.add_request(new.req_id, new.prompt_token_ids, new.output_token_ids, params,
                              new.block_ids, new.num_computed_tokens, gen, new.group_block_ids,
                              new.state_slot)
        cached = so.scheduled_cached_reqs
        group_ids = cached.new_group_block_ids or [None] * len(cached.req_ids)
        for req_id, block_ids, num_computed, groups in zip(
                cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, group_ids,
                strict=True):
            state = batch.requests[req_id]
            batch.append_blocks(state, block_ids, groups)
            state.num_computed_tokens = num_computed
        if self.spec_decode is not None:
            self.spec_decode.update_states(so, batch)
        restores = [(n.state_restore_slot, n.state_slot) for n in so.scheduled_new_reqs
                    if n.state_restore_slot >= 0]
        if restores and self.state_caches:
            restore_state_snapshots(self.state_caches, restores, self.device)
        if self.zero_new_blocks:
            zero_new_blocks(self.kv_caches, so, self.block_size, self.device)

    def _prepare_inputs(self, so: SchedulerOutput, states: list[CachedRequestState]
                        ) -> PreparedInputs:
        batch = self.input_batch
        bs = self.block_size
        rows = np.fromiter((s.row for s in states), dtype=np.int64, count=len(states))
        num_sched = np.fromiter((so.num_scheduled_tokens[s.req_id] for s in states),
                                dtype=np.int64, count=len(states))
        num_computed = np.fromiter((s.num_computed_tokens for s in states), dtype=np.int64,
                                   count=len(states))
        cu, token_req, positions = flat_positions(num_computed, num_sched)
        assert int(cu[-1]) == so.total_num_scheduled_tokens
        token_rows = rows[token_req]
        input_ids = batch.token_ids[token_rows, positions]
        seq_lens = num_computed + num_sched
        # A request samples only when this step reaches the end of its known tokens.
        num_tokens = np.fromiter((s.num_tokens for s in states), dtype=np.int64,
                                 count=len(states))
        sample_mask = seq_lens >= num_tokens
        logits_indices = cu[1:][sample_mask] - 1
        prompt_plan = None
        if any(s.sampling_params.prompt_logprobs is not None for s in states):
            prompt_plan = plan_prompt_logprobs(states, num_computed, num_sched, cu,
                                               batch.token_ids)

        dev = self.device
        meta = paged_attention_metadata(batch.block_table, rows, token_rows, positions, cu,
                                        num_sched, seq_lens, bs, dev, self.zero_new_blocks)
        if batch.group_block_tables:
            meta.group_metadata = [meta] + [
                self._group_metadata(meta, table, rows, token_rows, positions, meta.max_seq_len)
                for table in batch.group_block_tables]
        return PreparedInputs(
            input_ids=torch.from_numpy(input_ids).to(dev, non_blocking=True),
            positions=torch.from_numpy(positions).to(dev, non_blocking=True),
            attn_metadata=meta, logits_indices=logits_indices,
            sample_rows=np.nonzero(sample_mask)[0], prompt_logprobs=prompt_plan,
            grammar_bitmask=so.grammar_bitmask,
            state_metadata=step_state_metadata(so, [(s.req_id, s.state_slot) for s in states],
                                               meta.query_start_loc_cpu, num_computed)
            if self.state_caches else None)

    def _group_metadata(self, meta: AttentionMetadata, table: np.ndarray, rows: np.ndarray,
                        token_rows: np.ndarray, positions: np.ndarray,
                        max_seq_len: int) -> AttentionMetadata:
        """Group 0's metadata with another KV cache group's slots and block tables."""
        bs, dev = self.block_size, self.device
        slots = table[token_rows, positions // bs].astype(np.int64) * bs + positions % bs
        tables = np.ascontiguousarray(table[rows, : -(-max_seq_len // bs)])
        return dataclasses.replace(
            meta, slot_mapping=torch.from_numpy(slots).to(dev, non_blocking=True),
            block_tables=torch.from_numpy(tables).to(dev, non_blocking=True), step_plan=None,
            group_metadata=None)

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[], logprobs=[])
        batch = self.input_batch
        order = [n.req_id for n in so.scheduled_new_reqs] + so.scheduled_cached_reqs.req_ids
        states = [batch.requests[r] for r in order]
        inputs = self._prepare_inputs(so, states)
        verify = None
        if so.scheduled_spec_decode_tokens:
            assert self.spec_decode is not None
            # Verifying requests sample all their draft positions (the rejection sampler).
            verify, inputs.logits_indices, inputs.sample_rows = self.spec_decode.plan(
                so, states, inputs.attn_metadata.query_start_loc_cpu, inputs.logits_indices,
                inputs.sample_rows)
        hidden = self._forward(inputs)
        prompt_logprobs = {}
        if inputs.prompt_logprobs is not None:
            # Same forward as the prefill; slices no larger than a full sampling step's rows.
            prompt_logprobs = compute_prompt_logprobs(
                self.model, hidden, inputs.prompt_logprobs,
                self.config.scheduler.max_num_seqs, scores=self.tp_rank == 0)
        sampled: list[list[int]] = [[] for _ in states]
        logprobs: list = [None] * len(states)
        if len(inputs.logits_indices):
            self._sample_and_append(hidden, inputs, states, sampled, logprobs)
        if verify is not None:
            assert self.spec_decode is not None
            self.spec_decode.verify(self.model, hidden, verify, states, batch, sampled, logprobs)
        for state in states:
            state.num_computed_tokens += so.num_scheduled_tokens[state.req_id]
        spec_token_ids = (self.spec_decode.propose(batch, states, sampled)
                          if self.spec_decode is not None else {})
        return ModelRunnerOutput(req_ids=order, sampled_token_ids=sampled, logprobs=logprobs,
                                 prompt_logprobs=prompt_logprobs, spec_token_ids=spec_token_ids)

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> int:
        """Replace some or all weights in place, all or nothing on this rank; between steps only.
        Raises ValueError (refused, nothing changed) or WeightUpdateError (see stage_update in
        worker/weight_update.py). The engine uses stage_weights/end_weight_update instead, to
        commit or roll back every rank's update together."""
        n = self.stage_weights(weights)
        self.end_weight_update(commit=True)
        return n

    def stage_weights(self, weights: list[tuple[str, torch.Tensor]]) -> int:
        """The update loaded, its backup kept (memory: one copy of the parameters it touches)
        until ``end_weight_update``; raises as ``load_weights`` does, this rank's state then
        restored (or broken) already."""
        from pagellm.errors import WeightUpdateError
        from pagellm.worker.weight_update import stage_update

        self.end_weight_update(commit=True)  # one left over (a direct collective_rpc): keep it
        try:
            n, self._weight_backup = stage_update(self.model, weights)
        except WeightUpdateError as e:
            self._weight_update_status = "restored" if e.restored else "broken"
            raise
        finally:
            self._sync()  # the next step reads them
        self._weight_update_status = "staged"
        return n

    def end_weight_update(self, commit: bool) -> str:
        """Finish the update ``stage_weights`` began: commit (drop the backup) or roll it back.
        Returns this rank's state: "committed", "restored" (the previous weights again),
        "broken" (they could not be restored) or "unchanged" (nothing was staged or changed)."""
        backup, self._weight_backup = self._weight_backup, None
        status, self._weight_update_status = self._weight_update_status, "unchanged"
        if backup is None:
            return status  # failed here (restored or broken already), or nothing staged
        if commit:
            return "committed"
        try:
            backup.restore()
            self._sync()
        except Exception as e:
            logger.critical("tp rank %d: restoring the weights of an update another rank failed "
                            "did not work (%s: %s)", self.tp_rank, type(e).__name__, e,
                            exc_info=e)
            return "broken"
        return "restored"

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _forward(self, inputs: PreparedInputs) -> torch.Tensor:
        """Hidden states of the step's tokens: a replayed CUDA graph for a decode step that fits
        a bucket, else the model eagerly."""
        meta = inputs.attn_metadata
        if self.graph_runner is not None and self.graph_runner.can_run(meta):
            return self.graph_runner.run(inputs.input_ids, inputs.positions, meta)
        with set_forward_context(meta, self.kv_caches, self.kv_quant,
                                 self.state_caches or None, inputs.state_metadata):
            return self.model(inputs.input_ids, inputs.positions)

    def _sample_and_append(self, hidden: torch.Tensor, inputs: PreparedInputs,
                           states: list[CachedRequestState], sampled: list[list[int]],
                           logprobs: list) -> None:
        """Sample the sequences that reached the end of their known tokens, append each token
        to its request in the persistent batch, and fill their entries of ``sampled`` and
        ``logprobs`` (indexed like ``states``)."""
        idx = torch.from_numpy(inputs.logits_indices).to(self.device)
        logits = self.model.compute_logits(hidden.index_select(0, idx))
        sample_rows = inputs.sample_rows
        sample_states = [states[i] for i in sample_rows]
        out = (self._sample(logits, sample_states, inputs.grammar_bitmask)
               if self.tp_rank == 0 else None)
        if self.tp_size > 1:
            # Rank 0's tokens keep every rank's persistent batch identical.
            ids = (out.sampled_token_ids if out is not None else
                   torch.empty(len(sample_states), dtype=torch.long, device=self.device))
            ids = broadcast_from_rank0(ids)
        records: list = [None] * len(sample_states)
        if out is not None:
            # One device->host copy per step: the tokens and every row's logprobs together.
            tokens, records = out.to_host([s.sampling_params.logprobs for s in sample_states])
        else:
            tokens = ids.tolist()
        batch = self.input_batch
        for j, (i, state) in enumerate(zip(sample_rows.tolist(), sample_states, strict=True)):
            tok = int(tokens[j])
            batch.append_token(state, tok)
            sampled[i] = [tok]
            logprobs[i] = records[j]

    def _sample(self, logits: torch.Tensor, sample_states: list[CachedRequestState],
                grammar_bitmask: Any = None) -> SamplerOutput:
        for s in sample_states:
            if s.generator is not None:
                # Seeded noise depends only on (seed, output position): the same tokens
                # whatever the batch, and again after a preemption.
                s.generator.manual_seed(_step_seed(s.sampling_params.seed,
                                                   len(s.output_token_ids)))
        # Penalties and bias come from the persistent batch: no per-step work that grows with
        # a request's prompt or output.
        sampling = self.input_batch.sampling
        assert sampling is not None
        params = [s.sampling_params for s in sample_states]
        rows = np.fromiter((s.row for s in sample_states), dtype=np.int64,
                           count=len(sample_states))
        smeta = SamplingMetadata.assemble(
            params=params,
            num_output_tokens=[len(s.output_token_ids) for s in sample_states],
            generators=[s.generator for s in sample_states],
            eos_token_ids=[self.eos_token_id] * len(sample_states),
            vocab_size=self.vocab_size, device=self.device,
            penalties=sampling.penalty_tensors(rows, params),
            logit_bias=sampling.logit_bias(rows),
            allowed_tokens=sampling.allowed_mask(rows),
            bad_words=bad_words_mask([p.bad_words_token_ids for p in params],
                                     [s.output_token_ids for s in sample_states], self.device),
        )
        if grammar_bitmask is not None:
            smeta.grammar_bitmask = grammar_rows(grammar_bitmask, sample_states, self.device)
        if self.logits_processors is not None:
            smeta.logits_processors, smeta.argmax_invariant_processors = (
                self.logits_processors.step([self._step_row(s) for s in sample_states]))
        return self.sampler(logits, smeta)

    def _step_row(self, state: CachedRequestState) -> StepRow:
        token_ids = self.input_batch.token_ids
        return StepRow(state.req_id, state.sampling_params,
                       lambda: token_ids[state.row, :state.num_prompt_tokens].tolist(),
                       state.output_token_ids)


def _step_seed(seed: int | None, position: int) -> int:
    assert seed is not None
    return (seed * 1_000_003 + position * 7_919) % (2**63 - 1)
