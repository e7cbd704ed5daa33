"""Scheduler on hand-made requests (no model): token budget and chunking, decode-first order,
preemption of the newest request, prefix hits on admission."""

from __future__ import annotations

from services.worker.engine.api import EngineRequest, SamplingConfig
from services.worker.engine.block_manager import BlockManager
from services.worker.engine.request import Request, RequestStatus
from services.worker.engine.scheduler import Scheduler

_seq = 0


def make_request(rid: str, prompt_len: int, max_tokens: int = 8, first: int = 0) -> Request:
    """A request with no output handle and no text (scheduling state only)."""
    global _seq
    _seq += 1
    prompt = tuple(range(first, first + prompt_len))
    req = Request.from_engine_request(EngineRequest(rid, prompt, SamplingConfig(max_tokens=max_tokens)))
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
