"""PREFILL_ONLY + export_kv on one engine, DECODE_REMOTE + import_kv + finish_import on another:
same tokens as a unified run; the decode side skips blocks already in its prefix cache."""

from __future__ import annotations

import dataclasses
import random
from typing import Any, cast

import pytest

from services.worker.engine.api import Engine, KvBlocksChunk, RequestKind, RequestOutput, SamplingConfig
from shared.errors import AlreadyExists, InvalidArgument, NotFound
from tests.unit.engine.conftest import EngineFactory, collect, greedy, request, tokens_of


def _prompt(n: int, seed: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(3, 450) for _ in range(n))


async def _disaggregated(
    prefill: Engine,
    decode: Engine,
    rid: str,
    prompt: tuple[int, ...],
    max_tokens: int,
    sampling: SamplingConfig | None = None,
) -> tuple[RequestOutput, list[RequestOutput], int]:
    sampling = sampling or greedy(max_tokens, ignore_eos=True)
    first = await collect(prefill.add_request(request(rid, prompt, sampling, kind=RequestKind.PREFILL_ONLY)))
    assert len(first) == 1 and first[0].finished
    admission, handle = decode.admit_remote(request(rid, prompt, sampling, kind=RequestKind.DECODE_REMOTE))
    sent_bytes = 0
    for chunk in prefill.export_kv(rid, admission.num_cached_blocks, max_chunk_bytes=20_000):
        sent_bytes += len(chunk.data)
        decode.import_kv(admission.transfer_ticket, chunk)
    prefill.release(rid)
    decode.finish_import(
        admission.transfer_ticket, len(prompt), first[0].new_token_ids[0], first[0].num_generated_tokens
    )
    return first[0], await collect(handle), sent_bytes


async def test_prefill_decode_handoff_matches_unified(make_engine: EngineFactory) -> None:
    unified, prefill, decode = make_engine(), make_engine(), make_engine()
    prompt = _prompt(75, 1)
    cold = await collect(unified.add_request(request("u", prompt, greedy(10, ignore_eos=True))))
    first, rest, sent = await _disaggregated(prefill, decode, "d", prompt, 10)
    assert first.num_generated_tokens == 1 and first.finish_reason is None
    assert list(first.new_token_ids) + tokens_of(rest) == tokens_of(cold)
    assert "".join([first.text_delta] + [o.text_delta for o in rest]) == "".join(o.text_delta for o in cold)
    last = rest[-1]
    assert last.num_generated_tokens == 9  # post-handoff tokens only
    assert last.finish_reason is not None and last.finish_reason.value == "length"
    assert last.num_transferred_tokens == 75 and last.num_local_cached_tokens == 0
    block_bytes = sent // 5  # 75 tokens = 5 blocks of 16
    assert sent == 5 * block_bytes
    for engine in (prefill, decode):
        assert engine.num_free_blocks(0) == engine.num_total_blocks(0)


@pytest.mark.parametrize("seed", [7, 2**63 + 5])
async def test_seeded_sampling_handoff_matches_unified(make_engine: EngineFactory, seed: int) -> None:
    """The token at each output position depends only on (seed, position): the decode worker's
    draws after a handoff continue exactly where a unified worker's would."""
    unified, prefill, decode = make_engine(), make_engine(), make_engine()
    prompt = _prompt(40, 9)
    sampling = SamplingConfig(max_tokens=16, temperature=1.5, top_k=50, seed=seed, ignore_eos=True)
    cold = await collect(unified.add_request(request("u", prompt, sampling)))
    first, rest, _ = await _disaggregated(prefill, decode, "d", prompt, 16, sampling)
    assert list(first.new_token_ids) + tokens_of(rest) == tokens_of(cold)
    assert len(set(tokens_of(cold))) > 3  # really sampled, not a greedy-looking repeat


async def test_decode_side_skips_cached_blocks(make_engine: EngineFactory) -> None:
    prefill, decode = make_engine(), make_engine()
    shared = _prompt(64, 2)
    _, _, sent_cold = await _disaggregated(prefill, decode, "a", shared + _prompt(20, 3), 4)
    _, rest, sent_warm = await _disaggregated(prefill, decode, "b", shared + _prompt(20, 4), 4)
    # 84 tokens = 6 blocks; the 4 blocks of the shared 64 tokens are already on the decode side
    assert sent_warm * 6 == sent_cold * 2
    assert rest[-1].num_local_cached_tokens == 64
    assert rest[-1].num_transferred_tokens == 20


async def test_prefill_only_immediate_finish_and_errors(make_engine: EngineFactory) -> None:
    engine = make_engine()
    out = await collect(
        engine.add_request(request("p", _prompt(20, 5), greedy(1), kind=RequestKind.PREFILL_ONLY))
    )
    assert out[-1].finish_reason is not None and out[-1].finish_reason.value == "length"
    with pytest.raises(InvalidArgument):
        list(engine.export_kv("p", 99, 1 << 20))
    assert len(list(engine.export_kv("p", 0, 1 << 20))) == 1
    engine.release("p")
    with pytest.raises(NotFound):
        engine.release("p")
    with pytest.raises(NotFound):
        engine.import_kv("0-nope", KvBlocksChunk(first_block=0, num_blocks=0, data=b""))
    assert engine.num_free_blocks(0) == engine.num_total_blocks(0)


