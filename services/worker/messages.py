"""Typed messages between the worker's servicer and its domain core (no grpc, no protobuf here)."""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from services.worker.engine.api import EngineRequest, KvBlocksChunk, TokenLogprobs
from shared.cluster import FinishReason, KvLayout

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
)
# Contract version implemented: 1.0 = compat/v1.0; 1.1 added the optional generated_tokens fields;
# 1.2 added KvChunk.draft_token_ids and RankLoad's speculative-decoding counts.
# 1.3 added SamplingParams.first_output_index and unshown_tail_tokens (request migration).
# 1.4 added SamplingParams' penalties, logit_bias and min_tokens (capability "sampling_penalties").
# 1.5 added SamplingParams.logprobs and the logprobs of PrefillResponse / DecodeFrame ("logprobs").
# 1.6 added SamplingParams.structured (capability "structured_outputs").
PROTO_VERSION = "1.6"


@dataclass(frozen=True)
class KvTargetSpec:
    """Where a prefill worker pushes a request's KV (a decode worker's admitted request)."""

    address: str
    dp_rank: int
    transfer_ticket: str
    skip_blocks: int  # leading full prompt blocks the decode side already holds (count)


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


@dataclass(frozen=True)
class DecodeCall:
    request: EngineRequest
    local_prefill: bool
    return_token_ids: bool


class FrameKind(enum.Enum):
    ADMITTED = "admitted"
    TOKENS = "tokens"
    FINAL = "final"


@dataclass(frozen=True)
class DecodeEvent:
    """One Decode stream frame. generated_tokens and finish_reason are set on FINAL only."""

    request_id: str
    kind: FrameKind
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


@dataclass(frozen=True)
class KvReceipt:
    bytes_received: int
    blocks_received: int


@dataclass(frozen=True)
class KvPushResult:
    bytes_sent: int
    num_chunks: int
    seconds: float


class KvPusher(Protocol):
    """Sends a finished prefill's KV to a decode worker (implemented over gRPC in kv_transfer)."""

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
