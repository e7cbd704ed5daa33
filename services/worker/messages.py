"""Typed messages between the worker's servicer and its domain core (no grpc, no protobuf here)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from services.worker.engine.api import EngineRequest, KvBlocksChunk, TokenLogprobs
from shared.cluster import GATEWAY_TICKET_CAPABILITY, DecodeFrameKind, FinishReason, KvLayout, KvTransport

# Capabilities this worker advertises at registration and in Info (worker.proto WorkerInfo).
CAPABILITIES = (
    "generated_tokens",
    "kv_block_skip",
    "local_prefill",
    "draft_token_ids",
    "first_output_index",
    "sampling_penalties",
    "logprobs",
    "structured_outputs",
    "prompt_logprobs",
    "min_p",
    "priority",
    "structured_grammar",
    "cache_salt",
    "lora",
    "show_special_tokens",
    "allowed_token_ids",
    "bad_words",
    "thinking_token_budget",
    GATEWAY_TICKET_CAPABILITY,
)
# Contract version implemented: 1.0 = compat/v1.0; 1.1 added the optional generated_tokens fields;
# 1.2 added KvChunk.draft_token_ids and RankLoad's speculative-decoding counts.
# 1.3 added SamplingParams.first_output_index and unshown_tail_tokens (request migration).
# 1.4 added SamplingParams' penalties, logit_bias and min_tokens (capability "sampling_penalties").
# 1.5 added SamplingParams.logprobs and the logprobs of PrefillResponse / DecodeFrame ("logprobs").
# 1.6 added SamplingParams.structured (capability "structured_outputs").
# 1.7 added KvTarget.kv_transport, KvChunk.nixl_source and the NIXL fields of PushKvResponse and
# PrefillResponse (a worker whose NIXL agent is up also advertises shared.cluster.NIXL_CAPABILITY).
# 1.8 added DecodeFrame.trim_blocks, KvTarget.trim_blocks and KvChunk.kv_layers (a handoff moves
# only the KV the decode side can still read past its sliding windows; engine/kv_trim.py).
# 1.9 added SamplingParams.prompt_logprobs and the prompt logprobs of PrefillResponse / DecodeFrame
# (capability "prompt_logprobs"); max_tokens may be 0 with them (the prompt is only scored).
# 1.10 added KvTarget.nixl_parts: a NIXL handoff in one PushKv message per prefill chunk, READ as
# they arrive (capability shared.cluster.NIXL_PARTS_CAPABILITY, "kv_nixl_parts").
# 1.11 added KvTarget.reply_before_handoff: the Prefill reply goes out at the first token and the
# handoff ends after it (the gateway streams the first token while the KV moves); and
# DecodeRequest.transfer_ticket (capability shared.cluster.GATEWAY_TICKET_CAPABILITY): the gateway
# chooses the ticket and starts the prefill while the decode worker admits.
# 1.12 added SamplingParams.min_p (capability "min_p"), PrefillRequest / DecodeRequest
# .priority (capability "priority"), StructuredOutput.grammar ("structured_grammar") and
# SamplingParams.cache_salt ("cache_salt").
# 1.13 added SamplingParams.lora_adapter and WorkerInfo.lora_adapters (capability "lora"): a
# request names the LoRA adapter serving it, one of those the worker lists (--lora-modules).
# 1.14 added Worker.LoadLoraAdapter / UnloadLoraAdapter (capability
# shared.cluster.LORA_RUNTIME_CAPABILITY, "lora_runtime", on workers with --enable-lora or
# --lora-modules): adapters loaded and unloaded while the worker runs; the worker registers again
# with its new WorkerInfo.lora_adapters after each change.
# 1.14 also added SamplingParams.skip_special_tokens (capability "show_special_tokens").
# 1.15 added SamplingParams.allowed_token_ids (capability "allowed_token_ids") and bad_words
# (token sequences; capability "bad_words"), and GenerateRequest's fields of the same names.
# 1.16 added GenerateRequest.truncation_side (the gateway's; nothing a worker reads changed).
# 1.17 added SamplingParams.thinking_budget (capability "thinking_token_budget") and
# GenerateRequest.thinking_token_budget.
# 1.18 added TokenLogprob.rank (no capability: an output field, so an older worker only leaves it
# unset and the gateway falls back to the prompt token's place among the alternatives, or null).
PROTO_VERSION = "1.19"


@dataclass(frozen=True)
class LoraChange:
    """What a LoRA adapter's load or unload left on this worker."""

    lora_adapters: tuple[str, ...]  # the adapters served now, in the engine's order
    path: str  # the adapter's folder (loaded from, or the one it had been loaded from)
    seconds: float  # time the change took on the worker, its wait for an earlier change included


