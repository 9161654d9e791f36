"""The front end's handle on the engines of a data-parallel server (``--data-parallel-size N``,
internal load balancing): N EngineCoreClients, which engine each new request goes to, and who
owns each request afterwards. AsyncLLM reads every engine's output socket (one asyncio task
each) and tells this client what came back; a single engine needs none of it
(``make_core_client``)."""

from __future__ import annotations

import logging
import os
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pagellm.engine.core_proc import EngineCoreClient, EngineCoreOutputs
from pagellm.engine.data_parallel import engine_config, split_cpus
from pagellm.errors import WeightUpdateError
from pagellm.metrics.stats import SchedulerStats, SpecDecodingStats
from pagellm.request import Request, RequestStatus

logger = logging.getLogger("pagellm")


@dataclass
class EngineLoad:
    """What the front end knows of one engine's queue: the counts of its last report, and the
    sequences sent to it and received by it (the difference is on its way there)."""

    waiting: int = 0
    running: int = 0
    sent: int = 0
    received: int = 0

    @property
    def score(self) -> int:
        # vLLM's weighting: a waiting sequence costs four running ones; those still on their
        # way wait there next.
        return 4 * (self.waiting + self.sent - self.received) + self.running


def choose_engine(loads: Sequence[EngineLoad]) -> int:
    """The position of the least loaded engine (the first of equals)."""
    return min(range(len(loads)), key=lambda i: loads[i].score)


@dataclass(frozen=True)
class OnCpus:
    """Builds the engine core (``factory``; None: EngineCore) pinned to ``cpus`` with one torch
    thread each, so the engines of a CPU server split its cores instead of each taking all of
    them (its tensor-parallel workers, spawned from it, split its share)."""

    cpus: tuple[int, ...]
    factory: Any = None

    def __call__(self, config: Any, eos_token_id: int | None) -> Any:
        import torch

        os.sched_setaffinity(0, self.cpus)
        torch.set_num_threads(len(self.cpus))
        if self.factory is not None:
            return self.factory(config, eos_token_id)
        from pagellm.engine.core import EngineCore

        return EngineCore(config, eos_token_id)


def make_core_client(config: Any, eos_token_id: int | None, core_factory: Any = None
                     ) -> EngineCoreClient | DPEngineCoreClient:
    """One EngineCoreClient, exactly as without data parallelism, when this server runs one
    engine (external load balancing runs rank R's); else a DPEngineCoreClient."""
    parallel = getattr(config, "parallel", None)  # test doubles' configs lack it
    if parallel is None or len(parallel.engine_ranks) == 1:
        if parallel is not None and parallel.data_parallel_external_lb:
            logger.info("Data-parallel rank %d of %d (external load balancing): this server "
                        "runs that rank's engine only.", parallel.data_parallel_rank,
                        parallel.data_parallel_size)
            config = engine_config(config, parallel.data_parallel_rank)
        return EngineCoreClient(config, eos_token_id, core_factory)
    return DPEngineCoreClient(config, eos_token_id, core_factory)


