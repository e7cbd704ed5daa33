"""Every protobuf <-> worker domain conversion (the only worker module that knows both sides)."""

from __future__ import annotations

from collections.abc import Iterable

from services.worker.engine.api import (
    EngineRequest,
    KvBlocksChunk,
    RequestKind,
    SamplingConfig,
    TokenLogprobs,
)
from services.worker.engine.thinking_budget import ThinkingBudget
from services.worker.messages import (
    CudaIpcShare,
    DecodeCall,
    DecodeEvent,
    IncomingKvChunk,
    KvReceipt,
    KvTargetSpec,
    LoraChange,
    NixlSource,
    PrefillCall,
    PrefillResult,
)
from shared.cluster import DecodeFrameKind, KvTransport, RankLoad
from shared.cluster_convert import finish_reason_to_pb, kv_layout_from_pb, rank_load_to_pb
from shared.proto import common_pb2, worker_pb2
from shared.structured_output_pb import structured_from_pb

_FRAME_KIND_TO_PB = {
    DecodeFrameKind.ADMITTED: worker_pb2.DECODE_FRAME_KIND_ADMITTED,
    DecodeFrameKind.TOKENS: worker_pb2.DECODE_FRAME_KIND_TOKENS,
    DecodeFrameKind.FINAL: worker_pb2.DECODE_FRAME_KIND_FINAL,
}


def sampling_from_pb(pb: common_pb2.SamplingParams) -> SamplingConfig:
    """Proto defaults mean "unset": temperature 0 = greedy, top_p 0 = disabled (1)."""
    return SamplingConfig(
        max_tokens=pb.max_tokens,
        temperature=pb.temperature,
        top_p=pb.top_p if pb.top_p != 0 else 1.0,
        top_k=pb.top_k,
        min_p=pb.min_p,
        cache_salt=pb.cache_salt,
        lora_adapter=pb.lora_adapter,  # "" (unset, or an older gateway): the base model
        skip_special_tokens=pb.skip_special_tokens if pb.HasField("skip_special_tokens") else True,
        seed=pb.seed if pb.HasField("seed") else None,
        stop=tuple(pb.stop),
        stop_token_ids=tuple(pb.stop_token_ids),
        ignore_eos=pb.ignore_eos,
        include_stop_in_output=pb.include_stop_in_output,
        first_output_index=pb.first_output_index,
        unshown_tail_tokens=pb.unshown_tail_tokens,
        presence_penalty=pb.presence_penalty,
        frequency_penalty=pb.frequency_penalty,
        repetition_penalty=pb.repetition_penalty if pb.HasField("repetition_penalty") else 1.0,
        logit_bias=tuple(sorted(pb.logit_bias.items())),
        min_tokens=pb.min_tokens,
        allowed_token_ids=tuple(sorted(set(pb.allowed_token_ids))),
        bad_words=tuple(tuple(w.token_ids) for w in pb.bad_words if w.token_ids),
        thinking_budget=(
            thinking_budget_from_pb(pb.thinking_budget) if pb.HasField("thinking_budget") else None
        ),
        logprobs=pb.logprobs if pb.HasField("logprobs") else None,
        structured=structured_from_pb(pb.structured) if pb.HasField("structured") else None,
        prompt_logprobs=pb.prompt_logprobs if pb.HasField("prompt_logprobs") else None,
    )


def thinking_budget_from_pb(pb: common_pb2.ThinkingBudget) -> ThinkingBudget:
    return ThinkingBudget(
        max_tokens=pb.max_tokens,
        start_token_ids=tuple(pb.start_token_ids),
        end_token_ids=tuple(pb.end_token_ids),
        open_at_start=pb.open_at_start,
    )