async def test_abort_waiting_for_kv(make_engine: EngineFactory) -> None:
    engine = make_engine()
    admission, handle = engine.admit_remote(
        request("x", _prompt(40, 6), greedy(5), kind=RequestKind.DECODE_REMOTE)
    )
    assert engine.num_free_blocks(0) < engine.num_total_blocks(0)
    assert engine.abort("x")
    outs = await collect(handle)
    assert outs[-1].finish_reason is not None and outs[-1].finish_reason.value == "abort"
    assert not engine.abort("x")
    with pytest.raises(NotFound):
        engine.finish_import(admission.transfer_ticket, 40, 5, 1)
    assert engine.num_free_blocks(0) == engine.num_total_blocks(0)


async def test_a_request_admitted_under_the_gateways_ticket_and_ended_by_it(
    make_engine: EngineFactory,
) -> None:
    """admit_remote under a given ticket (DecodeRequest.transfer_ticket): the KV imports under
    it; a ticket of another rank, without an id, or in use is refused before anything is
    reserved; abort_ticket ends only a request still waiting under its ticket."""
    prefill, decode = make_engine(), make_engine()
    prompt = _prompt(40, 8)
    sampling = greedy(4, ignore_eos=True)
    for bad, error in (("1-abc", InvalidArgument), ("0-", InvalidArgument), ("abc", InvalidArgument)):
        with pytest.raises(error):
            decode.admit_remote(request("y", prompt, sampling, kind=RequestKind.DECODE_REMOTE), bad)
    assert decode.num_free_blocks(0) == decode.num_total_blocks(0)
    assert not decode.waits_for_kv("0-g1")
    admission, handle = decode.admit_remote(
        request("g", prompt, sampling, kind=RequestKind.DECODE_REMOTE), "0-g1"
    )
    assert admission.transfer_ticket == "0-g1" and decode.waits_for_kv("0-g1")
    with pytest.raises(AlreadyExists):
        decode.admit_remote(request("h", prompt, sampling, kind=RequestKind.DECODE_REMOTE), "0-g1")
    first = await collect(prefill.add_request(request("g", prompt, sampling, kind=RequestKind.PREFILL_ONLY)))
    for chunk in prefill.export_kv("g", 0, max_chunk_bytes=1 << 20):
        decode.import_kv("0-g1", chunk)
    prefill.release("g")
    decode.finish_import("0-g1", len(prompt), first[0].new_token_ids[0], 1)
    assert not decode.abort_ticket("0-g1") and not decode.waits_for_kv("0-g1")  # decoding: not waiting
    assert len(tokens_of(await collect(handle))) == 3
    _, waiting = decode.admit_remote(request("w", prompt, sampling, kind=RequestKind.DECODE_REMOTE), "0-w1")
    assert not decode.abort_ticket("0-other") and not decode.abort_ticket("9-w1")
    assert decode.abort_ticket("0-w1")
    outs = await collect(waiting)
    assert outs[-1].finish_reason is not None and outs[-1].finish_reason.value == "abort"
    assert decode.num_free_blocks(0) == decode.num_total_blocks(0)


async def test_prefill_progress_outputs_and_the_ready_blocks_export(make_engine: EngineFactory) -> None:
    """A PREFILL_ONLY request that asks for progress, prefilled 32 tokens per step: one output
    per chunk but the last (no tokens, its computed count), then the first token. The blocks a
    progress output names export at once (the engine may be computing the next chunk), byte
    for byte what export_kv gives once held."""
    prefill = make_engine(max_batch_tokens=32)
    # each progress output comes after the step's kernels ran (on CUDA a NIXL peer READs the
    # named blocks outside torch's stream order): the runner's wait precedes every cue
    waits: list[int] = []
    for rank in cast(Any, prefill)._ranks:
        rank.runner.wait_for_device = lambda: waits.append(1)
    prompt = _prompt(75, 3)  # 3 chunks: 32 + 32 + 11 tokens; 5 blocks of 16
    req = dataclasses.replace(
        request("p", prompt, greedy(4, ignore_eos=True), kind=RequestKind.PREFILL_ONLY),
        report_prefill_progress=True,
    )
    handle = prefill.add_request(req)
    early: list[KvBlocksChunk] = []
    progress: list[int] = []
    async for out in handle:
        if not out.finished:
            assert not out.new_token_ids
            progress.append(out.num_computed_tokens)
            assert len(waits) >= len(progress)
            early += prefill.export_ready_kv("p", 2 * (len(progress) - 1), 2 * len(progress), 1 << 20)
        else:
            assert len(out.new_token_ids) == 1
    assert progress == [32, 64] and len(waits) == 2
    held = list(prefill.export_kv("p", 0, max_chunk_bytes=1 << 20))
    sent = b"".join(c.data for c in early)
    assert sent == b"".join(c.data for c in held)[: len(sent)]
    assert [c.first_block for c in early] == [0, 2]
    prefill.release("p")
    assert prefill.num_free_blocks(0) == prefill.num_total_blocks(0)
    with pytest.raises(NotFound):
        list(prefill.export_ready_kv("p", 0, 2, max_chunk_bytes=1 << 20))  # released: gone
