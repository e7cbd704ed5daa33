"""Why a request cannot be routed, in a sentence that names what is missing: no snapshot yet, no
workers, a model nobody serves, every worker excluded, or no prefill/decode pair with matching KV
layouts (and whether the router runs on a stale snapshot). Raised by the router as Unavailable."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from services.scheduler.pools import ModelPools, PoolWorker
from services.scheduler.types import RequestFeatures
from shared.cluster import KvLayout, Role


def _layout_text(layout: KvLayout) -> str:
    return (
        f"{layout.dtype} block_size={layout.block_size} layers={layout.num_layers} "
        f"kv_heads={layout.num_kv_heads} head_dim={layout.head_dim}"
        + (f" weights={layout.weights}" if layout.weights else "")
    )


def stale_note(stale: bool) -> str:
    return " (the load-monitor is unreachable; routing on its last snapshot)" if stale else ""


def missing_model(
    f: RequestFeatures,
    workers: Mapping[str, PoolWorker],
    served: Mapping[str, ModelPools],
    default_model: str,
    has_snapshot: bool,
    stale: bool,
) -> str:
    if not workers:
        if not has_snapshot:
            return "no load snapshot received from the load-monitor yet" + stale_note(stale)
        return "no workers are registered with the load-monitor" + stale_note(stale)
    if f.model and f.model not in served:
        bases = sorted(m for m, mp in served.items() if not mp.parent)
        adapters = sorted(m for m, mp in served.items() if mp.parent)
        msg = f"model {f.model!r} is not served by any worker; served models: {bases}"
        return msg + (f", LoRA adapters: {adapters}" if adapters else "")
    return f"every worker of model {f.model or default_model!r} is excluded by the request"


def missing_pair(f: RequestFeatures, model: str, members: Iterable[PoolWorker], stale: bool) -> str:
    """`members`: every worker serving `model` (an adapter's: those listing it)."""
    ws = list(members)
    prefill = [w for w in ws if w.info.role is Role.PREFILL]
    decode = [w for w in ws if w.info.role is Role.DECODE]
    excluded = [w for w in ws if w.info.worker_id in f.exclude_worker_ids]
    if not decode and not [w for w in ws if w.info.role is Role.UNIFIED]:
        msg = f"model {model!r} has {len(prefill)} prefill worker(s) but no decode or unified worker"
    else:
        p_layouts = sorted({_layout_text(w.info.kv_layout) for w in prefill})
        d_layouts = sorted({_layout_text(w.info.kv_layout) for w in decode})
        msg = (
            f"no compatible prefill/decode pair for model {model!r}: prefill KV layouts "
            f"{p_layouts}, decode KV layouts {d_layouts} (they must match)"
        )
    if excluded:
        msg += f"; {len(excluded)} worker(s) excluded by the request"
    return msg + stale_note(stale)
