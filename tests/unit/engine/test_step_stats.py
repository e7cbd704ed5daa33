"""The engine's steps by kind (engine/step_stats.py): each step is classified by what it
computes, counted with its wall time and tokens on its rank, and exported to Prometheus once."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from types import SimpleNamespace

from services.worker.engine.step_stats import StepKind, StepStats, step_kind
from tests.unit.engine.conftest import EngineFactory, collect, drain, greedy, metrics_core, request


def _seq(tokens: int, logits: int = 1) -> SimpleNamespace:
    return SimpleNamespace(token_ids=[7] * tokens, num_logits=logits)


def test_a_step_is_classified_by_what_it_computes() -> None:
    assert step_kind([_seq(1), _seq(1)]) is StepKind.DECODE
    assert step_kind([_seq(40), _seq(3)]) is StepKind.PREFILL
    assert step_kind([_seq(1), _seq(40)]) is StepKind.MIXED
    assert step_kind([_seq(1), _seq(5, logits=5)]) is StepKind.VERIFY
    assert step_kind([_seq(5, logits=1), _seq(1)]) is StepKind.MIXED  # a catch-up's chunk samples once


def test_stats_accumulate_per_kind_and_copies_are_independent() -> None:
    stats = StepStats()
    stats.record(StepKind.DECODE, 1_000, 8)
    stats.record(StepKind.DECODE, 3_000, 8)
    stats.record(StepKind.MIXED, 5_000, 520)
    snapshot = stats.copy()
    stats.record(StepKind.DECODE, 1_000, 8)
    assert (snapshot.by_kind[StepKind.DECODE].steps, snapshot.by_kind[StepKind.DECODE].ns) == (2, 4_000)
    assert snapshot.by_kind[StepKind.MIXED].tokens == 520
    assert stats.by_kind[StepKind.DECODE].steps == 3


def _prompt(n: int, seed: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(3, 450) for _ in range(n))


async def test_a_rank_counts_its_prefill_mixed_and_decode_steps(make_engine: EngineFactory) -> None:
    """A 20-token prompt in chunks of at most 8 tokens: 3 prefill steps of 20 tokens in all;
    its decode steps one token each; a second prompt arriving while the first decodes shares
    steps with it (mixed). Every kind's time is positive."""
    engine = make_engine(max_batch_tokens=8)
    await drain([engine.add_request(request("alone", _prompt(20, 1), greedy(5, ignore_eos=True)))])
    stats = engine.step_stats(0).by_kind
    assert (stats[StepKind.PREFILL].steps, stats[StepKind.PREFILL].tokens) == (3, 20)
    decode = stats[StepKind.DECODE]
    assert decode.steps >= 4 and decode.tokens == decode.steps  # + a wasted row (async scheduling)
    assert StepKind.MIXED not in stats

    first = engine.add_request(request("first", _prompt(4, 2), greedy(30, ignore_eos=True)))
    outs = aiter(first)
    await anext(outs)  # decoding now
    second = engine.add_request(request("second", _prompt(40, 3), greedy(2, ignore_eos=True)))
    await asyncio.gather(collect(second), drain_rest(outs))
    stats = engine.step_stats(0).by_kind
    assert stats[StepKind.MIXED].steps >= 1
    assert all(s.ns > 0 for s in stats.values())
    # every prompt token was computed once, in a prefill or a mixed step
    prompt_tokens = 20 + 4 + 40
    rows_in_mixed = stats[StepKind.MIXED].tokens - (prompt_tokens - stats[StepKind.PREFILL].tokens)
    assert 1 <= rows_in_mixed <= stats[StepKind.MIXED].steps


async def drain_rest(outs: AsyncIterator[object]) -> None:
    async for _ in outs:
        pass


async def test_steps_reach_prometheus_once(make_engine: EngineFactory) -> None:
    from prometheus_client import REGISTRY

    engine = make_engine()
    core = metrics_core(engine)

    def exported(name: str, kind: str) -> float:
        return REGISTRY.get_sample_value(name, {"dp_rank": "0", "kind": kind}) or 0.0

    core.refresh_metrics()
    before = {k: exported("pdserve_engine_steps_total", k) for k in ("prefill", "decode")}
    tokens_before = exported("pdserve_engine_step_tokens_total", "prefill")
    seconds_before = exported("pdserve_engine_step_seconds_total", "decode")
    await drain([engine.add_request(request("r", _prompt(12, 4), greedy(6, ignore_eos=True)))])
    stats = engine.step_stats(0).by_kind
    for _ in range(2):  # cumulative counts are exported once
        core.refresh_metrics()
        assert (
            exported("pdserve_engine_steps_total", "prefill") - before["prefill"]
            == stats[StepKind.PREFILL].steps
        )
        assert (
            exported("pdserve_engine_steps_total", "decode") - before["decode"]
            == stats[StepKind.DECODE].steps
        )
        assert exported("pdserve_engine_step_tokens_total", "prefill") - tokens_before == 12
        assert exported("pdserve_engine_step_seconds_total", "decode") - seconds_before > 0
