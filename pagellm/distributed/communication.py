"""Collectives over the tensor-parallel group; identities when tp_size is 1."""

from __future__ import annotations

import torch
import torch.distributed as dist

from pagellm.distributed.parallel_state import get_tp_group, get_tp_size


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the tensor-parallel ranks (in place when tp > 1) and return it."""
    if get_tp_size() == 1:
        return x
    dist.all_reduce(x, group=get_tp_group())
    return x


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``, in rank order."""
    size = get_tp_size()
    if size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x, group=get_tp_group())
    return torch.cat(parts, dim=dim)


def broadcast_from_rank0(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's ``x`` on every rank (``x`` gives the shape and dtype on the others)."""
    if get_tp_size() > 1:
        x = x.contiguous()
        dist.broadcast(x, src=0, group=get_tp_group())
    return x


def all_reduce_min(value: int, device: torch.device) -> int:
    """The smallest ``value`` over the tensor-parallel ranks."""
    if get_tp_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=get_tp_group())
    return int(t.item())
