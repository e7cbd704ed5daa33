"""The cluster's shared vocabulary, defined once: worker role, KV layout, per-rank load, worker
info, load snapshots, finish reason, serving mode and the kinds of a Decode stream's frames (no
grpc here).

Every service speaks of these the same way; `shared.cluster_convert` is the only place they meet
the generated protobuf stubs.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol


class Role(enum.Enum):
    """What a worker does; its RPCs are served only by the roles that can."""

    PREFILL = "prefill"
    DECODE = "decode"
    UNIFIED = "unified"  # prefills and decodes

    @property
    def prefills(self) -> bool:
        """Serves Prefill."""
        return self is not Role.DECODE

    @property
    def decodes(self) -> bool:
        """Serves Decode and PushKv."""
        return self is not Role.PREFILL


class FinishReason(enum.Enum):
    """Why a request ended (the worker's rule: count >= max_tokens -> LENGTH, else the stop)."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


class DecodeFrameKind(enum.Enum):
    """A frame of a worker's Decode stream (worker.proto DecodeFrameKind): what the decode worker
    sends and the gateway reads. Not the gateway's frames to its clients (OutputFrameKind)."""

    ADMITTED = "admitted"  # admission: the transfer ticket and the blocks already cached
    TOKENS = "tokens"  # generated text (and token ids when asked)
    FINAL = "final"  # the last one: finish reason and the worker's generated_tokens


class ServingMode(enum.Enum):
    """How the scheduler placed a request."""

    DISAGGREGATED = "disaggregated"  # prefill worker, KV pushed to the decode worker
    AGGREGATED = "aggregated"  # one worker prefills and decodes (unified, or decode without prefill)
    LOCAL_PREFILL = "local_prefill"  # the decode worker prefills itself (short/mostly cached prompt)


class KvTransport(enum.Enum):
    """How a request's KV moves from its prefill worker to its decode worker."""

    GRPC_PUSH = "grpc"  # the KV bytes in the PushKv stream (every version; the fallback)
    NIXL = "nixl"  # the decode worker READs the prefill worker's pool over NIXL (UCX)


# The capability a worker advertises when its NIXL agent is up and its KV pools are registered.
NIXL_CAPABILITY = "kv_transport_nixl"
# A worker that takes (decode side) and sends (prefill side) a NIXL handoff in several PushKv
# messages, one per prefill chunk (worker.proto KvTarget.nixl_parts, 1.10).
NIXL_PARTS_CAPABILITY = "kv_nixl_parts"
# A decode worker that admits a request under the transfer ticket the gateway chose
# (worker.proto DecodeRequest.transfer_ticket, 1.11): the prefill then starts with the admission.
GATEWAY_TICKET_CAPABILITY = "kv_gateway_ticket"
# A worker that loads and unloads LoRA adapters while it runs (worker.proto LoadLoraAdapter /
# UnloadLoraAdapter, 1.14): its LoRA machinery is on (--enable-lora, or --lora-modules).
LORA_RUNTIME_CAPABILITY = "lora_runtime"


def negotiate_kv_transport(
    prefill_capabilities: Iterable[str], decode_capabilities: Iterable[str]
) -> KvTransport:
    """NIXL when both workers of the pair advertise it, else the gRPC push (an older worker, or
    one where NIXL did not load, advertises nothing)."""
    if NIXL_CAPABILITY in prefill_capabilities and NIXL_CAPABILITY in decode_capabilities:
        return KvTransport.NIXL
    return KvTransport.GRPC_PUSH


def negotiate_nixl_parts(prefill_capabilities: Iterable[str], decode_capabilities: Iterable[str]) -> bool:
    """Whether a NIXL handoff goes in parts (one PushKv message per prefill chunk): both workers
    advertise it (an older one gets the whole handoff in one message at the end)."""
    return (
        negotiate_kv_transport(prefill_capabilities, decode_capabilities) is KvTransport.NIXL
        and NIXL_PARTS_CAPABILITY in prefill_capabilities
        and NIXL_PARTS_CAPABILITY in decode_capabilities
    )


@dataclass(frozen=True)
class KvLayout:
    """The shape of a worker's KV blocks: KV moves only between workers of equal layouts."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int  # tokens per KV block
    dtype: str  # "float32" | "bfloat16" | "float16"
    # what computed the KV besides the model: "" (its own weights) or "fp8" (FP8 linear weights);
    # KV of other weights is other KV (1.19)
    weights: str = ""


@dataclass(frozen=True)
class WorkerInfo:
    """A worker as it registers and as every service sees it."""

    worker_id: str
    address: str  # host:port of the worker's gRPC server
    role: Role
    model_id: str
    dp_size: int  # data-parallel ranks (count)
    kv_layout: KvLayout
    capabilities: tuple[str, ...] = ()
    proto_version: str = ""
    max_model_len: int = 0  # tokens; 0 = unknown
    device: str = ""  # "cpu" | "cuda"; "" = unknown
    # LoRA adapters served besides model_id (names; each a model id requests may use), in the
    # worker's --lora-modules order; () for a worker without any, or older than 1.13
    lora_adapters: tuple[str, ...] = ()


class ServesModels(Protocol):
    """What `lora_adapter_bases` reads of a worker: WorkerInfo, or its protobuf message."""

    @property
    def model_id(self) -> str: ...

    @property
    def lora_adapters(self) -> Iterable[str]: ...


def lora_adapter_bases(workers: Iterable[ServesModels]) -> dict[str, str]:
    """Each LoRA adapter name the workers list -> the base model it is served on, the one rule the
    scheduler routes by and the gateway lists cards by. A name that is also a base model id is
    that model, not an adapter (left out). A name listed on several base models (a
    misconfiguration: the same name for different adapters) belongs to the base model with the
    most workers listing it (ties: the smallest id); workers of the others never serve it, so an
    adapter request never runs on the wrong base model, nor pairs a prefill of one with a decode
    of the other."""
    workers = list(workers)
    models = {w.model_id for w in workers}
    counts: dict[str, dict[str, int]] = {}  # adapter -> base model -> workers listing it
    for w in workers:
        for name in dict.fromkeys(w.lora_adapters):
            if name not in models:
                per_base = counts.setdefault(name, {})
                per_base[w.model_id] = per_base.get(w.model_id, 0) + 1
    return {
        name: min(per_base, key=lambda base: (-per_base[base], base))
        for name, per_base in sorted(counts.items())
    }


@dataclass(frozen=True)
class RankLoad:
    """The load of one data-parallel rank of a worker."""

    dp_rank: int
    num_used_tokens: int = 0  # KV tokens in use
    num_running: int = 0  # requests
    num_waiting: int = 0  # requests
    kv_capacity_tokens: int = 0
    prefix_cache_queries_tokens: int = 0  # since start
    prefix_cache_hits_tokens: int = 0  # since start
    spec_draft_tokens: int = 0  # speculative proposals verified since start (tokens)
    spec_accepted_tokens: int = 0  # of which accepted (tokens)

    @property
    def spec_acceptance_rate(self) -> float:
        """Accepted / proposed speculative tokens (0 when nothing was proposed)."""
        if self.spec_draft_tokens == 0:
            return 0.0
        return self.spec_accepted_tokens / self.spec_draft_tokens

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Hits / queries over the summed counters (0 when nothing was looked up)."""
        if self.prefix_cache_queries_tokens == 0:
            return 0.0
        return self.prefix_cache_hits_tokens / self.prefix_cache_queries_tokens


def sum_rank_loads(reports: Iterable[RankLoad], dp_size: int) -> tuple[RankLoad, ...]:
    """One entry per rank 0..dp_size-1; several reports for the same rank are summed, never
    overwritten; reports for ranks outside [0, dp_size) are dropped (the worker said it has
    dp_size ranks)."""
    acc = [[0] * 8 for _ in range(dp_size)]
    for r in reports:
        if not 0 <= r.dp_rank < dp_size:
            continue
        a = acc[r.dp_rank]
        a[0] += r.num_used_tokens
        a[1] += r.num_running
        a[2] += r.num_waiting
        a[3] += r.kv_capacity_tokens
        a[4] += r.prefix_cache_queries_tokens
        a[5] += r.prefix_cache_hits_tokens
        a[6] += r.spec_draft_tokens
        a[7] += r.spec_accepted_tokens
    return tuple(RankLoad(rank, *a) for rank, a in enumerate(acc))


@dataclass(frozen=True)
class WorkerLoad:
    """One worker in a load snapshot."""

    info: WorkerInfo
    ranks: tuple[RankLoad, ...]  # one per rank, index = dp_rank
    age_ms: int  # since the last successful poll (or since registration if never polled)
    stale: bool  # age_ms exceeds the staleness limit


@dataclass(frozen=True)
class LoadSnapshot:
    """Every registered worker and its load, as the load-monitor publishes it to the scheduler."""

    workers: tuple[WorkerLoad, ...]
    version: int  # increases with every new snapshot
    timestamp_ms: int  # Unix time (milliseconds)
