"""Protobuf <-> domain conversion for the gateway (the only module besides clients/servicer that
touches generated stubs). Presence of optional fields is read with HasField, never from zeros."""

from __future__ import annotations

from collections.abc import Iterable

from services.gateway.accounting import Usage
from services.gateway.inputs import ChatTurn, GenerateInput, Sampling, TokenLogprob
from services.gateway.lora_admin import LoraUpdate
from services.gateway.ports import (
    ClusterState,
    ClusterWorker,
    DecodeEvent,
    KvDestination,
    ModelCard,
    Placement,
    PrefillResult,
    ScheduleQuery,
    WorkerJob,
    WorkerTarget,
)
from services.gateway.request import Completion, OutputFrame, OutputFrameKind
from services.gateway.tokenization import Tokenized
from shared.cluster import KvTransport, lora_adapter_bases
from shared.cluster_convert import (
    decode_frame_kind_from_pb,
    finish_reason_from_pb,
    finish_reason_to_pb,
    role_from_pb,
    serving_mode_from_pb,
)
from shared.proto import common_pb2, gateway_pb2, scheduler_pb2, worker_pb2
from shared.structured_output_pb import structured_from_pb, structured_to_pb

_FRAME_KIND_TO_PB = {
    OutputFrameKind.FIRST: gateway_pb2.FRAME_KIND_FIRST,
    OutputFrameKind.CONTINUATION: gateway_pb2.FRAME_KIND_CONTINUATION,
    OutputFrameKind.FINAL: gateway_pb2.FRAME_KIND_FINAL,
}

# an unknown enum value (a newer client) stays as its number: validation refuses it by name
_TRUNCATION_SIDES = {
    gateway_pb2.TRUNCATION_SIDE_UNSPECIFIED: "left",  # vLLM's default
    gateway_pb2.TRUNCATION_SIDE_LEFT: "left",
    gateway_pb2.TRUNCATION_SIDE_RIGHT: "right",
}


# --- public API ---
def generate_input(req: gateway_pb2.GenerateRequest) -> GenerateInput:
    return GenerateInput(
        model=req.model,
        prompt=req.prompt,
        prompt_token_ids=tuple(req.prompt_token_ids),
        messages=tuple(ChatTurn(m.role, m.content) for m in req.messages),
        max_tokens=req.max_tokens if req.HasField("max_tokens") else None,
        temperature=req.temperature if req.HasField("temperature") else None,
        top_p=req.top_p if req.HasField("top_p") else None,
        top_k=req.top_k if req.HasField("top_k") else None,
        min_p=req.min_p if req.HasField("min_p") else None,
        cache_salt=req.cache_salt,
        skip_special_tokens=req.skip_special_tokens if req.HasField("skip_special_tokens") else True,
        priority=req.priority,
        continue_final_message=req.continue_final_message,
        add_generation_prompt=req.add_generation_prompt if req.HasField("add_generation_prompt") else True,
        truncate_prompt_tokens=req.truncate_prompt_tokens if req.HasField("truncate_prompt_tokens") else None,
        truncation_side=_TRUNCATION_SIDES.get(req.truncation_side, f"TruncationSide {req.truncation_side}"),
        seed=req.seed if req.HasField("seed") else None,
        stop=tuple(req.stop),
        stop_token_ids=tuple(req.stop_token_ids),
        ignore_eos=req.ignore_eos,
        return_token_ids=req.return_token_ids,
        request_id=req.request_id,
        include_stop_in_output=req.include_stop_in_output,
        presence_penalty=req.presence_penalty if req.HasField("presence_penalty") else None,
        frequency_penalty=req.frequency_penalty if req.HasField("frequency_penalty") else None,
        repetition_penalty=req.repetition_penalty if req.HasField("repetition_penalty") else None,
        logit_bias=tuple(req.logit_bias.items()),
        min_tokens=req.min_tokens if req.HasField("min_tokens") else None,
        # a repeated field has no presence: empty is unset
        allowed_token_ids=tuple(req.allowed_token_ids) or None,
        bad_words=tuple(req.bad_words),
        thinking_token_budget=req.thinking_token_budget if req.HasField("thinking_token_budget") else None,
        logprobs=req.logprobs if req.HasField("logprobs") else None,
        structured=structured_from_pb(req.structured) if req.HasField("structured") else None,
        prompt_logprobs=req.prompt_logprobs if req.HasField("prompt_logprobs") else None,
    )