@dataclass(frozen=True)
class KvTargetSpec:
    """Where a prefill worker pushes a request's KV (a decode worker's admitted request)."""

    address: str
    dp_rank: int
    transfer_ticket: str
    skip_blocks: int  # leading full prompt blocks the decode side already holds (count)
    transport: KvTransport = KvTransport.GRPC_PUSH  # negotiated by the gateway
    # leading prompt blocks of which only the full-attention layers are sent, none when every
    # layer is windowed (count; the decode side's engine/kv_trim.py); 0: every block whole
    trim_blocks: int = 0
    # NIXL: the decode worker takes the descriptors in several messages, one per prefill chunk
    nixl_parts: bool = False
    # the Prefill reply (the first token) goes out before the handoff ends (1.11)
    reply_before_handoff: bool = False


@dataclass(frozen=True)
class PrefillCall:
    request: EngineRequest
    kv_target: KvTargetSpec | None
    return_token_ids: bool


@dataclass(frozen=True)
class PrefillResult:
    request_id: str
    text: str
    token_ids: tuple[int, ...]  # empty unless return_token_ids
    generated_tokens: int  # authoritative: 1, or 0 on an immediate EOS
    finish_reason: FinishReason | None  # set when the request already finished
    prompt_tokens: int
    local_cached_tokens: int
    kv_bytes_sent: int
    num_chunks: int
    prefill_ns: int
    kv_transfer_ns: int
    logprobs: tuple[TokenLogprobs, ...] = ()  # the first token's, when sampling.logprobs is set
    # with sampling.prompt_logprobs: one entry per prompt token from the second on
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()
    kv_transport: KvTransport | None = None  # None: no KV moved


@dataclass(frozen=True)
class DecodeCall:
    request: EngineRequest
    local_prefill: bool
    return_token_ids: bool
    transfer_ticket: str | None = None  # the gateway's choice (1.11); None: this worker issues one


@dataclass(frozen=True)
class DecodeEvent:
    """One Decode stream frame. generated_tokens and finish_reason are set on FINAL only."""

    request_id: str
    kind: DecodeFrameKind
    prompt_tokens: int
    local_cached_tokens: int
    transferred_cached_tokens: int
    text: str = ""
    token_ids: tuple[int, ...] = ()
    generated_tokens: int | None = None
    finish_reason: FinishReason | None = None
    transfer_ticket: str = ""
    cached_blocks: int = 0
    logprobs: tuple[TokenLogprobs, ...] = ()  # per generated token of the frame (when asked)
    trim_blocks: int = 0  # ADMITTED: Admission.num_trim_blocks (0: sent unset)
    # with sampling.prompt_logprobs, on the first frame after a local prefill only
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()


@dataclass(frozen=True)
class NixlSource:
    """Where a request's KV blocks lie in a prefill worker's registered pool (worker.proto
    NixlKvSource): what a decode worker needs to READ them."""

    agent_name: str
    agent_metadata: bytes
    pool_address: int  # the rank pool's address in the prefill worker's memory
    pool_slots: int  # slots per (layer, K/V, head) plane of that pool (tokens)
    device_id: int
    mem_type: str  # "DRAM" | "VRAM"
    block_ids: tuple[int, ...]  # pool block ids of the request's blocks from first_block on
    first_block: int  # index of block_ids[0] in the request's block table
    # the pool shared through CUDA IPC (a GPU pool; 1.19): a decode worker on the same host
    # copies from it directly (kv_cuda_ipc.py); None: NIXL READ only
    cuda_ipc: CudaIpcShare | None = None


@dataclass(frozen=True)
class CudaIpcShare:
    """A GPU KV pool shared through CUDA IPC (worker.proto CudaIpcShare): torch's
    `UntypedStorage._share_cuda_` values, and the host they can be opened on."""

    host_id: str  # the sharing host's boot id
    device_index: int  # the pool's GPU in the sharing process
    mem_handle: bytes  # cudaIpcMemHandle of the allocation holding the pool's storage
    storage_bytes: int  # size of the storage (bytes)
    storage_offset: int  # where the storage starts in that allocation (bytes)
    ref_counter_handle: bytes  # torch's shared-memory reference counter (its name)
    ref_counter_offset: int
    event_handle: bytes  # cudaIpcEventHandle of the sharing stream's event (b"": none)
    event_sync_required: bool

    def key(self) -> tuple[str, bytes, int]:
        """One share's identity (a restarted peer's pool is another share)."""
        return self.host_id, self.mem_handle, self.storage_offset


