"""CUDA graphs for decode-only steps, replayed from static buffers padded to a batch-size bucket.

A decode-only step (every sequence schedules exactly one token) of ``B`` sequences runs on the
graph of the smallest bucket ``>= B`` (buckets: 1, 2, 4, 8, then multiples of 8 up to
``max_num_seqs``, which is always a bucket itself). What is captured: the model forward from the
embedding to the final norm (every layer's K/V store and paged attention included), ending in a
copy into one static output buffer. The LM head runs eagerly on the rows that sample, like vLLM:
capturing it would mean computing (and reserving ``bucket x vocab`` float32 logits for) padded
rows that are never sampled. Mixed or prefill steps, and decode steps above the largest bucket,
run eagerly.

Padding rows (``B .. bucket - 1``) take token 0 at position 0 with ``seq_len`` 1. Their K/V go
to the *scratch block* (``num_blocks + 1``), which no block table ever names, and their block
tables name the null block (``num_blocks``, always zero), so they neither write where a real
sequence reads nor read anything but zeros (no NaN/inf; their outputs are finite and never
sampled). Every per-step host decision of the forward is fixed per bucket at capture: the
metadata of a bucket has ``num_tokens = num_seqs = bucket``, ``max_query_len`` 1,
``max_seq_len`` = ``max_model_len`` (an upper bound: the kernels mask by the ``seq_lens`` tensor)
and host lists sized to the bucket, so e.g. the Triton backend's key-segment count is chosen once
per bucket.

On CPU (and with ``--enforce-eager``, tensor parallelism, or a backend that is not capture-safe)
the engine builds no ``GraphRunner``. Tests build one with ``use_cuda_graphs=False``: ``capture``
is then a no-op and a step runs the same function eagerly on the same padded static buffers.
"""

from __future__ import annotations

import bisect
import gc
import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagellm.attention.backend import AttentionMetadata
from pagellm.forward_context import set_forward_context

if TYPE_CHECKING:
    from pagellm.config import EngineConfig

logger = logging.getLogger("pagellm")

# Above this many sequences a step's launch overhead is small next to its work (vLLM's cap too).
MAX_CAPTURE_SIZE = 512
# Device memory per captured graph outside the pool (driver-side executable graph): an assumed
# figure until measured on a GPU (scripts/gpu_check.py prints the estimate beside the measurement).
GRAPH_OVERHEAD_BYTES = 2 << 20
# Only backends whose forward reads no tensor data on the host and builds no tensors from host
# lists for a decode step (the torch backend does, for >= 16 sequences, to bucket lengths).
CAPTURE_SAFE_BACKENDS = ("triton",)


def capture_sizes(max_num_seqs: int, max_size: int = MAX_CAPTURE_SIZE) -> list[int]:
    """Bucket sizes: 1, 2, 4, 8, 16, 24, ... up to min(max_num_seqs, max_size), which is added
    when it is not a multiple of 8, so that every decode step the scheduler can form fits."""
    limit = min(max_num_seqs, max_size)
    if limit < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = [s for s in (1, 2, 4) if s <= limit] + list(range(8, limit + 1, 8))
    if sizes[-1] != limit:
        sizes.append(limit)
    return sizes


