"""The waiting queues (FCFS deque, priority heap) against a sorted-list reference, and the
scheduler's priority policy: admission order and the choice of preemption victim."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from core_fakes import FakeRunner, check_step, content_token, make_request, output_tokens

from pagellm.core.request_queue import FCFSQueue, PriorityQueue, create_request_queue
from pagellm.core.scheduler import Scheduler


def req(rid: str, priority: int = 0, arrival: float = 0.0):
    r = make_request(rid, [1, 2, 3])
    r.priority, r.arrival_time = priority, arrival
    return r


def test_fcfs_queue() -> None:
    q = FCFSQueue()
    a, b, c = req("a"), req("b"), req("c")
    q.add(a)
    q.add(b)
    q.prepend(c)
    assert [r.request_id for r in q] == ["c", "a", "b"] and len(q) == 3
    assert q.peek() is c and q.pop() is c
    q.remove(b)
    assert list(q) == [a]
    with pytest.raises(ValueError):
        q.remove(b)


def test_priority_queue_matches_sorted_reference() -> None:
    rng = random.Random(0)
    q = PriorityQueue()
    ref: list[tuple[int, float, int, object]] = []  # (priority, arrival, add order, request)
    order = 0
    for step in range(3000):
        op = rng.random()
        if op < 0.5 or not ref:
            r = req(f"r{step}", rng.randint(-3, 3), float(rng.randint(0, 20)))
            q.add(r) if rng.random() < 0.8 else q.prepend(r)
            ref.append((r.priority, r.arrival_time, order, r))
            order += 1
        elif op < 0.8:
            ref.sort(key=lambda e: e[:3])
            assert q.peek() is ref[0][3]
            assert q.pop() is ref.pop(0)[3]
        else:
            victim = ref.pop(rng.randrange(len(ref)))
            q.remove(victim[3])
        ref.sort(key=lambda e: e[:3])
        assert len(q) == len(ref)
        if step % 100 == 0:
            assert list(q) == [e[3] for e in ref]
    with pytest.raises(ValueError, match="not waiting"):
        q.remove(req("absent"))


def test_unknown_policy() -> None:
    with pytest.raises(ValueError, match="--scheduling-policy"):
        create_request_queue("lifo")


def scheduler(policy: str, num_blocks: int = 64, max_num_seqs: int = 8) -> Scheduler:
    sched_cfg = SimpleNamespace(max_num_seqs=max_num_seqs, max_num_batched_tokens=32,
                                max_model_len=256, policy=policy)
    cache_cfg = SimpleNamespace(block_size=4, enable_prefix_caching=False,
                                prefix_caching_hash_algo="sha256")
    return Scheduler(sched_cfg, cache_cfg, num_blocks)


def run(sched: Scheduler, runner: FakeRunner) -> tuple[list[str], set[str], dict]:
    """Step to idle; returns the admission order, who was preempted, and the outputs."""
    admitted, preempted, outs = [], set(), {}
    while sched.has_unfinished_requests():
        out = sched.schedule()
        check_step(sched, out)
        admitted += [n.req_id for n in out.scheduled_new_reqs]
        preempted |= out.preempted_req_ids
        for o in sched.update_from_output(out, runner.execute(out)):
            outs.setdefault(o.req_id, []).append(o)
    kv = sched.kv_cache_manager
    assert kv.get_num_free_blocks() == sched.num_blocks
    kv.block_pool.check_invariants()
    return admitted, preempted, {k: output_tokens(v) for k, v in outs.items()}


@pytest.mark.parametrize("policy, expected", [("fcfs", ["a", "b", "c", "d"]),
                                              ("priority", ["c", "b", "d", "a"])])
def test_admission_order(policy: str, expected: list[str]) -> None:
    sched = scheduler(policy, max_num_seqs=1)
    for rid, prio, t in [("a", 5, 1.0), ("b", 0, 2.0), ("c", -1, 3.0), ("d", 0, 4.0)]:
        r = make_request(rid, [1, 2, 3, 4], max_tokens=2)
        r.priority, r.arrival_time = prio, t
        sched.add_request(r)
    admitted, _, _ = run(sched, FakeRunner(4))
    assert admitted == expected


@pytest.mark.parametrize("policy, victim", [("fcfs", "b"), ("priority", "a")])
def test_preemption_victim(policy: str, victim: str) -> None:
    # 6 blocks of 4: a and b (8-token prompts, 12 outputs each) cannot both finish in place.
    # a is older but less urgent (priority 1): FCFS evicts the newest (b), priority evicts a.
    sched = scheduler(policy, num_blocks=6, max_num_seqs=2)
    for rid, prio, t, prompt in [("a", 1, 1.0, list(range(1, 9))),
                                 ("b", 0, 2.0, list(range(11, 19)))]:
        r = make_request(rid, prompt, max_tokens=12)
        r.priority, r.arrival_time = prio, t
        sched.add_request(r)
    _, preempted, outs = run(sched, FakeRunner(4, next_token=content_token))
    assert victim in preempted and len(preempted) == 1
    # Recompute after preemption changes nothing in the outputs.
    ref = scheduler("fcfs", num_blocks=64)
    ref.add_request(make_request("a", list(range(1, 9)), max_tokens=12))
    ref.add_request(make_request("b", list(range(11, 19)), max_tokens=12))
    assert run(ref, FakeRunner(4, next_token=content_token))[2] == outs
