"""Speculation over real channels: the prefill worker's proposals travel with the KV
(KvChunk.draft_token_ids) and the decode worker's first step verifies them; output equals a
non-speculating unified worker's; acceptance shows in GetLoad and the Prometheus counters."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from shared.proto import worker_pb2

from .harness import RunningWorker, collect, running_worker, sampling, worker_settings
from .test_worker_grpc import all_blocks_free, disaggregated, token_ids_of, wait_blocks_free

SPEC = {"speculative": "ngram", "num_speculative_tokens": 4, "spec_ngram_min": 1, "spec_step_cost": False}


@pytest.fixture
async def spec_prefill(tiny_model: Path) -> AsyncIterator[RunningWorker]:
    async with running_worker(worker_settings(tiny_model, "prefill", **SPEC)) as w:
        yield w


@pytest.fixture
async def spec_decode(tiny_model: Path) -> AsyncIterator[RunningWorker]:
    async with running_worker(worker_settings(tiny_model, "decode", **SPEC)) as w:
        yield w


@pytest.fixture
async def plain_unified(tiny_model: Path) -> AsyncIterator[RunningWorker]:
    async with running_worker(worker_settings(tiny_model, "unified")) as w:
        yield w


def _counter(name: str, rank: str = "0") -> float:
    return REGISTRY.get_sample_value(name, {"dp_rank": rank}) or 0.0


async def test_handoff_proposals_are_verified_and_output_is_unchanged(
    spec_prefill: RunningWorker,
    spec_decode: RunningWorker,
    plain_unified: RunningWorker,
) -> None:
    engine = spec_decode.app.engine
    assert engine is not None
    # every token id once: the prefill worker's 1-gram lookup finds any first token
    ids = list(range(3, int(engine.vocab_size)))  # type: ignore[attr-defined]
    random.Random(3).shuffle(ids)
    ids = ids[:400]
    before = _counter("pdserve_spec_decode_num_draft_tokens_total")
    reply, frames = await disaggregated(spec_prefill, spec_decode, "s1", ids, 40)
    ref = await collect(
        plain_unified.stub.Decode(
            worker_pb2.DecodeRequest(
                request_id="s1-ref",
                prompt_token_ids=ids,
                sampling=sampling(40),
                local_prefill=True,
                return_token_ids=True,
            )
        )
    )
    assert list(reply.token_ids) + token_ids_of(frames) == token_ids_of(ref)
    assert frames[-1].generated_tokens == 39 or frames[-1].finish_reason == ref[-1].finish_reason
    assert reply.text + "".join(f.text for f in frames) == "".join(f.text for f in ref)
    assert engine.spec_stats(0).num_draft_tokens > 0  # the handed-over proposals, at least
    load = await spec_decode.stub.GetLoad(worker_pb2.GetLoadRequest())
    (rank,) = load.ranks
    assert rank.HasField("spec_draft_tokens") and rank.HasField("spec_accepted_tokens")
    assert rank.spec_draft_tokens == engine.spec_stats(0).num_draft_tokens
    assert rank.spec_accepted_tokens == engine.spec_stats(0).num_accepted_tokens
    # GetLoad refreshed the counters
    assert _counter("pdserve_spec_decode_num_draft_tokens_total") - before >= rank.spec_draft_tokens
    await wait_blocks_free(spec_decode)
    await wait_blocks_free(spec_prefill)
    assert all_blocks_free(plain_unified)
