"""Scheduler on hand-made requests (no model): token budget and chunking, decode-first order,
preemption of the newest request, prefix hits on admission, priority order."""

from __future__ import annotations

from services.worker.engine.api import EngineRequest, SamplingConfig
from services.worker.engine.block_manager import BlockManager
from services.worker.engine.request import Request, RequestStatus
from services.worker.engine.scheduler import Scheduler, place, place_preempted, preemption_victim

_seq = 0


def make_request(
    rid: str, prompt_len: int, max_tokens: int = 8, first: int = 0, priority: int = 0
) -> Request:
    """A request with no output handle and no text (scheduling state only)."""
    global _seq
    _seq += 1
    prompt = tuple(range(first, first + prompt_len))
    req = Request.from_engine_request(
        EngineRequest(rid, prompt, SamplingConfig(max_tokens=max_tokens), priority=priority)
    )
    req.arrival_seq = _seq
    return req


def step(sched: Scheduler, sample: int = 7) -> dict[str, int]:
    """schedule + pretend the forward ran: returns tokens scheduled per request id."""
    out = sched.schedule()
    for s in out.scheduled:
        samples = s.samples
        sched.on_computed(s.request, s.num_new_tokens)
        if samples:
            s.request.token_ids.append(sample)
    return {s.request.request_id: s.num_new_tokens for s in out.scheduled}


def test_budget_chunks_prefill_and_decodes_go_first() -> None:
    sched = Scheduler(BlockManager(64, 4, True), max_batch_tokens=10, max_num_seqs=8)
    a, b = make_request("a", 6), make_request("b", 12, first=100)
    sched.add(a)
    sched.add(b)
    assert step(sched) == {"a": 6, "b": 4}
    assert step(sched) == {"a": 1, "b": 8}  # b's last chunk samples
    assert step(sched) == {"a": 1, "b": 1}
    assert b.num_computed_tokens == 13 and b.num_output_tokens == 2


def test_newest_running_request_is_preempted() -> None:
    bm = BlockManager(6, 4, False)
    sched = Scheduler(bm, max_batch_tokens=100, max_num_seqs=8)
    old, new = make_request("old", 8), make_request("new", 8, first=50)
    sched.add(old)
    sched.add(new)
    step(sched)  # 2 + 2 blocks; each now has 9 tokens (one sampled)
    step(sched)  # both grow into a third block: 6 blocks used
    assert bm.num_free_blocks == 0
    for _ in range(3):
        step(sched)  # 12 tokens computed each: 3 full blocks
    assert step(sched) == {"old": 1}  # old needs a 4th block: new is preempted
    assert new.status is RequestStatus.PREEMPTED and new.block_ids == []
    assert new.num_output_tokens == 5  # its tokens are kept for the recompute
    assert old.status is RequestStatus.RUNNING
    assert sched.waiting[0] is new


def test_prefix_hit_on_admission_counts_tokens() -> None:
    bm = BlockManager(32, 4, True)
    sched = Scheduler(bm, max_batch_tokens=100, max_num_seqs=8)
    a = make_request("a", 10)
    sched.add(a)
    step(sched)
    sched.remove(a)
    b = make_request("b", 12)  # shares a's first 10 tokens: 2 full blocks cached
    sched.add(b)
    assert step(sched) == {"b": 4}
    assert b.num_local_cached_tokens == 8
    assert (bm.prefix_queries_tokens, bm.prefix_hits_tokens) == (22, 8)
    c = make_request("c", 8)  # fully cached prompt: the last token is still computed
    sched.add(c)
    assert step(sched) == {"b": 1, "c": 4}
    assert c.num_local_cached_tokens == 4


def test_waiting_prompt_tokens_follow_the_prefill_backlog() -> None:
    sched = Scheduler(BlockManager(64, 4, True), max_batch_tokens=10, max_num_seqs=8)
    assert sched.num_waiting_prompt_tokens == 0
    a, b = make_request("a", 6), make_request("b", 12, first=100)
    sched.add(a)
    sched.add(b)
    assert sched.num_waiting_prompt_tokens == 18  # both queued
    step(sched)  # a: 6, b: the first 4 of 12
    assert sched.num_waiting_prompt_tokens == 8  # the rest of b's prompt, in chunks
    step(sched)
    assert sched.num_waiting_prompt_tokens == 0  # decoding tokens are not prefill work


def test_a_preempted_request_waits_with_everything_it_recomputes() -> None:
    bm = BlockManager(6, 4, False)
    sched = Scheduler(bm, max_batch_tokens=100, max_num_seqs=8)
    old, new = make_request("old", 8), make_request("new", 8, first=50)
    sched.add(old)
    sched.add(new)
    for _ in range(5):
        step(sched)
    step(sched)  # old needs a 4th block: new is preempted
    assert new.status is RequestStatus.PREEMPTED
    assert sched.num_waiting_prompt_tokens == new.num_tokens == 8 + 5


# --- priority (lower is served first; arrival order among equals) ---
def test_queue_places_follow_priority_then_arrival() -> None:
    queue = [make_request(n, 1, priority=p) for n, p in (("a", -1), ("b", 0), ("c", 0), ("d", 3))]
    assert place(queue, 0) == 3  # after the other zeros: arrival order among equals
    assert place(queue, -5) == 0 and place(queue, 9) == 4 and place(queue, 1) == 3
    assert place_preempted(queue, 0) == 1  # before the zeros (it was admitted before them)
    assert place_preempted(queue, 3) == 3 and place_preempted(queue, -1) == 0
    assert place([], 0) == place_preempted([], 0) == 0
    assert preemption_victim(queue).request_id == "d"
    assert preemption_victim(queue[:3]).request_id == "c"  # newest among the worst


