"""Protobuf <-> worker domain conversion: proto defaults, presence of optional counts."""

from __future__ import annotations

from typing import Any

from services.gateway import convert as gateway_convert
from services.gateway.inputs import TokenLogprob
from services.worker import convert
from services.worker.engine.api import KvBlocksChunk, TokenLogprobs
from services.worker.messages import DecodeEvent, KvTargetSpec, LoraChange, PrefillResult
from shared.cluster import DecodeFrameKind, FinishReason, KvLayout
from shared.cluster_convert import kv_layout_to_pb
from shared.proto import common_pb2, worker_pb2

LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, dtype="float32")


def test_sampling_defaults_mean_unset() -> None:
    s = convert.sampling_from_pb(common_pb2.SamplingParams(max_tokens=5))
    assert s.max_tokens == 5
    assert s.temperature == 0.0  # greedy
    assert s.top_p == 1.0  # 0 on the wire = disabled
    assert s.seed is None
    s = convert.sampling_from_pb(
        common_pb2.SamplingParams(
            max_tokens=5, seed=0, top_p=0.5, stop=["x"], stop_token_ids=[7], ignore_eos=True
        )
    )
    assert s.seed == 0  # presence, not value
    assert s.top_p == 0.5
    assert s.stop == ("x",) and s.stop_token_ids == (7,) and s.ignore_eos


def test_prefill_request_and_kv_target() -> None:
    pb = worker_pb2.PrefillRequest(
        request_id="r", prompt_token_ids=[1, 2], dp_rank=1, sampling=common_pb2.SamplingParams(max_tokens=3)
    )
    call = convert.prefill_call_from_pb(pb)
    assert call.kv_target is None
    assert call.request.prompt_token_ids == (1, 2) and call.request.dp_rank == 1
    pb.kv_target.address = "d:1"
    pb.kv_target.transfer_ticket = "t"
    pb.kv_target.skip_blocks = 2
    call = convert.prefill_call_from_pb(pb)
    assert call.kv_target == KvTargetSpec(address="d:1", dp_rank=0, transfer_ticket="t", skip_blocks=2)


def test_prefill_reply_always_carries_generated_tokens() -> None:
    result = PrefillResult(
        request_id="r",
        text="",
        token_ids=(),
        generated_tokens=0,
        finish_reason=FinishReason.STOP,
        prompt_tokens=4,
        local_cached_tokens=0,
        kv_bytes_sent=0,
        num_chunks=1,
        prefill_ns=10,
        kv_transfer_ns=0,
    )
    pb = convert.prefill_result_to_pb(result)
    assert pb.HasField("generated_tokens") and pb.generated_tokens == 0  # immediate EOS
    assert pb.finish_reason == common_pb2.FINISH_REASON_STOP


def test_logprob_ranks_cross_the_wire_and_an_older_workers_stay_unset() -> None:
    """TokenLogprob.rank (1.18): the worker's rank reaches the gateway (and its own clients); a
    worker older than 1.18 sends none, which the gateway reads as None, not as rank 0."""
    (pb,) = convert.logprobs_to_pb([TokenLogprobs(5, -3.5, ((1, -0.25),), rank=40)])
    assert pb.HasField("rank") and pb.rank == 40
    (got,) = gateway_convert.logprobs_from_pb([pb])
    assert got == TokenLogprob(5, -3.5, ((1, -0.25),), rank=40)
    assert gateway_convert.logprobs_to_pb((got,)) == [pb]
    old = common_pb2.TokenLogprob(token_id=5, logprob=-3.5)  # from a 1.17 worker
    (unranked,) = gateway_convert.logprobs_from_pb([old])
    assert unranked.rank is None
    assert not gateway_convert.logprobs_to_pb((unranked,))[0].HasField("rank")
    (unset,) = convert.logprobs_to_pb([TokenLogprobs(5, -3.5)])
    assert not unset.HasField("rank")


def test_generated_tokens_only_on_final_frames() -> None:
    base: dict[str, Any] = dict(
        request_id="r", prompt_tokens=4, local_cached_tokens=0, transferred_cached_tokens=4
    )
    tokens = convert.decode_event_to_pb(DecodeEvent(kind=DecodeFrameKind.TOKENS, text="a", **base))
    assert not tokens.HasField("generated_tokens")
    assert tokens.kind == worker_pb2.DECODE_FRAME_KIND_TOKENS
    assert tokens.transferred_cached_tokens == 4
    final = convert.decode_event_to_pb(
        DecodeEvent(kind=DecodeFrameKind.FINAL, generated_tokens=0, finish_reason=FinishReason.LENGTH, **base)
    )
    assert final.HasField("generated_tokens") and final.generated_tokens == 0
    assert final.finish_reason == common_pb2.FINISH_REASON_LENGTH