def logprobs_to_pb(logprobs: Iterable[TokenLogprobs]) -> list[common_pb2.TokenLogprob]:
    return [
        common_pb2.TokenLogprob(
            token_id=lp.token_id,
            logprob=lp.logprob,
            top_logprobs=[common_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
            rank=lp.rank,
        )
        for lp in logprobs
    ]


def _engine_request(
    request_id: str,
    prompt: Iterable[int],
    sampling: common_pb2.SamplingParams,
    dp_rank: int,
    kind: RequestKind,
    priority: int = 0,
) -> EngineRequest:
    return EngineRequest(
        request_id=request_id,
        prompt_token_ids=tuple(prompt),
        sampling=sampling_from_pb(sampling),
        dp_rank=dp_rank,
        kind=kind,
        priority=priority,
    )


def prefill_call_from_pb(pb: worker_pb2.PrefillRequest) -> PrefillCall:
    target = None
    if pb.HasField("kv_target"):
        t = pb.kv_target
        target = KvTargetSpec(
            address=t.address,
            dp_rank=t.dp_rank,
            transfer_ticket=t.transfer_ticket,
            skip_blocks=t.skip_blocks,
            trim_blocks=t.trim_blocks if t.HasField("trim_blocks") else 0,
            nixl_parts=t.HasField("nixl_parts") and t.nixl_parts,
            reply_before_handoff=t.HasField("reply_before_handoff") and t.reply_before_handoff,
            transport=_transport_from_pb(t.kv_transport)
            if t.HasField("kv_transport")
            else KvTransport.GRPC_PUSH,
        )
    return PrefillCall(
        request=_engine_request(
            pb.request_id,
            pb.prompt_token_ids,
            pb.sampling,
            pb.dp_rank,
            RequestKind.PREFILL_ONLY,
            pb.priority,  # unset (an older gateway): 0
        ),
        kv_target=target,
        return_token_ids=pb.return_token_ids,
    )


_TRANSPORT_TO_PB = {
    KvTransport.GRPC_PUSH: worker_pb2.KV_TRANSPORT_GRPC_PUSH,
    KvTransport.NIXL: worker_pb2.KV_TRANSPORT_NIXL,
}


def _transport_from_pb(value: int) -> KvTransport:
    """NIXL only when asked for by name; anything else (unset, unknown) is the gRPC push."""
    return KvTransport.NIXL if value == worker_pb2.KV_TRANSPORT_NIXL else KvTransport.GRPC_PUSH


def prefill_result_to_pb(r: PrefillResult) -> worker_pb2.PrefillResponse:
    pb = _prefill_result_to_pb(r)
    if r.kv_transport is not None:
        pb.kv_transport = _TRANSPORT_TO_PB[r.kv_transport]
    return pb


def _prefill_result_to_pb(r: PrefillResult) -> worker_pb2.PrefillResponse:
    return worker_pb2.PrefillResponse(
        request_id=r.request_id,
        text=r.text,
        token_ids=r.token_ids,
        generated_tokens=r.generated_tokens,  # always set (presence = a 1.1 worker)
        finish_reason=finish_reason_to_pb(r.finish_reason),
        prompt_tokens=r.prompt_tokens,
        local_cached_tokens=r.local_cached_tokens,
        kv_bytes_sent=r.kv_bytes_sent,
        num_chunks=r.num_chunks,
        prefill_ns=r.prefill_ns,
        kv_transfer_ns=r.kv_transfer_ns,
        logprobs=logprobs_to_pb(r.logprobs),
        prompt_logprobs=logprobs_to_pb(r.prompt_logprobs),
    )


def decode_call_from_pb(pb: worker_pb2.DecodeRequest) -> DecodeCall:
    kind = RequestKind.FULL if pb.local_prefill else RequestKind.DECODE_REMOTE
    return DecodeCall(
        request=_engine_request(
            pb.request_id, pb.prompt_token_ids, pb.sampling, pb.dp_rank, kind, pb.priority
        ),
        local_prefill=pb.local_prefill,
        return_token_ids=pb.return_token_ids,
        transfer_ticket=pb.transfer_ticket if pb.HasField("transfer_ticket") else None,
    )


def decode_event_to_pb(e: DecodeEvent) -> worker_pb2.DecodeFrame:
    frame = worker_pb2.DecodeFrame(
        request_id=e.request_id,
        kind=_FRAME_KIND_TO_PB[e.kind],
        text=e.text,
        token_ids=e.token_ids,
        finish_reason=finish_reason_to_pb(e.finish_reason),
        transfer_ticket=e.transfer_ticket,
        cached_blocks=e.cached_blocks,
        prompt_tokens=e.prompt_tokens,
        local_cached_tokens=e.local_cached_tokens,
        transferred_cached_tokens=e.transferred_cached_tokens,
        logprobs=logprobs_to_pb(e.logprobs),
        prompt_logprobs=logprobs_to_pb(e.prompt_logprobs),
    )
    if e.generated_tokens is not None:  # FINAL only; unset (not 0) on the other frames
        frame.generated_tokens = e.generated_tokens
    if e.trim_blocks:  # ADMITTED on a windowed model only
        frame.trim_blocks = e.trim_blocks
    return frame


def kv_chunk_from_pb(pb: worker_pb2.KvChunk) -> IncomingKvChunk:
    return IncomingKvChunk(
        request_id=pb.request_id,
        transfer_ticket=pb.transfer_ticket,
        dp_rank=pb.dp_rank,
        layout=kv_layout_from_pb(pb.layout) if pb.HasField("layout") else None,
        chunk=KvBlocksChunk(
            first_block=pb.first_block, num_blocks=pb.num_blocks, data=pb.data, layers=tuple(pb.kv_layers)
        ),
        last=pb.last,
        num_tokens=pb.num_tokens,
        first_token_id=pb.first_token_id if pb.HasField("first_token_id") else None,
        generated_tokens=pb.generated_tokens if pb.HasField("generated_tokens") else None,
        draft_token_ids=tuple(pb.draft_token_ids),
        nixl_source=nixl_source_from_pb(pb.nixl_source) if pb.HasField("nixl_source") else None,
    )


def nixl_source_from_pb(pb: worker_pb2.NixlKvSource) -> NixlSource:
    return NixlSource(
        agent_name=pb.agent_name,
        agent_metadata=pb.agent_metadata,
        pool_address=pb.pool_address,
        pool_slots=pb.pool_slots,
        device_id=pb.device_id,
        mem_type=pb.mem_type,
        block_ids=tuple(pb.block_ids),
        first_block=pb.first_block,
        cuda_ipc=cuda_ipc_share_from_pb(pb.cuda_ipc) if pb.HasField("cuda_ipc") else None,
    )


def cuda_ipc_share_from_pb(pb: worker_pb2.CudaIpcShare) -> CudaIpcShare:
    return CudaIpcShare(
        host_id=pb.host_id,
        device_index=pb.device_index,
        mem_handle=pb.mem_handle,
        storage_bytes=pb.storage_bytes,
        storage_offset=pb.storage_offset,
        ref_counter_handle=pb.ref_counter_handle,
        ref_counter_offset=pb.ref_counter_offset,
        event_handle=pb.event_handle,
        event_sync_required=pb.event_sync_required,
    )


def cuda_ipc_share_to_pb(s: CudaIpcShare) -> worker_pb2.CudaIpcShare:
    return worker_pb2.CudaIpcShare(
        host_id=s.host_id,
        device_index=s.device_index,
        mem_handle=s.mem_handle,
        storage_bytes=s.storage_bytes,
        storage_offset=s.storage_offset,
        ref_counter_handle=s.ref_counter_handle,
        ref_counter_offset=s.ref_counter_offset,
        event_handle=s.event_handle,
        event_sync_required=s.event_sync_required,
    )


def nixl_source_to_pb(s: NixlSource) -> worker_pb2.NixlKvSource:
    return worker_pb2.NixlKvSource(
        agent_name=s.agent_name,
        agent_metadata=s.agent_metadata,
        pool_address=s.pool_address,
        pool_slots=s.pool_slots,
        device_id=s.device_id,
        mem_type=s.mem_type,
        block_ids=s.block_ids,
        first_block=s.first_block,
        cuda_ipc=None if s.cuda_ipc is None else cuda_ipc_share_to_pb(s.cuda_ipc),
    )


def kv_chunk_to_pb(
    request_id: str,
    target: KvTargetSpec,
    layout: common_pb2.KvLayout,
    chunk: KvBlocksChunk,
    last: tuple[int, int | None, int] | None = None,
    draft_token_ids: tuple[int, ...] = (),
    nixl_source: NixlSource | None = None,
) -> worker_pb2.KvChunk:
    """One outgoing chunk; `last` = (num_tokens, first_token_id, generated_tokens) on the last
    (first_token_id None: the request finished at its first token, nothing to decode), with the
    prefill side's proposals `draft_token_ids`."""
    pb = worker_pb2.KvChunk(
        request_id=request_id,
        transfer_ticket=target.transfer_ticket,
        dp_rank=target.dp_rank,
        first_block=chunk.first_block,
        num_blocks=chunk.num_blocks,
        data=chunk.data,
        layout=layout,
        kv_layers=chunk.layers,
    )
    if last is not None:
        num_tokens, first_token_id, generated_tokens = last
        pb.num_tokens = num_tokens
        if first_token_id is not None:
            pb.first_token_id = first_token_id
        pb.generated_tokens = generated_tokens
        pb.draft_token_ids.extend(draft_token_ids)
        pb.last = True
    if nixl_source is not None:
        pb.nixl_source.CopyFrom(nixl_source_to_pb(nixl_source))
    return pb


def kv_receipt_to_pb(r: KvReceipt) -> worker_pb2.PushKvResponse:
    pb = worker_pb2.PushKvResponse(bytes_received=r.bytes_received, blocks_received=r.blocks_received)
    if r.read_ns is not None:
        pb.kv_read_ns = r.read_ns
    if r.recomputing:
        pb.recomputing = True
    return pb


def get_load_to_pb(worker_id: str, loads: Iterable[RankLoad]) -> worker_pb2.GetLoadResponse:
    return worker_pb2.GetLoadResponse(worker_id=worker_id, ranks=[rank_load_to_pb(load) for load in loads])


def lora_load_response(change: LoraChange) -> worker_pb2.LoadLoraAdapterResponse:
    return worker_pb2.LoadLoraAdapterResponse(
        lora_adapters=list(change.lora_adapters), load_ns=int(change.seconds * 1e9)
    )


def lora_unload_response(change: LoraChange) -> worker_pb2.UnloadLoraAdapterResponse:
    return worker_pb2.UnloadLoraAdapterResponse(lora_adapters=list(change.lora_adapters), path=change.path)