@dataclass(frozen=True)
class IncomingKvChunk:
    """One received KvChunk. Fields of the last chunk are None/0 on the others."""

    request_id: str
    transfer_ticket: str
    dp_rank: int
    layout: KvLayout | None
    chunk: KvBlocksChunk
    last: bool
    num_tokens: int
    first_token_id: int | None
    generated_tokens: int | None  # None: an old (v1.0) prefill worker, which means 1
    # the prefill worker's proposals after the first token (empty: none, or an older worker)
    draft_token_ids: tuple[int, ...] = ()
    nixl_source: NixlSource | None = None  # set: READ the blocks over NIXL (no data in the chunk)


@dataclass(frozen=True)
class KvReceipt:
    bytes_received: int
    blocks_received: int
    read_ns: int | None = None  # NIXL: the READ's time on the decode side, its wait included
    recomputing: bool = False  # NIXL: the READ failed, the decode worker recomputes the prompt


@dataclass(frozen=True)
class KvPushResult:
    bytes_sent: int  # KV bytes that moved (over NIXL: the bytes the decode side READ)
    num_chunks: int  # PushKv messages sent
    seconds: float  # the whole handoff, as the prefill worker saw it
    transport: KvTransport = KvTransport.GRPC_PUSH
    read_seconds: float | None = None  # NIXL: the decode side's READ
    recomputing: bool = False  # NIXL: the decode worker recomputes instead (its READ failed)


@dataclass(frozen=True)
class KvHandoff:
    """A finished prefill's handoff to a decode worker: what the last KvChunk carries."""

    request_id: str
    layout: KvLayout
    num_tokens: int  # prompt tokens covered by the KV
    first_token_id: int | None  # None: the request finished at its first token, no KV moves
    generated_tokens: int
    draft_token_ids: tuple[int, ...] = ()  # proposals for the decode worker's first step


class KvPusher(Protocol):
    """Sends a finished prefill's KV to a decode worker over the gRPC push (kv_transfer)."""

    async def push(
        self,
        request_id: str,
        target: KvTargetSpec,
        layout: KvLayout,
        chunks: Iterator[KvBlocksChunk],
        num_tokens: int,
        first_token_id: int | None,
        generated_tokens: int,
        draft_token_ids: tuple[int, ...] = (),
    ) -> KvPushResult:
        """first_token_id None: the request already finished at its first token.
        draft_token_ids: proposals for the decode worker's first step to verify."""
        ...


class EarlyPush(Protocol):
    """The handoff of one prefill running in several chunks, started at its first chunk
    (kv_transfer.EarlyKvPush over gRPC, kv_send_nixl.EarlyNixlPush over NIXL)."""

    num_early_blocks: int  # blocks sent before the prefill ended (count)

    def ready(self, num_computed_tokens: int) -> None:
        """The prompt's first num_computed_tokens have their K/V: send the complete blocks."""
        ...

    async def finish(self, handoff: KvHandoff) -> KvPushResult:
        """The rest and the handoff fields; waits for the decode worker's answer."""
        ...

    def cancel(self) -> None:
        """The prefill failed: end the stream unfinished (the decode worker aborts)."""
        ...


class KvSender(Protocol):
    """One KV transport's sending side, as the worker core uses it (kv_transfer: the gRPC push
    and NIXL). The blocks stay held on this worker until `send` returns or raises."""

    transport: KvTransport

    def takes_early(self, target: KvTargetSpec) -> bool:
        """Whether a prefill in several chunks hands its KV over as it goes (`start_early`)."""
        ...

    def start_early(self, request_id: str, target: KvTargetSpec, layout: KvLayout) -> EarlyPush | None:
        """Open the handoff at the prefill's first chunk (None: at the end after all)."""
        ...

    async def send(self, handoff: KvHandoff, target: KvTargetSpec) -> KvPushResult:
        """Move the KV of handoff.request_id (its blocks from target.skip_blocks on) and the
        handoff fields to the decode worker. Raises like GrpcKvPusher.push."""
        ...