def test_kv_chunk_round_trip_and_old_sender() -> None:
    target = KvTargetSpec(address="d:1", dp_rank=1, transfer_ticket="t", skip_blocks=0)
    chunk = KvBlocksChunk(first_block=2, num_blocks=1, data=b"\1\2")
    layout_pb = kv_layout_to_pb(LAYOUT)
    middle = convert.kv_chunk_from_pb(convert.kv_chunk_to_pb("r", target, layout_pb, chunk))
    assert middle.chunk == chunk and middle.layout == LAYOUT and not middle.last
    assert middle.generated_tokens is None and middle.first_token_id is None
    last = convert.kv_chunk_from_pb(convert.kv_chunk_to_pb("r", target, layout_pb, chunk, last=(9, 42, 1)))
    assert last.last and last.num_tokens == 9 and last.first_token_id == 42
    assert last.generated_tokens == 1 and last.dp_rank == 1
    finished = convert.kv_chunk_to_pb("r", target, layout_pb, chunk, last=(9, None, 0))
    assert not finished.HasField("first_token_id")
    assert finished.HasField("generated_tokens") and finished.generated_tokens == 0
    # A v1.0 prefill worker never sets generated_tokens: presence, not the zero value.
    old = worker_pb2.KvChunk(request_id="r", transfer_ticket="t", last=True, num_tokens=9, first_token_id=42)
    assert convert.kv_chunk_from_pb(old).generated_tokens is None


def test_kv_chunk_carries_proposals_on_the_last_chunk_only() -> None:
    target = KvTargetSpec(address="d:1", dp_rank=0, transfer_ticket="t", skip_blocks=0)
    chunk = KvBlocksChunk(first_block=0, num_blocks=1, data=b"\1")
    layout_pb = kv_layout_to_pb(LAYOUT)
    pb = convert.kv_chunk_to_pb("r", target, layout_pb, chunk, last=(9, 42, 1), draft_token_ids=(7, 8, 9))
    assert list(pb.draft_token_ids) == [7, 8, 9]
    assert convert.kv_chunk_from_pb(pb).draft_token_ids == (7, 8, 9)
    middle = convert.kv_chunk_to_pb("r", target, layout_pb, chunk, draft_token_ids=(7,))
    assert list(middle.draft_token_ids) == []
    # an older prefill worker sends none: no proposals
    old = worker_pb2.KvChunk(request_id="r", transfer_ticket="t", last=True, num_tokens=9)
    assert convert.kv_chunk_from_pb(old).draft_token_ids == ()


def test_rank_load_speculation_counts_round_trip() -> None:
    from shared.cluster import RankLoad
    from shared.cluster_convert import rank_load_from_pb, rank_load_to_pb

    load = RankLoad(dp_rank=1, spec_draft_tokens=40, spec_accepted_tokens=30)
    pb = rank_load_to_pb(load)
    assert pb.HasField("spec_draft_tokens") and pb.spec_accepted_tokens == 30
    assert rank_load_from_pb(pb) == load
    assert load.spec_acceptance_rate == 0.75
    old = common_pb2.RankLoad(dp_rank=1)  # a worker older than 1.2
    assert not old.HasField("spec_draft_tokens")
    assert rank_load_from_pb(old).spec_acceptance_rate == 0.0


def test_priority_and_min_p_reach_the_engine_request_and_zero_stays_unset() -> None:
    """The gateway's worker calls carry priority (PrefillRequest / DecodeRequest) and min_p
    (SamplingParams); their defaults are left unset on the wire, as an older worker assumes."""
    from services.gateway import convert as gateway_convert
    from services.gateway.inputs import Sampling
    from services.gateway.ports import WorkerJob

    job = WorkerJob("r", (1, 2), Sampling(max_tokens=4, temperature=0.7, min_p=0.25), False, priority=-3)
    prefill = gateway_convert.prefill_request(job, 0, None)
    decode = gateway_convert.decode_request(job, 1, local_prefill=True)
    assert prefill.priority == decode.priority == -3
    assert abs(prefill.sampling.min_p - 0.25) < 1e-7
    assert convert.prefill_call_from_pb(prefill).request.priority == -3
    call = convert.decode_call_from_pb(decode)
    assert call.request.priority == -3 and abs(call.request.sampling.min_p - 0.25) < 1e-7
    plain = WorkerJob("r", (1, 2), Sampling(max_tokens=4), False)
    for pb in (
        gateway_convert.prefill_request(plain, 0, None),
        gateway_convert.decode_request(plain, 0, True),
    ):
        assert not pb.HasField("priority") and not pb.sampling.HasField("min_p")
    assert convert.prefill_call_from_pb(gateway_convert.prefill_request(plain, 0, None)).request.priority == 0