def logprobs_to_pb(logprobs: tuple[TokenLogprob, ...]) -> list[common_pb2.TokenLogprob]:
    return [
        common_pb2.TokenLogprob(
            token_id=lp.token_id,
            logprob=lp.logprob,
            top_logprobs=[common_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
            rank=lp.rank,
        )
        for lp in logprobs
    ]


def logprobs_from_pb(logprobs: Iterable[common_pb2.TokenLogprob]) -> tuple[TokenLogprob, ...]:
    if not logprobs:  # most frames carry none: no generator and tuple built per token for nothing
        return ()
    return tuple(
        TokenLogprob(
            lp.token_id,
            lp.logprob,
            tuple((t.token_id, t.logprob) for t in lp.top_logprobs),
            lp.rank if lp.HasField("rank") else None,  # unset from a worker older than 1.18
        )
        for lp in logprobs
    )


def usage_to_pb(usage: Usage) -> common_pb2.Usage:
    return common_pb2.Usage(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        cached_tokens=usage.cached_tokens,
        local_cached_tokens=usage.cache.local_tokens,
        transferred_cached_tokens=usage.cache.transferred_tokens,
        total_tokens=usage.total_tokens,
    )


def generate_response(frame: OutputFrame) -> gateway_pb2.GenerateResponse:
    msg = gateway_pb2.GenerateResponse(
        request_id=frame.request_id,
        text=frame.text,
        token_ids=frame.token_ids,
        finish_reason=finish_reason_to_pb(frame.finish_reason),
        kind=_FRAME_KIND_TO_PB[frame.kind],
        prompt_tokens=frame.prompt_tokens,
        cached_tokens=frame.cached_tokens,
        model=frame.model,
        logprobs=logprobs_to_pb(frame.logprobs),
        # the gRPC API sends the prompt's ids with its prompt logprobs only (gateway.proto)
        prompt_token_ids=frame.prompt_token_ids if frame.prompt_logprobs else (),
        prompt_logprobs=logprobs_to_pb(frame.prompt_logprobs),
    )
    if frame.usage is not None:
        msg.usage.CopyFrom(usage_to_pb(frame.usage))
    return msg


def complete_response(done: Completion) -> gateway_pb2.CompleteResponse:
    return gateway_pb2.CompleteResponse(
        request_id=done.request_id,
        text=done.text,
        token_ids=done.token_ids,
        finish_reason=finish_reason_to_pb(done.finish_reason),
        usage=usage_to_pb(done.usage),
        model=done.model,
        logprobs=logprobs_to_pb(done.logprobs),
        prompt_token_ids=done.prompt_token_ids if done.prompt_logprobs else (),
        prompt_logprobs=logprobs_to_pb(done.prompt_logprobs),
    )


def list_models_response(cards: list[ModelCard]) -> gateway_pb2.ListModelsResponse:
    return gateway_pb2.ListModelsResponse(
        models=[
            gateway_pb2.ModelCard(id=c.id, max_model_len=c.max_model_len, parent=c.parent or None)
            for c in cards
        ]
    )


def tokenize_input(req: gateway_pb2.TokenizeRequest) -> GenerateInput:
    """Tokenize's prompt or messages as the GenerateInput whose prompt it asks for."""
    return GenerateInput(
        model=req.model,
        prompt=req.prompt,
        messages=tuple(ChatTurn(m.role, m.content) for m in req.messages),
        continue_final_message=req.continue_final_message,
        add_generation_prompt=req.add_generation_prompt if req.HasField("add_generation_prompt") else True,
    )


def tokenize_response(t: Tokenized) -> gateway_pb2.TokenizeResponse:
    return gateway_pb2.TokenizeResponse(
        token_ids=t.token_ids,
        count=len(t.token_ids),
        max_model_len=t.max_model_len,
        model=t.model,
        token_strs=t.token_strs,
    )


# --- scheduler ---
def schedule_request(q: ScheduleQuery) -> scheduler_pb2.ScheduleRequest:
    return scheduler_pb2.ScheduleRequest(
        request_id=q.request_id,
        model=q.model,
        prompt_tokens=q.prompt_tokens,
        prefix_block_hashes=q.prefix_block_hashes,
        max_tokens=q.max_tokens,
        exclude_worker_ids=q.exclude_worker_ids,
    )


def _target(t: scheduler_pb2.WorkerTarget) -> WorkerTarget:
    return WorkerTarget(t.worker_id, t.address, t.dp_rank, tuple(t.capabilities))


def placement(resp: scheduler_pb2.ScheduleResponse) -> Placement:
    """Raises ValueError on a response the gateway cannot act on (caller maps it)."""
    mode = serving_mode_from_pb(resp.mode)
    if mode is None:
        raise ValueError(f"unknown serving mode {resp.mode}")
    if not resp.HasField("decode") or not resp.decode.address:
        raise ValueError("no decode worker in the schedule response")
    prefill = _target(resp.prefill) if resp.HasField("prefill") and resp.prefill.address else None
    return Placement(mode, _target(resp.decode), prefill, resp.model, resp.max_model_len)


def model_cards(state: scheduler_pb2.GetStateResponse) -> list[ModelCard]:
    """Distinct model ids of registered workers, then each LoRA adapter they list (parent: its
    base model, by the scheduler's own rule, shared.cluster.lora_adapter_bases); max_model_len is
    the smallest a worker serving it reports (a request must fit wherever it lands), 0 when none
    reports one."""
    infos = [w.info for w in state.workers if w.info.model_id]
    bases = lora_adapter_bases(infos)
    lens: dict[str, list[int]] = {}
    for info in infos:
        served = [info.model_id, *(a for a in info.lora_adapters if bases.get(a) == info.model_id)]
        for model in served:
            known = lens.setdefault(model, [])
            if info.max_model_len > 0:
                known.append(info.max_model_len)
    return [
        ModelCard(m, min(lens[m], default=0), bases.get(m, ""))
        for m in sorted(lens, key=lambda m: (m in bases, m))  # base models first
    ]


def cluster_state(state: scheduler_pb2.GetStateResponse) -> ClusterState:
    """The workers the scheduler routes to (a worker of an unknown role is left out: no update
    reaches a worker the gateway cannot name)."""
    workers = []
    for w in state.workers:
        role = role_from_pb(w.info.role)
        if role is None or not w.info.address:
            continue
        workers.append(
            ClusterWorker(
                worker_id=w.info.worker_id,
                address=w.info.address,
                role=role,
                model_id=w.info.model_id,
                capabilities=tuple(w.info.capabilities),
                lora_adapters=tuple(w.info.lora_adapters),
            )
        )
    return ClusterState(tuple(workers), state.stale)


def load_lora_adapter_response(update: LoraUpdate) -> gateway_pb2.GatewayLoadLoraAdapterResponse:
    return gateway_pb2.GatewayLoadLoraAdapterResponse(worker_ids=list(update.worker_ids))


def unload_lora_adapter_response(update: LoraUpdate) -> gateway_pb2.GatewayUnloadLoraAdapterResponse:
    return gateway_pb2.GatewayUnloadLoraAdapterResponse(worker_ids=list(update.worker_ids))


# --- workers ---
def sampling_to_pb(s: Sampling) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        max_tokens=s.max_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        stop=s.stop,
        stop_token_ids=s.stop_token_ids,
        ignore_eos=s.ignore_eos,
        include_stop_in_output=s.include_stop_in_output,
    )
    if s.seed is not None:
        msg.seed = s.seed
    if s.min_p:
        msg.min_p = s.min_p
    if s.cache_salt:
        msg.cache_salt = s.cache_salt
    if s.lora_adapter:  # unset: the base model (what an older worker serves)
        msg.lora_adapter = s.lora_adapter
    if not s.skip_special_tokens:  # unset: hidden (what an older worker does)
        msg.skip_special_tokens = False
    if s.first_output_index:
        msg.first_output_index = s.first_output_index
    if s.unshown_tail_tokens:
        msg.unshown_tail_tokens = s.unshown_tail_tokens
    if s.presence_penalty:
        msg.presence_penalty = s.presence_penalty
    if s.frequency_penalty:
        msg.frequency_penalty = s.frequency_penalty
    if s.repetition_penalty != 1.0:
        msg.repetition_penalty = s.repetition_penalty
    for token_id, bias in s.logit_bias:
        msg.logit_bias[token_id] = bias
    if s.min_tokens:
        msg.min_tokens = s.min_tokens
    msg.allowed_token_ids.extend(s.allowed_token_ids)
    for sequence in s.bad_words:
        msg.bad_words.add(token_ids=sequence)
    if s.thinking_budget is not None:
        tb = s.thinking_budget
        msg.thinking_budget.max_tokens = tb.max_tokens
        msg.thinking_budget.start_token_ids.extend(tb.start_token_ids)
        msg.thinking_budget.end_token_ids.extend(tb.end_token_ids)
        msg.thinking_budget.open_at_start = tb.open_at_start
    if s.logprobs is not None:
        msg.logprobs = s.logprobs
    if s.structured is not None:
        msg.structured.CopyFrom(structured_to_pb(s.structured))
    if s.prompt_logprobs is not None:
        msg.prompt_logprobs = s.prompt_logprobs
    return msg


