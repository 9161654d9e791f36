"""Tensor-parallel process group state: rank, world size and group of this process.

Everything defaults to a single rank (tp_size 1, no torch.distributed), so models and layers run
the same code with and without tensor parallelism. ``init_tp`` must run before the model is built:
layers read the rank and size at construction to decide which shard they hold.
"""

from __future__ import annotations

import torch.distributed as dist

_TP_RANK = 0
_TP_SIZE = 1
_TP_GROUP: dist.ProcessGroup | None = None


def init_tp(rank: int, size: int, backend: str = "gloo", init_method: str | None = None) -> None:
    """Join the tensor-parallel group as ``rank`` of ``size``.

    ``backend`` is "gloo" on CPU, "nccl" on CUDA. ``init_method`` defaults to "env://"
    (MASTER_ADDR / MASTER_PORT), a "tcp://host:port" or "file://path" works as well.
    """
    global _TP_RANK, _TP_SIZE, _TP_GROUP
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    if not 0 <= rank < size:
        raise ValueError(f"tensor-parallel rank {rank} is outside [0, {size})")
    if size > 1:
        if not dist.is_initialized():
            dist.init_process_group(
                backend=backend,
                init_method=init_method or "env://",
                rank=rank,
                world_size=size,
            )
        if dist.get_world_size() != size:
            raise ValueError(
                f"torch.distributed world size {dist.get_world_size()} != tensor_parallel_size "
                f"{size}; one process per tensor-parallel rank is expected"
            )
        _TP_GROUP = dist.group.WORLD
    _TP_RANK, _TP_SIZE = rank, size


def destroy_tp() -> None:
    global _TP_RANK, _TP_SIZE, _TP_GROUP
    if _TP_GROUP is not None and dist.is_initialized():
        dist.destroy_process_group()
    _TP_RANK, _TP_SIZE, _TP_GROUP = 0, 1, None


def get_tp_rank() -> int:
    return _TP_RANK


def get_tp_size() -> int:
    return _TP_SIZE


def get_tp_group() -> dist.ProcessGroup | None:
    return _TP_GROUP