def test_every_priority_zero_is_first_come_first_served() -> None:
    """The default: add appends, a preempted request goes back to the front (as before)."""
    sched = Scheduler(BlockManager(64, 4, True), max_batch_tokens=100, max_num_seqs=1)
    reqs = [make_request(n, 4, first=10 * i) for i, n in enumerate("abc")]
    for r in reqs:
        sched.add(r)
    assert [r.request_id for r in sched.waiting] == ["a", "b", "c"]
    step(sched)
    assert [r.request_id for r in sched.running] == ["a"]
    sched.preempt(reqs[0])
    assert [r.request_id for r in sched.waiting] == ["a", "b", "c"]


def test_the_best_priority_waiting_request_is_admitted_first() -> None:
    sched = Scheduler(BlockManager(64, 4, True), max_batch_tokens=100, max_num_seqs=1)
    busy = make_request("busy", 4)
    sched.add(busy)
    step(sched)  # busy runs: the only sequence slot
    for name, priority, first in (("batch", 5, 100), ("chat", 0, 200), ("urgent", -2, 300)):
        sched.add(make_request(name, 4, first=first, priority=priority))
    assert [r.request_id for r in sched.waiting] == ["urgent", "chat", "batch"]
    sched.remove(busy)
    assert step(sched) == {"urgent": 4}
    assert [r.request_id for r in sched.waiting] == ["chat", "batch"]


def test_a_better_waiting_request_takes_the_worst_running_ones_slot() -> None:
    """Every slot taken: a waiting request of strictly better priority preempts the worst running
    one (the newest among equals); equal or worse ones wait; off, it waits too."""
    for on in (True, False):
        sched = Scheduler(
            BlockManager(64, 4, True), max_batch_tokens=100, max_num_seqs=2, priority_preemption=on
        )
        first, second = (
            make_request("batch1", 4, priority=10),
            make_request("batch2", 4, first=100, priority=10),
        )
        sched.add(first)
        sched.add(second)
        step(sched)
        peer = make_request("peer", 4, first=200, priority=10)  # as good as the worst: waits
        sched.add(peer)
        assert step(sched) == {"batch1": 1, "batch2": 1}
        chat = make_request("chat", 4, first=300, priority=0)
        sched.add(chat)
        if not on:
            assert step(sched) == {"batch1": 1, "batch2": 1}
            continue
        assert step(sched) == {"batch1": 1, "chat": 4}  # batch2 (the newest of the worst) made room
        assert second.status is RequestStatus.PREEMPTED and second.block_ids == []
        assert [r.request_id for r in sched.waiting] == ["batch2", "peer"]  # back before its equals
        assert [r.request_id for r in sched.running] == ["chat", "batch1"]
        assert step(sched) == {"chat": 1, "batch1": 1}  # nothing better waits: no more preemption


def test_a_better_waiting_request_takes_the_blocks_of_worse_running_ones() -> None:
    """KV full, slots free: a waiting request of strictly better priority preempts the worst
    running one for its blocks (leaving the step it was in); a request whose need the worse
    ones' blocks could not cover preempts nobody; off, it waits."""
    for on in (True, False):
        bm = BlockManager(6, 4, False)
        sched = Scheduler(bm, max_batch_tokens=100, max_num_seqs=8, priority_preemption=on)
        low1, low2 = make_request("low1", 11, priority=10), make_request("low2", 11, first=50, priority=10)
        sched.add(low1)
        sched.add(low2)
        step(sched)  # 3 + 3 blocks: the pool is full
        assert bm.num_free_blocks == 0
        chat = make_request("chat", 6, first=100, priority=0)
        sched.add(chat)
        if not on:
            assert step(sched) == {"low1": 1, "low2": 1}
            continue
        assert step(sched) == {"low1": 1, "chat": 6}  # low2 (the newest of the worst) made room
        assert low2.status is RequestStatus.PREEMPTED and "low2" not in {r.request_id for r in sched.running}
        huge = make_request("huge", 40, first=200, priority=-1)  # more than low1's blocks could free
        sched.add(huge)
        assert step(sched) == {"chat": 1, "low1": 1} and low1.status is RequestStatus.RUNNING


def test_under_kv_pressure_the_worst_priority_is_preempted_and_runs_last() -> None:
    bm = BlockManager(6, 4, False)
    sched = Scheduler(bm, max_batch_tokens=100, max_num_seqs=8)
    # "low" arrives first: by arrival alone "high" (the newest) would be the victim
    low, high = make_request("low", 8, priority=1), make_request("high", 8, first=50, priority=-1)
    sched.add(low)
    sched.add(high)
    assert [r.request_id for r in sched.waiting] == ["high", "low"]
    step(sched)
    assert [r.request_id for r in sched.running] == ["high", "low"]  # the budget goes first to high
    step(sched)
    assert bm.num_free_blocks == 0
    for _ in range(3):
        step(sched)
    assert step(sched) == {"high": 1}  # high needs a 4th block: low gives up its blocks
    assert low.status is RequestStatus.PREEMPTED and high.status is RequestStatus.RUNNING
    waiting_mid = make_request("mid", 4, first=90, priority=0)
    sched.add(waiting_mid)
    assert [r.request_id for r in sched.waiting] == ["mid", "low"]  # low waits behind a better one