def decode_request(
    job: WorkerJob, dp_rank: int, local_prefill: bool, transfer_ticket: str | None = None
) -> worker_pb2.DecodeRequest:
    return worker_pb2.DecodeRequest(
        request_id=job.request_id,
        prompt_token_ids=job.prompt_token_ids,
        sampling=sampling_to_pb(job.sampling),
        dp_rank=dp_rank,
        local_prefill=local_prefill,
        return_token_ids=job.return_token_ids,
        transfer_ticket=transfer_ticket,  # None leaves it unset
        priority=job.priority or None,  # unset when 0: what an older worker would assume
    )


def prefill_request(job: WorkerJob, dp_rank: int, kv: KvDestination | None) -> worker_pb2.PrefillRequest:
    msg = worker_pb2.PrefillRequest(
        request_id=job.request_id,
        prompt_token_ids=job.prompt_token_ids,
        sampling=sampling_to_pb(job.sampling),
        dp_rank=dp_rank,
        return_token_ids=job.return_token_ids,
        priority=job.priority or None,  # unset when 0
    )
    if kv is not None:
        msg.kv_target.CopyFrom(
            worker_pb2.KvTarget(
                address=kv.address,
                dp_rank=kv.dp_rank,
                transfer_ticket=kv.transfer_ticket,
                skip_blocks=kv.skip_blocks,
            )
        )
        if kv.transport is KvTransport.NIXL:  # unset means the gRPC push, for any worker version
            msg.kv_target.kv_transport = worker_pb2.KV_TRANSPORT_NIXL
        if kv.trim_blocks is not None:  # a 1.7 or older prefill worker ignores it: sends all
            msg.kv_target.trim_blocks = kv.trim_blocks
        if kv.nixl_parts:  # a 1.9 or older prefill worker ignores it: one message at the end
            msg.kv_target.nixl_parts = True
        if kv.reply_before_handoff:  # a 1.10 or older prefill worker ignores it: replies after
            msg.kv_target.reply_before_handoff = True
    return msg