def test_the_lora_adapter_reaches_the_engine_and_the_base_model_leaves_it_unset() -> None:
    from services.gateway import convert as gateway_convert
    from services.gateway.inputs import Sampling
    from services.gateway.ports import WorkerJob

    job = WorkerJob("r", (1, 2), Sampling(max_tokens=4, lora_adapter="sql", cache_salt="t"), False)
    prefill = gateway_convert.prefill_request(job, 0, None)
    assert prefill.sampling.lora_adapter == "sql"
    assert convert.prefill_call_from_pb(prefill).request.sampling.lora_adapter == "sql"
    decode = convert.decode_call_from_pb(gateway_convert.decode_request(job, 0, local_prefill=True))
    assert (decode.request.sampling.lora_adapter, decode.request.sampling.cache_salt) == ("sql", "t")
    base = gateway_convert.decode_request(WorkerJob("r", (1,), Sampling(max_tokens=4), False), 0, True)
    assert not base.sampling.HasField("lora_adapter")  # what an older gateway sends
    assert convert.decode_call_from_pb(base).request.sampling.lora_adapter == ""


def test_skip_special_tokens_false_reaches_the_engine_and_true_stays_unset() -> None:
    from services.gateway import convert as gateway_convert
    from services.gateway.inputs import Sampling
    from services.gateway.ports import WorkerJob

    shown = WorkerJob("r", (1, 2), Sampling(max_tokens=4, skip_special_tokens=False), False)
    pb = gateway_convert.prefill_request(shown, 0, None)
    assert pb.sampling.HasField("skip_special_tokens") and not pb.sampling.skip_special_tokens
    assert convert.prefill_call_from_pb(pb).request.sampling.skip_special_tokens is False
    plain = gateway_convert.decode_request(WorkerJob("r", (1,), Sampling(max_tokens=4), False), 0, True)
    assert not plain.sampling.HasField("skip_special_tokens")  # what an older gateway sends
    assert convert.decode_call_from_pb(plain).request.sampling.skip_special_tokens is True


def test_allowed_token_ids_and_bad_words_reach_the_engine_as_token_ids() -> None:
    """The gateway's Sampling (bad words already tokenized) through the protobuf to the engine's
    SamplingConfig; unset, nothing goes on the wire (what an older gateway sends)."""
    from services.gateway import convert as gateway_convert
    from services.gateway.inputs import Sampling
    from services.gateway.ports import WorkerJob

    banned = Sampling(max_tokens=4, allowed_token_ids=(3, 9, 40), bad_words=((5,), (7, 8, 9)))
    pb = gateway_convert.prefill_request(WorkerJob("r", (1, 2), banned, False), 0, None)
    assert list(pb.sampling.allowed_token_ids) == [3, 9, 40]
    assert [list(w.token_ids) for w in pb.sampling.bad_words] == [[5], [7, 8, 9]]
    sp = convert.prefill_call_from_pb(pb).request.sampling
    assert sp.allowed_token_ids == (3, 9, 40) and sp.bad_words == ((5,), (7, 8, 9))
    assert sp.needs_history  # bad words look at the output so far
    plain = gateway_convert.decode_request(WorkerJob("r", (1,), Sampling(max_tokens=4), False), 0, True)
    assert not plain.sampling.allowed_token_ids and not plain.sampling.bad_words
    plain_sp = convert.decode_call_from_pb(plain).request.sampling
    assert plain_sp.allowed_token_ids == () and plain_sp.bad_words == () and not plain_sp.needs_history


def test_lora_changes_convert_to_both_responses() -> None:
    change = LoraChange(lora_adapters=("sql", "chat"), path="/adapters/chat", seconds=1.5)
    loaded = convert.lora_load_response(change)
    assert list(loaded.lora_adapters) == ["sql", "chat"] and loaded.load_ns == 1_500_000_000
    unloaded = convert.lora_unload_response(change)
    assert list(unloaded.lora_adapters) == ["sql", "chat"] and unloaded.path == "/adapters/chat"
