"""What the request life needs from the scheduler and the workers, in domain terms (no grpc).

`clients.py` implements these over gRPC; tests may substitute fakes. Errors surface as
shared.errors classes; `Retryable` ones name the worker so a retry can exclude it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from services.gateway.inputs import Sampling, TokenLogprob
from shared.cluster import DecodeFrameKind, FinishReason, KvTransport, Role, ServingMode
from shared.errors import ResourceExhausted, Unavailable


class Retryable:
    """Marks a failure that another worker may not have: before any output reached the client,
    the request is rescheduled once, excluding `worker_id` ("" = the scheduler itself)."""

    worker_id: str = ""


class WorkerUnavailable(Unavailable, Retryable):
    """A worker (or the scheduler, worker_id "") could not be reached or is shutting down."""

    def __init__(self, message: str, worker_id: str = "") -> None:
        super().__init__(message)
        self.worker_id = worker_id


class WorkerGone(WorkerUnavailable):
    """A decode worker left the cluster's membership (lease expired, deregistered) and did not
    answer a health check: its stream was abandoned (the request migrates like on UNAVAILABLE)."""


class WorkerOutOfCapacity(ResourceExhausted, Retryable):
    """A worker refused the request for capacity (KV pool or queue full)."""

    def __init__(self, message: str, worker_id: str) -> None:
        super().__init__(message)
        self.worker_id = worker_id


class WorkerLacksFeature(WorkerOutOfCapacity):
    """The chosen worker predates a feature the request uses (a cluster mid-upgrade): the request
    is retried on other workers, and refused as RESOURCE_EXHAUSTED (retry later) when none has it,
    rather than served with the feature silently ignored."""


@dataclass(frozen=True)
class WorkerTarget:
    worker_id: str
    address: str
    dp_rank: int
    capabilities: tuple[str, ...] = ()


@dataclass(frozen=True)
class ScheduleQuery:
    request_id: str
    model: str
    prompt_tokens: int
    prefix_block_hashes: tuple[int, ...]
    max_tokens: int
    exclude_worker_ids: tuple[str, ...] = ()


@dataclass(frozen=True)
class Placement:
    mode: ServingMode
    decode: WorkerTarget
    prefill: WorkerTarget | None
    model: str
    max_model_len: int  # 0 = unknown


@dataclass(frozen=True)
class ModelCard:
    id: str
    max_model_len: int  # tokens; 0 = unknown
    parent: str = ""  # a LoRA adapter's base model id; "" for a base model


@dataclass(frozen=True)
class WorkerJob:
    """What both worker calls carry."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: Sampling
    return_token_ids: bool
    priority: int = 0  # lower is served first (GenerateRequest.priority); 0 is not sent


@dataclass(frozen=True)
class KvDestination:
    address: str
    dp_rank: int
    transfer_ticket: str
    skip_blocks: int
    transport: KvTransport = KvTransport.GRPC_PUSH  # negotiated from both workers' capabilities
    # the decode worker's DecodeFrame.trim_blocks, passed on (None: it sent none, 1.7 or older)
    trim_blocks: int | None = None
    # NIXL descriptors in one message per prefill chunk (both workers advertise kv_nixl_parts)
    nixl_parts: bool = False
    # the prefill worker answers at the first token; the handoff ends after (1.11)
    reply_before_handoff: bool = False


@dataclass(frozen=True)
class DecodeEvent:
    """One DecodeFrame. generated_tokens is None when the field is absent (HasField false)."""

    kind: DecodeFrameKind
    text: str = ""
    token_ids: tuple[int, ...] = ()
    generated_tokens: int | None = None
    finish_reason: FinishReason | None = None
    transfer_ticket: str = ""
    cached_blocks: int = 0
    # ADMITTED: leading prompt blocks the decode worker reads only in full-attention layers
    # (None: unset, every block is read)
    trim_blocks: int | None = None
    local_cached_tokens: int = 0
    transferred_cached_tokens: int = 0
    logprobs: tuple[TokenLogprob, ...] = ()
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # prompt tokens from the second on (local prefill)


@dataclass(frozen=True)
class PrefillResult:
    """The PrefillResponse. generated_tokens is None when the field is absent."""

    text: str = ""
    token_ids: tuple[int, ...] = ()
    generated_tokens: int | None = None
    finish_reason: FinishReason | None = None
    local_cached_tokens: int = 0
    logprobs: tuple[TokenLogprob, ...] = ()
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # prompt tokens from the second on


class DecodeStream(Protocol):
    async def next(self) -> DecodeEvent | None:
        """The next frame, or None when the worker ended the stream."""
        ...

    def cancel(self) -> None: ...

    def abandon(self, reason: str, worker_id: str | None = None) -> None:
        """End the call at once because a worker it depends on is gone (`worker_id`; None: the
        stream's own worker): the pending and every later next() raise WorkerGone(reason, that
        id) (never a cancellation of the caller)."""
        ...


class WorkerClient(Protocol):
    def decode(
        self,
        target: WorkerTarget,
        job: WorkerJob,
        local_prefill: bool,
        timeout_s: float | None,
        transfer_ticket: str | None = None,
    ) -> DecodeStream:
        """`transfer_ticket`: the ticket the decode worker admits the request under (a worker
        with the kv_gateway_ticket capability); None: it issues one in ADMITTED."""
        ...

    async def prefill(
        self, target: WorkerTarget, job: WorkerJob, kv: KvDestination | None, timeout_s: float | None
    ) -> PrefillResult: ...

    async def abort(self, address: str, request_id: str) -> bool: ...


class MembershipSource(Protocol):
    """What the gateway needs to notice a decode worker that left the cluster (membership.py)."""

    async def members(self, timeout_s: float) -> frozenset[str] | None:
        """Ids of the workers the scheduler routes to now; None when it cannot tell (unreachable,
        or its view of the load-monitor is stale)."""
        ...

    async def responds(self, address: str, timeout_s: float) -> bool:
        """True when the worker at `address` answers a health check within `timeout_s`, whatever
        its status (a draining worker answers NOT_SERVING: alive)."""
        ...


class SchedulerClient(Protocol):
    async def schedule(self, query: ScheduleQuery, timeout_s: float | None) -> Placement: ...

    async def list_models(self) -> Sequence[ModelCard]: ...


@dataclass(frozen=True)
class ClusterWorker:
    """A worker as the scheduler routes to it (Scheduler/GetState): what an adapter change needs."""

    worker_id: str
    address: str
    role: Role
    model_id: str
    capabilities: tuple[str, ...]
    lora_adapters: tuple[str, ...]  # names, in the worker's order

    def __str__(self) -> str:
        return f"{self.role.value} worker {self.worker_id} ({self.address})"


@dataclass(frozen=True)
class ClusterState:
    workers: tuple[ClusterWorker, ...]
    stale: bool  # the scheduler lost the load-monitor: the list may be out of date


class ClusterView(Protocol):
    async def cluster_state(self, timeout_s: float | None) -> ClusterState:
        """The workers the scheduler routes to now. Raises as the scheduler client does."""
        ...


class LoraWorkerClient(Protocol):
    """A worker's LoRA adapter calls (worker.proto LoadLoraAdapter / UnloadLoraAdapter, 1.14).
    Errors are the worker's own (shared.errors classes, messages naming the worker)."""

    async def load_lora_adapter(
        self, worker: ClusterWorker, name: str, path: str, timeout_s: float
    ) -> None: ...

    async def unload_lora_adapter(self, worker: ClusterWorker, name: str, timeout_s: float) -> str:
        """Returns the folder the worker had loaded the adapter from ("" when it does not say)."""
        ...
