"""Data parallelism as vLLM spells it (--data-parallel-size, --data-parallel-rank): the checks,
what each engine of a server gets, and the multi-machine flags pagellm refuses.

Internal load balancing (``--data-parallel-size N``): one API server, N engine-core processes,
each with its own KV cache and tensor-parallel group; nothing is shared between them
(engine/dp_client.py routes the requests). External (``--data-parallel-rank R`` too): the server
runs rank R alone, behind the user's load balancer. See docs/parallelism.md.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from pagellm.config import EngineConfig


def check_data_parallel(size: int, rank: int | None, tp: int, device: torch.device,
                        device_flag: str, num_cuda_devices: int | None = None) -> None:
    """Refuse a --data-parallel-size / --data-parallel-rank pair this machine cannot run."""
    if size < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {size}.")
    if rank is not None:
        if size == 1:
            raise ValueError(f"--data-parallel-rank {rank} runs one rank of a deployment: give "
                             "--data-parallel-size N too (N >= 2, the ranks of all its servers).")
        if not 0 <= rank < size:
            raise ValueError(f"--data-parallel-rank must be between 0 and {size - 1} "
                             f"(--data-parallel-size {size}), got {rank}.")
        return  # one engine here, on this server's devices, as without data parallelism
    if size == 1 or device.type != "cuda":
        return
    if device_flag not in ("auto", "cuda"):
        raise ValueError(f"--device {device_flag} with --data-parallel-size {size}: rank r runs "
                         f"on its own GPUs (cuda:r*{tp} onwards); pass --device cuda and choose "
                         "the GPUs with CUDA_VISIBLE_DEVICES.")
    if num_cuda_devices is None:
        import torch

        num_cuda_devices = torch.cuda.device_count()
    if size * tp > num_cuda_devices:
        raise ValueError(f"--data-parallel-size {size} x --tensor-parallel-size {tp} needs "
                         f"{size * tp} GPUs (each rank its own), but {num_cuda_devices} CUDA "
                         "device(s) are visible.")


def engine_config(config: EngineConfig, rank: int, cpu_kv_share: int | None = None
                  ) -> EngineConfig:
    """The config of the engine of data-parallel ``rank``: its rank; seed + rank, so unseeded
    random sampling differs between ranks (requests with a seed sample the same on any rank);
    with internal load balancing on CUDA, its GPUs from cuda:rank*tp; on CPU, when
    --kv-cache-memory was not given, ``cpu_kv_share`` (its share of the default budget)."""
    parallel = config.parallel
    changes: dict[str, Any] = {
        "parallel": dataclasses.replace(parallel, data_parallel_rank=rank),
        "model": dataclasses.replace(config.model, seed=config.model.seed + rank)}
    if not parallel.data_parallel_external_lb:
        device = config.device.device
        if device.type == "cuda":
            import torch

            first = torch.device("cuda", rank * parallel.tensor_parallel_size)
            changes["device"] = dataclasses.replace(config.device, device=first)
        elif cpu_kv_share is not None and config.cache.kv_cache_memory is None:
            changes["cache"] = dataclasses.replace(config.cache, kv_cache_memory=cpu_kv_share)
    return dataclasses.replace(config, **changes)


def split_cpus(cpus: Sequence[int], n: int) -> list[tuple[int, ...]]:
    """``n`` disjoint equal shares of ``cpus`` (a remainder stays unused); with fewer CPUs than
    engines, one CPU each, shared round-robin."""
    ordered = sorted(cpus)
    per = len(ordered) // n
    if per == 0:
        return [(ordered[i % len(ordered)],) for i in range(n)]
    return [tuple(ordered[i * per:(i + 1) * per]) for i in range(n)]


# vLLM's flags for data parallelism across machines (and headless engines), with its short
# spellings: pagellm runs all the ranks of a server on one machine, so it refuses them.
MULTI_NODE_DP_FLAGS: tuple[tuple[tuple[str, ...], bool], ...] = (
    (("--data-parallel-address", "-dpa"), True),
    (("--data-parallel-rpc-port", "-dpp"), True),
    (("--data-parallel-size-local", "-dpl"), True),
    (("--data-parallel-start-rank", "-dpr"), True),
    (("--data-parallel-backend", "-dpb"), True),
    (("--data-parallel-hybrid-lb",), False),
    (("--headless",), False),
)


class _MultiNodeFlag(argparse.Action):
    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        parser.error(f"{option_string}: pagellm does not run data parallelism across machines "
                     "(one `pagellm serve` runs all its --data-parallel-size ranks here), so on "
                     "several machines start one server per rank with --data-parallel-size N "
                     "--data-parallel-rank R behind your load balancer.")


def add_multi_node_dp_flags(parser: Any) -> None:
    """vLLM's multi-machine data-parallel flags, each refused with the reason when given."""
    for names, takes_value in MULTI_NODE_DP_FLAGS:
        parser.add_argument(*names, action=_MultiNodeFlag, nargs=None if takes_value else 0,
                            help=argparse.SUPPRESS)