def bucket_for(sizes: list[int], num_seqs: int) -> int | None:
    """The smallest bucket >= num_seqs (``sizes`` ascending), or None when above them all."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


def estimate_graph_memory(activation_bytes: int, num_profiled_tokens: int,
                          sizes: list[int]) -> int:
    """Device memory to reserve for the graphs before the KV cache is sized (an estimate; the
    capture measures the real figure and logs both).

    The graphs share one pool captured largest-first, so the pool holds about one forward of the
    largest bucket: activations scale with tokens, so the profiled peak of
    ``num_profiled_tokens`` is scaled to that bucket (which over-counts the profile's logits and
    causal attention a little). Each graph also costs ``GRAPH_OVERHEAD_BYTES`` outside the pool.
    """
    if not sizes:
        return 0
    pool = -(-activation_bytes * max(sizes) // max(num_profiled_tokens, 1))
    return int(pool + len(sizes) * GRAPH_OVERHEAD_BYTES)


def graphs_off_reason(config: EngineConfig, tp_size: int) -> str | None:
    """Why this engine runs decode eagerly, or None when it captures CUDA graphs."""
    from pagellm.attention.registry import get_attn_backend_cls

    device = config.device.device
    if config.enforce_eager:
        return "--enforce-eager"
    if device.type != "cuda":
        return f"device {device} (CUDA graphs need a CUDA device)"
    if tp_size > 1:
        return "tensor parallelism (collectives are not captured)"
    name = get_attn_backend_cls(config.device.attention_backend, device).name
    if name not in CAPTURE_SAFE_BACKENDS:
        return f"attention backend {name!r} is not capture-safe"
    return None


def planned_capture_sizes(config: EngineConfig, tp_size: int) -> list[int]:
    """The buckets this engine will capture ([] when graphs are off, logging why)."""
    reason = graphs_off_reason(config, tp_size)
    if reason is not None:
        logger.info("CUDA graphs off: %s", reason)
        return []
    return capture_sizes(config.scheduler.max_num_seqs)


@dataclass(slots=True)
class GraphMemoryReserve:
    """For the memory plan: peak activation bytes -> bytes reserved for the graphs (remembered in
    ``reserved_bytes``, so the capture can log its measurement beside it)."""

    sizes: list[int]
    num_profiled_tokens: int
    reserved_bytes: int = 0

    def __call__(self, activation_bytes: int) -> int:
        self.reserved_bytes = estimate_graph_memory(activation_bytes, self.num_profiled_tokens,
                                                    self.sizes)
        return self.reserved_bytes


class GraphRunner:
    """Decode-only steps on static buffers padded to a bucket: replayed CUDA graphs, or (with
    ``use_cuda_graphs=False``) the same forward run eagerly on the same buffers.

    ``run`` returns hidden states of the real rows, a view of a static buffer that the next step
    overwrites.
    """

    def __init__(self, model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 sizes: list[int], *, max_model_len: int, block_size: int, null_block_id: int,
                 scratch_block_id: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device, use_cuda_graphs: bool) -> None:
        if use_cuda_graphs and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        self.model = model
        self.kv_caches = kv_caches
        self.kv_quant: list | None = None  # an 8-bit cache's scales (attention/kv_quant.py)
        self.sizes = sorted(sizes)
        self.max_model_len = max_model_len
        self.null_block_id = null_block_id
        self.pad_slot = scratch_block_id * block_size
        self.use_cuda_graphs = use_cuda_graphs
        self.device = device
        n = self.sizes[-1]
        blocks_per_seq = -(-max_model_len // block_size)
        i64 = dict(dtype=torch.long, device=device)
        i32 = dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(n, **i64)
        self.positions = torch.zeros(n, **i64)
        self.slot_mapping = torch.full((n,), self.pad_slot, **i64)
        self.seq_lens = torch.ones(n, **i32)
        self.query_start_loc = torch.arange(n + 1, **i32)  # one token per sequence, always
        self.block_tables = torch.full((n, blocks_per_seq), null_block_id, **i32)
        self._table_width = 0
        self.output = torch.zeros(n, hidden_size, dtype=dtype, device=device)
        self.metas = {s: self._bucket_metadata(s) for s in self.sizes}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.num_steps: Counter[int] = Counter()  # bucket -> steps run on it
        self.capture_seconds = 0.0
        self.graph_memory_bytes = 0  # measured by capture()
        self.reserved_bytes = 0  # what the memory plan set aside (build_graph_runner)

    def _bucket_metadata(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            num_tokens=size, num_seqs=size, slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_start_loc[: size + 1], seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size], max_query_len=1,
            max_seq_len=self.max_model_len, query_start_loc_cpu=list(range(size + 1)),
            seq_lens_cpu=[self.max_model_len] * size, is_decode_only=True, padding_is_zero=True)

    def can_run(self, meta: AttentionMetadata) -> bool:
        return meta.is_decode_only and meta.num_seqs <= self.sizes[-1]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states ``[num_seqs, hidden]`` of a decode-only step (``can_run(meta)``)."""
        n = meta.num_seqs
        size = bucket_for(self.sizes, n)
        assert size is not None and meta.num_tokens == n, "not a decode step that fits a bucket"
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        width = meta.block_tables.shape[1]
        stale = self._table_width  # no column past it has ever held a block id
        self._table_width = max(stale, width)
        self.block_tables[:n, :width].copy_(meta.block_tables)
        self.block_tables[:n, width:stale].fill_(self.null_block_id)  # ids of earlier steps
        if size > n:  # rows left by a larger earlier step become padding again
            self.input_ids[n:size].zero_()
            self.positions[n:size].zero_()
            self.slot_mapping[n:size].fill_(self.pad_slot)
            self.seq_lens[n:size].fill_(1)
            self.block_tables[n:size, :stale].fill_(self.null_block_id)
        graph = self.graphs.get(size)
        if graph is not None:
            graph.replay()
        else:
            self._forward(size)
        self.num_steps[size] += 1
        return self.output[:n]

    def _forward(self, size: int) -> None:
        """The captured region: everything in here must be capture-safe (no host reads of
        tensor data, no tensors built from host lists)."""
        with set_forward_context(self.metas[size], self.kv_caches, self.kv_quant):
            hidden = self.model(self.input_ids[:size], self.positions[:size])
        self.output[:size].copy_(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first, into one shared memory pool (no-op without CUDA
        graphs). Records ``capture_seconds`` and ``graph_memory_bytes`` (device memory taken by
        the captures: the pool plus the driver's graph objects)."""
        if not self.use_cuda_graphs:
            return
        start = time.perf_counter()
        was_enabled = gc.isenabled()
        gc.disable()  # collections during capture cost seconds and free nothing we own
        try:
            # Lazy work (Triton compilation per bucket, cuBLAS workspaces) happens here, eagerly:
            # it cannot run inside a capture. The padding rows only touch the scratch block.
            for size in reversed(self.sizes):
                self._forward(size)
            torch.cuda.synchronize(self.device)
            free_before = torch.cuda.mem_get_info(self.device)[0]
            pool = torch.cuda.graph_pool_handle()
            for size in reversed(self.sizes):  # largest first: smaller ones reuse its blocks
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._forward(size)
                self.graphs[size] = graph
            torch.cuda.synchronize(self.device)
            self.graph_memory_bytes = free_before - torch.cuda.mem_get_info(self.device)[0]
        finally:
            if was_enabled:
                gc.enable()
        self.capture_seconds = time.perf_counter() - start


def build_graph_runner(config: EngineConfig, model: torch.nn.Module,
                       kv_caches: list[tuple[torch.Tensor, torch.Tensor]], num_blocks: int,
                       sizes: list[int], reserved_bytes: int,
                       kv_quant: list | None = None) -> GraphRunner | None:
    """Capture the decode graphs of a model whose KV cache (``num_blocks`` blocks, then the
    null and scratch blocks) is allocated (None when ``sizes`` is empty: graphs are off). Logs
    the capture time and memory against the reservation the memory plan made."""
    if not sizes:
        return None
    graphs = GraphRunner(
        model, kv_caches, sizes, max_model_len=config.scheduler.max_model_len,
        block_size=config.cache.block_size, null_block_id=num_blocks,
        scratch_block_id=num_blocks + 1,
        hidden_size=int(config.model.hf_config.hidden_size), dtype=config.model.dtype,
        device=config.device.device, use_cuda_graphs=True)
    graphs.reserved_bytes = reserved_bytes
    graphs.kv_quant = kv_quant
    graphs.capture()
    mib = 2**20
    logger.info("CUDA graphs: captured %d decode graphs (batch sizes %s) in %.1f s; they take "
                "%.1f MiB of device memory (%.1f MiB reserved by the memory plan)",
                len(sizes), _ranges(sizes), graphs.capture_seconds,
                graphs.graph_memory_bytes / mib, reserved_bytes / mib)
    if graphs.graph_memory_bytes > reserved_bytes:
        logger.warning("CUDA graphs took %.1f MiB more than reserved: lower "
                       "--gpu-memory-utilization if steps run out of memory",
                       (graphs.graph_memory_bytes - reserved_bytes) / mib)
    return graphs


def _ranges(sizes: list[int]) -> str:
    return ", ".join(map(str, sizes)) if len(sizes) <= 6 else \
        f"{', '.join(map(str, sizes[:5]))}, ..., {sizes[-1]}"