class DPEngineCoreClient:
    """One engine-core process per data-parallel rank; each new request (all its samples) goes
    to the least loaded engine, and its aborts to that engine only."""

    def __init__(self, config: Any, eos_token_id: int | None, core_factory: Any = None) -> None:
        parallel = config.parallel
        self.ranks: tuple[int, ...] = parallel.engine_ranks
        n = len(self.ranks)
        share = None
        cpu_sets: list[tuple[int, ...] | None] = [None] * n
        if config.device.device.type == "cpu":
            if config.cache.kv_cache_memory is None:
                from pagellm.memory_plan import default_cpu_kv_budget

                share = default_cpu_kv_budget() // (n * parallel.tensor_parallel_size)
            if hasattr(os, "sched_setaffinity"):
                cpu_sets = list(split_cpus(os.sched_getaffinity(0), n))
        self.engines: list[EngineCoreClient] = []
        try:
            # Every engine loads at the same time; then each is waited for.
            for rank, cpus in zip(self.ranks, cpu_sets, strict=True):
                factory = core_factory if cpus is None else OnCpus(cpus, core_factory)
                self.engines.append(EngineCoreClient(engine_config(config, rank, share),
                                                     eos_token_id, factory, wait=False))
            for engine in self.engines:
                engine.wait_ready()
        except BaseException:
            self.shutdown()
            raise
        for rank, engine, cpus in zip(self.ranks, self.engines, cpu_sets, strict=True):
            logger.info("Data-parallel rank %d: engine core pid %d%s", rank, engine.pid,
                        f", CPUs {list(cpus)}" if cpus else "")
        self.loads = [EngineLoad() for _ in self.engines]
        self.stats = [SchedulerStats() for _ in self.engines]
        self._owner: dict[str, int] = {}  # sequence id -> position of the engine running it
        self._in_flight = [0] * n  # sequences each engine owns
        self._last_progress = [time.monotonic()] * n

    @property
    def pid(self) -> int | None:
        return self.engines[0].pid

    @property
    def info(self) -> dict:
        return self.engines[0].info

    # ---- requests --------------------------------------------------------------------------
    def add_requests(self, requests: list[Request]) -> None:
        """The samples of one request, to one engine: they share the prompt's KV blocks."""
        i = choose_engine(self.loads)
        self.engines[i].add_requests(requests)
        self.loads[i].sent += len(requests)
        if not self._in_flight[i]:
            self._last_progress[i] = time.monotonic()  # an idle engine owes no step until now
        self._in_flight[i] += len(requests)
        for request in requests:
            self._owner[request.request_id] = i

    def abort_requests(self, req_ids: list[str],
                       status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        by_engine: dict[int, list[str]] = defaultdict(list)
        for req_id in req_ids:
            i = self._owner.pop(req_id, None)
            if i is not None:  # else finished already: nothing to free
                by_engine[i].append(req_id)
        for i, ids in by_engine.items():
            self._in_flight[i] -= len(ids)
            self.engines[i].abort_requests(ids, status)

    def engine_index_of(self, req_id: str) -> int:
        """The data-parallel rank running ``req_id`` (the first rank if none does)."""
        return self.ranks[self._owner.get(req_id, 0)]

    def on_outputs(self, i: int, batch: EngineCoreOutputs) -> None:
        """Engine ``i`` sent ``batch``: its load, its progress, the sequences it finished."""
        self._last_progress[i] = time.monotonic()
        load = self.loads[i]
        load.received = batch.num_requests_received
        if batch.scheduler_stats is not None:
            self.stats[i] = s = batch.scheduler_stats
            load.waiting, load.running = s.num_waiting_reqs, s.num_running_reqs
        for out in batch.outputs:
            if out.finish_reason is not None and self._owner.pop(out.req_id, None) is not None:
                self._in_flight[i] -= 1

    def seconds_without_progress(self) -> float:
        """The longest any engine with sequences in flight has gone without a step (0: none
        in flight): one wedged engine shows although the others step on."""
        now = time.monotonic()
        return max((now - t for t, n in zip(self._last_progress, self._in_flight, strict=True)
                    if n), default=0.0)

    def merged_stats(self) -> SchedulerStats:
        return merge_stats(self.stats)

    def shutdown(self) -> None:
        for engine in self.engines:
            engine.shutdown()


def merge_stats(stats: Sequence[SchedulerStats]) -> SchedulerStats:
    """The server's totals: counts summed, KV cache usage averaged (every engine has its own
    cache of the same size)."""
    specs = [s.spec_decoding for s in stats if s.spec_decoding is not None]
    spec = None
    if specs:
        spec = SpecDecodingStats(specs[0].num_spec_tokens)
        for s in specs:
            spec.num_drafts += s.num_drafts
            spec.num_draft_tokens += s.num_draft_tokens
            spec.num_accepted_tokens += s.num_accepted_tokens
            spec.num_accepted_tokens_per_pos = [
                a + b for a, b in zip(spec.num_accepted_tokens_per_pos,
                                      s.num_accepted_tokens_per_pos, strict=True)]
    return SchedulerStats(
        num_running_reqs=sum(s.num_running_reqs for s in stats),
        num_waiting_reqs=sum(s.num_waiting_reqs for s in stats),
        kv_cache_usage=sum(s.kv_cache_usage for s in stats) / max(1, len(stats)),
        prefix_cache_queries=sum(s.prefix_cache_queries for s in stats),
        prefix_cache_hits=sum(s.prefix_cache_hits for s in stats),
        num_preemptions=sum(s.num_preemptions for s in stats),
        num_steps=sum(s.num_steps for s in stats),
        spec_decoding=spec)


def combine_weight_updates(results: Sequence[Any], ranks: Sequence[int]) -> int:
    """One engine's answer to update_weights_from_disk per rank -> the tensors loaded, all or
    nothing: re-raises an engine's error when every engine kept (or got back) its weights or
    one is out of service; a WeightUpdateError (not restored) when some engines loaded the new
    weights and others did not, since one server must not answer from two models."""
    failed = [(rank, r) for rank, r in zip(ranks, results, strict=True)
              if isinstance(r, BaseException)]
    if not failed:
        return int(results[0])
    lost = [e for _, e in failed if isinstance(e, WeightUpdateError) and not e.restored]
    if lost:
        raise lost[0]
    loaded = [rank for rank, r in zip(ranks, results, strict=True)
              if not isinstance(r, BaseException)]
    if loaded:
        raise WeightUpdateError(
            f"The new weights loaded on data-parallel rank(s) {loaded} but not on "
            f"{[rank for rank, _ in failed]}: rather than answer from two models, the server "
            "is out of service (restart it).", restored=False)
    raise failed[0][1]
