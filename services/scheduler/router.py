"""The scheduler's decision: for one request, the serving mode, the workers and their DP ranks.

State (all behind one lock, so every decision is one atomic step):
- the last load snapshot, turned into candidate pools per model and role (rebuilt per snapshot;
  `pools.py`);
- reservations: prompt tokens routed to each (worker, rank) since its last load report;
- the prefix index (which worker served which prefix blocks recently);
- round-robin turns and the random generator (`pickers.py`, around the pure `policies.py`).

Modes: DISAGGREGATED when a decode worker has a compatible prefill worker (same model id and KV
layout: layers, heads, head dim, block size, dtype); LOCAL_PREFILL instead when the prompt's part
not already cached on the chosen decode worker is below `local_prefill_threshold` tokens;
AGGREGATED on a unified worker when no compatible pair exists, or on a decode worker when the
model has no prefill worker at all; DISAGGREGATED between two unified workers when the prompt's
uncached part reaches `unified_disaggregate_threshold` (conditional disaggregation over unified
workers, `policies.unified_split`). Unified workers are picked with the prefill policy (their
prefix cache matters most), decode workers with the decode policy.

Workers flagged stale by the load-monitor are routed to only when no fresh worker of the same
model and role exists. A request naming a LoRA adapter (its `model`) is routed like one of a model
of its own, served by the workers that list the adapter (`pools.py`). A request nothing can
serve gets Unavailable naming what is missing (`unroutable.py`).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from services.scheduler import policies, unroutable
from services.scheduler.pickers import Pickers
from services.scheduler.pools import ModelPools, Pool, PoolWorker, build_pools
from services.scheduler.prefix_index import PrefixIndex
from services.scheduler.reservations import Reservations
from services.scheduler.types import (
    Decision,
    RequestFeatures,
    RouterState,
    Target,
    WorkerView,
)
from shared.cluster import LoadSnapshot, ServingMode
from shared.errors import InvalidArgument, Unavailable
from shared.metrics import PREFILL_MODE, SCHEDULE_DECISIONS, SCHEDULE_SECONDS


@dataclass(frozen=True)
class Policies:
    prefill: str = "cache_aware"
    decode: str = "power_of_two"
    dp_rank: str = "min_tokens"
    # Prompts whose uncached part is below this many tokens prefill on the decode worker; 0 = off.
    local_prefill_threshold: int = 0
    # With 2+ unified workers of a model: prompts whose uncached part is at least this many
    # tokens prefill on one unified worker and decode on another (policies.unified_split);
    # 0 = off (every request aggregated on one unified worker).
    unified_disaggregate_threshold: int = policies.UNIFIED_DISAGGREGATE_THRESHOLD
    # A load report polled at T covers the reservations made before T - grace: a request needs
    # a moment (gateway -> worker -> engine step) before its tokens show in the worker's report.
    reservation_grace_s: float = 0.05
    balance: policies.Balance = field(default_factory=policies.Balance)

    def __post_init__(self) -> None:
        for name, value, allowed in (
            ("prefill policy", self.prefill, policies.WORKER_POLICIES),
            ("decode policy", self.decode, policies.WORKER_POLICIES),
            ("dp rank policy", self.dp_rank, policies.RANK_POLICIES),
        ):
            if value not in allowed:
                raise ValueError(f"{name} {value!r} is not one of {list(allowed)}")
        if self.local_prefill_threshold < 0:
            raise ValueError("local_prefill_threshold must be >= 0")
        if self.unified_disaggregate_threshold < 0:
            raise ValueError("unified_disaggregate_threshold must be >= 0")
        if self.reservation_grace_s < 0:
            raise ValueError("reservation_grace_s must be >= 0")


class Router:
    """Routing decisions over the latest load snapshot. Thread-safe; `schedule` never blocks on
    I/O."""

    def __init__(
        self,
        policy: Policies | None = None,
        seed: int | None = None,
        prefix_entries_per_worker: int = 65536,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.policies = policy or Policies()
        self._clock = clock
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self._reservations = Reservations()
        self._prefix = PrefixIndex(prefix_entries_per_worker)
        self._workers: dict[str, PoolWorker] = {}
        self._pools: dict[str, ModelPools] = {}
        self._default_model = ""
        self._stale = False
        self._has_snapshot = False
        self._pickers = Pickers(self._rng, self._prefix, self.policies.balance)
        p = self.policies
        self._pick_prefill = self._pickers.worker(p.prefill)
        self._pick_decode = self._pickers.worker(p.decode)
        self._pick_rank = self._pickers.rank(p.dp_rank)
        # Resolved once: labels() costs a dict lookup under a lock per call.
        self._counted = {
            role: SCHEDULE_DECISIONS.labels(role=role, policy=name)
            for role, name in (
                ("prefill", p.prefill),
                ("decode", p.decode),
                ("unified", p.prefill),
                ("dp_rank", p.dp_rank),
            )
        }
        self._mode_counted = {
            ServingMode.DISAGGREGATED: PREFILL_MODE.labels(mode="disaggregated"),
            ServingMode.LOCAL_PREFILL: PREFILL_MODE.labels(mode="local"),
            ServingMode.AGGREGATED: PREFILL_MODE.labels(mode="aggregated"),
        }

    # --- snapshots ---

    def apply_snapshot(self, snapshot: LoadSnapshot) -> None:
        """Take a new load snapshot: each worker's report replaces the reservations it covers;
        workers absent from it are forgotten (reservations, prefix entries, turns)."""
        with self._lock:
            now = self._clock()
            grace_s = self.policies.reservation_grace_s
            workers: dict[str, PoolWorker] = {}
            for wl in snapshot.workers:
                info = wl.info
                wid = info.worker_id
                previous = self._workers.get(wid)
                # registered again with another identity: start clean; LoRA adapters loaded or
                # unloaded while it runs leave it the same worker (its reservations and cached
                # prefixes stand: an adapter's blocks never match another's or the base model's)
                if previous is not None and replace(previous.info, lora_adapters=info.lora_adapters) != info:
                    self._forget(wid)
                self._reservations.cover(
                    wid, now - wl.age_ms / 1000.0 - grace_s, [r.num_waiting for r in wl.ranks]
                )
                reserved = self._reservations.totals(wid, info.dp_size)
                workers[wid] = PoolWorker(info, wl.ranks, reserved, wl.stale)
            for wid in [w for w in self._workers if w not in workers]:
                self._forget(wid)
            self._reservations.retain(set(workers))
            self._workers = workers
            self._pools = build_pools(workers.values(), mirror=True)
            # a request naming no model gets the base model with the most workers (never an adapter)
            bases = [m for m, mp in self._pools.items() if not mp.parent]
            self._default_model = max(bases, key=lambda m: (self._pools[m].num_workers, m), default="")
            self._stale = False
            self._has_snapshot = True

    def mark_stale(self) -> None:
        """The load-monitor stream is down: keep routing on the last snapshot, flagged stale."""
        with self._lock:
            self._stale = True

    @property
    def stale(self) -> bool:
        return self._stale

    # --- decisions ---

    def schedule(self, f: RequestFeatures) -> Decision:
        """Choose mode, workers and ranks for one request and reserve its prompt tokens on the
        chosen ranks, atomically. Raises Unavailable when nothing can serve it."""
        if f.prompt_tokens < 0:
            raise InvalidArgument("prompt_tokens must be >= 0")
        start = time.perf_counter()
        with self._lock:
            pools = self._pools
            if f.exclude_worker_ids:
                kept = (w for w in self._workers.values() if w.info.worker_id not in f.exclude_worker_ids)
                pools = build_pools(kept, mirror=False)
            model = f.model or self._default_model
            mp = pools.get(model)
            if mp is None:
                raise Unavailable(
                    unroutable.missing_model(
                        f, self._workers, self._pools, self._default_model, self._has_snapshot, self._stale
                    )
                )
            decision = self._decide(f, model, mp)
        self._count(decision)
        SCHEDULE_SECONDS.observe(time.perf_counter() - start)
        return decision

    def _decide(self, f: RequestFeatures, model: str, mp: ModelPools) -> Decision:
        hashes = f.prefix_block_hashes
        if mp.pairable_decode.workers:
            decode = mp.pairable_decode.workers[self._pick_decode(mp.pairable_decode, f)]
            decode_rank = self._reserve_rank(decode, f)
            threshold = self.policies.local_prefill_threshold
            if threshold > 0 and self._uncached_tokens(f, decode) < threshold:
                self._prefix.record(decode.info.worker_id, hashes)
                return self._decision(ServingMode.LOCAL_PREFILL, model, None, (decode, decode_rank))
            pool = mp.prefill_by_layout[decode.info.kv_layout]
            prefill = pool.workers[self._pick_prefill(pool, f)]
            prefill_rank = self._reserve_rank(prefill, f)
            self._prefix.record(prefill.info.worker_id, hashes)
            if threshold > 0 or self.policies.decode == "cache_aware":
                self._prefix.record(decode.info.worker_id, hashes)
            return self._decision(
                ServingMode.DISAGGREGATED, model, (prefill, prefill_rank), (decode, decode_rank)
            )
        if mp.unified.workers:
            split = self._split_unified(f, model, mp.unified)
            if split is not None:
                return split
            worker = mp.unified.workers[self._pick_prefill(mp.unified, f)]
        elif mp.decode.workers and not mp.prefill_by_layout:
            worker = mp.decode.workers[self._pick_decode(mp.decode, f)]
        else:
            everyone = self._pools.get(model, mp).members  # with the workers the request excludes
            raise Unavailable(unroutable.missing_pair(f, model, everyone, self._stale))
        rank = self._reserve_rank(worker, f)
        self._prefix.record(worker.info.worker_id, hashes)
        return self._decision(ServingMode.AGGREGATED, model, None, (worker, rank))

    def _uncached_tokens(self, f: RequestFeatures, w: PoolWorker) -> int:
        """Prompt tokens not already cached on `w` (by the prefix index: sampled, recent)."""
        hit = (
            self._prefix.matched_blocks(f.prefix_block_hashes, w.info.worker_id) * w.info.kv_layout.block_size
        )
        return f.prompt_tokens - min(hit, f.prompt_tokens)

    def _split_unified(self, f: RequestFeatures, model: str, pool: Pool) -> Decision | None:
        """A long prompt's prefill on one unified worker, its decode on another (or None)."""
        threshold = self.policies.unified_disaggregate_threshold
        if threshold <= 0 or len(pool.workers) < 2:
            return None
        least = pool.least_loaded()
        prefill = pool.workers[least]
        hashes = f.prefix_block_hashes
        pair = policies.unified_split(pool.loads, least, self._uncached_tokens(f, prefill), threshold)
        if pair is None:
            return None
        decode = pool.workers[pair[1]]
        if decode.info.kv_layout != prefill.info.kv_layout:
            return None  # its KV could not be pushed there: serve it aggregated
        prefill_rank = self._reserve_rank(prefill, f)
        decode_rank = self._reserve_rank(decode, f)
        self._prefix.record(prefill.info.worker_id, hashes)
        self._prefix.record(decode.info.worker_id, hashes)
        return self._decision(
            ServingMode.DISAGGREGATED, model, (prefill, prefill_rank), (decode, decode_rank)
        )

    def _reserve_rank(self, w: PoolWorker, f: RequestFeatures) -> int:
        """Pick the rank and add the prompt tokens to its reservation (caller holds the lock)."""
        rank = self._pick_rank(w, f)
        tokens = f.prompt_tokens
        self._reservations.add(w.info.worker_id, w.info.dp_size, rank, tokens, self._clock())
        w.rank_tokens[rank] += tokens
        for pool, index in w.slots:
            pool.add(index, tokens)
        return rank

    def _decision(
        self,
        mode: ServingMode,
        model: str,
        prefill: tuple[PoolWorker, int] | None,
        decode: tuple[PoolWorker, int],
    ) -> Decision:
        chosen = [decode] if prefill is None else [prefill, decode]
        lens = [w.info.max_model_len for w, _ in chosen if w.info.max_model_len > 0]
        return Decision(
            mode=mode,
            prefill=None if prefill is None else _target(*prefill),
            decode=_target(*decode),
            model=model,
            max_model_len=min(lens, default=0),
        )

    def _count(self, d: Decision) -> None:
        if d.mode is ServingMode.DISAGGREGATED:
            self._counted["prefill"].inc()
            self._counted["decode"].inc()
            self._counted["dp_rank"].inc(2)
        else:
            self._counted["unified" if d.mode is ServingMode.AGGREGATED else "decode"].inc()
            self._counted["dp_rank"].inc()
        self._mode_counted[d.mode].inc()

    # --- state ---

    def state(self) -> RouterState:
        with self._lock:
            views = tuple(
                WorkerView(
                    info=w.info,
                    ranks=w.ranks,
                    reserved_tokens=tuple(self._reservations.totals(w.info.worker_id, w.info.dp_size)),
                    stale=w.stale,
                )
                for w in self._workers.values()
            )
            return RouterState(
                workers=views,
                stale=self._stale,
                prefill_policy=self.policies.prefill,
                decode_policy=self.policies.decode,
                dp_rank_policy=self.policies.dp_rank,
            )

    def _forget(self, worker_id: str) -> None:
        self._prefix.forget(worker_id)
        self._pickers.forget(worker_id)
        self._reservations.forget(worker_id)


def _target(w: PoolWorker, rank: int) -> Target:
    return Target(w.info.worker_id, w.info.address, rank, w.info.capabilities)