def decode_event(frame: worker_pb2.DecodeFrame) -> DecodeEvent:
    kind = decode_frame_kind_from_pb(frame.kind)
    if kind is None:
        raise ValueError(f"decode frame of unknown kind {frame.kind}")
    return DecodeEvent(
        kind=kind,
        text=frame.text,
        token_ids=tuple(frame.token_ids),
        generated_tokens=frame.generated_tokens if frame.HasField("generated_tokens") else None,
        finish_reason=finish_reason_from_pb(frame.finish_reason),
        transfer_ticket=frame.transfer_ticket,
        cached_blocks=frame.cached_blocks,
        trim_blocks=frame.trim_blocks if frame.HasField("trim_blocks") else None,
        local_cached_tokens=frame.local_cached_tokens,
        transferred_cached_tokens=frame.transferred_cached_tokens,
        logprobs=logprobs_from_pb(frame.logprobs),
        prompt_logprobs=logprobs_from_pb(frame.prompt_logprobs),
    )


def prefill_result(resp: worker_pb2.PrefillResponse) -> PrefillResult:
    return PrefillResult(
        text=resp.text,
        token_ids=tuple(resp.token_ids),
        generated_tokens=resp.generated_tokens if resp.HasField("generated_tokens") else None,
        finish_reason=finish_reason_from_pb(resp.finish_reason),
        local_cached_tokens=resp.local_cached_tokens,
        logprobs=logprobs_from_pb(resp.logprobs),
        prompt_logprobs=logprobs_from_pb(resp.prompt_logprobs),
    )
