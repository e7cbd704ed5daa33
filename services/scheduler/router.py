"""The scheduler's decision: for one request, the serving mode, the workers and their DP ranks.

State (all behind one lock, so every decision is one atomic step):
- the last load snapshot, turned into candidate pools per model and role (rebuilt per snapshot);
- reservations: prompt tokens routed to each (worker, rank) since its last load report;
- the prefix index (which worker served which prefix blocks recently);
- round-robin turns and the random generator.

Modes: DISAGGREGATED when a decode worker has a compatible prefill worker (same model id and KV
layout: layers, heads, head dim, block size, dtype); LOCAL_PREFILL instead when the prompt's part
not already cached on the chosen decode worker is below `local_prefill_threshold` tokens;
AGGREGATED on a unified worker when no compatible pair exists, or on a decode worker when the
model has no prefill worker at all; DISAGGREGATED between two unified workers when the prompt's
uncached part reaches `unified_disaggregate_threshold` (conditional disaggregation over unified
workers, `policies.unified_split`). Unified workers are picked with the prefill policy (their
prefix cache matters most), decode workers with the decode policy.

Workers flagged stale by the load-monitor are routed to only when no fresh worker of the same
model and role exists.
"""

from __future__ import annotations

import heapq
import random
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from services.scheduler import policies
from services.scheduler.prefix_index import PrefixIndex
from services.scheduler.reservations import Reservations
from services.scheduler.types import (
    Decision,
    RequestFeatures,
    RouterState,
    Target,
    WorkerView,
)
from shared.cluster import KvLayout, LoadSnapshot, RankLoad, Role, ServingMode, WorkerInfo
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


class _Worker:
    """One worker of the snapshot with its live token counts (reported + reserved)."""

    __slots__ = ("info", "rank_tokens", "ranks", "slots", "stale")

    def __init__(
        self, info: WorkerInfo, ranks: tuple[RankLoad, ...], reserved: list[int], stale: bool
    ) -> None:
        self.info = info
        self.ranks = ranks
        self.stale = stale
        self.rank_tokens = [r.num_used_tokens + q for r, q in zip(ranks, reserved, strict=True)]
        self.slots: list[tuple[_Pool, int]] = []  # (pool, index) entries that mirror its total


class _Pool:
    """Candidates of one model and role, with their total tokens in a parallel list. Loads only
    grow between snapshots (reservations), so the largest is a running max and the least loaded
    comes from a heap with lazy deletion: O(log n) per decision instead of a scan."""

    __slots__ = ("_heap", "index_of", "key", "loads", "max_load", "workers")

    def __init__(self, key: str, workers: list[_Worker], mirror: bool) -> None:
        self.key = key  # names the round-robin turn
        self.workers = workers
        self.loads = [sum(w.rank_tokens) for w in workers]
        self.max_load = max(self.loads, default=0)
        self._heap = [(load, i) for i, load in enumerate(self.loads)]
        heapq.heapify(self._heap)
        self.index_of = {w.info.worker_id: i for i, w in enumerate(workers)}
        if mirror:
            for i, w in enumerate(workers):
                w.slots.append((self, i))

    def add(self, index: int, tokens: int) -> None:
        load = self.loads[index] + tokens
        self.loads[index] = load
        if load > self.max_load:
            self.max_load = load
        heapq.heappush(self._heap, (load, index))

    def least_loaded(self) -> int:
        """Index of the candidate with the fewest tokens (lowest index on ties)."""
        heap, loads = self._heap, self.loads
        while heap[0][0] != loads[heap[0][1]]:  # an entry from before a reservation
            heapq.heappop(heap)
        return heap[0][1]


@dataclass
class _ModelPools:
    pairable_decode: _Pool  # decode workers with at least one compatible prefill worker
    prefill_by_layout: dict[KvLayout, _Pool]
    unified: _Pool
    decode: _Pool  # every decode worker (AGGREGATED when the model has no prefill worker)
    num_workers: int


def _prefer_fresh(workers: list[_Worker]) -> list[_Worker]:
    fresh = [w for w in workers if not w.stale]
    return fresh or workers


def _build_pools(workers: Iterable[_Worker], mirror: bool) -> dict[str, _ModelPools]:
    by_model: dict[str, dict[Role, list[_Worker]]] = {}
    for w in workers:
        roles = by_model.setdefault(w.info.model_id, {role: [] for role in Role})
        roles[w.info.role].append(w)
    pools: dict[str, _ModelPools] = {}
    for model, roles in sorted(by_model.items()):
        prefill = _prefer_fresh(roles[Role.PREFILL])
        decode = _prefer_fresh(roles[Role.DECODE])
        by_layout: dict[KvLayout, list[_Worker]] = {}
        for w in prefill:
            by_layout.setdefault(w.info.kv_layout, []).append(w)
        pairable = [w for w in decode if w.info.kv_layout in by_layout]
        pools[model] = _ModelPools(
            pairable_decode=_Pool(f"{model}/decode", pairable, mirror),
            prefill_by_layout={
                layout: _Pool(f"{model}/prefill", ws, mirror) for layout, ws in by_layout.items()
            },
            unified=_Pool(f"{model}/unified", _prefer_fresh(roles[Role.UNIFIED]), mirror),
            # Only used when the model has no prefill worker at all (then nothing is pairable).
            decode=_Pool(f"{model}/decode", [] if by_layout else decode, mirror),
            num_workers=sum(len(ws) for ws in roles.values()),
        )
    return pools


def _layout_text(layout: KvLayout) -> str:
    return (
        f"{layout.dtype} block_size={layout.block_size} layers={layout.num_layers} "
        f"kv_heads={layout.num_kv_heads} head_dim={layout.head_dim}"
    )


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
        self._workers: dict[str, _Worker] = {}
        self._pools: dict[str, _ModelPools] = {}
        self._default_model = ""
        self._turns: dict[str, int] = {}
        self._rank_turns: dict[str, int] = {}
        self._stale = False
        self._has_snapshot = False
        self._pickers: dict[str, Callable[[_Pool, RequestFeatures], int]] = {
            "round_robin": self._pick_round_robin,
            "random": self._pick_random,
            "power_of_two": self._pick_power_of_two,
            "cache_aware": self._pick_cache_aware,
        }
        self._rank_pickers: dict[str, Callable[[_Worker, RequestFeatures], int]] = {
            "min_tokens": lambda w, f: policies.min_tokens(w.rank_tokens),
            "round_robin": self._rank_round_robin,
            "hash": lambda w, f: policies.rank_hash(f.request_id, w.info.dp_size),
        }
        p = self.policies
        self._pick_prefill = self._pickers[p.prefill]
        self._pick_decode = self._pickers[p.decode]
        self._pick_rank = self._rank_pickers[p.dp_rank]
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
            workers: dict[str, _Worker] = {}
            for wl in snapshot.workers:
                info = wl.info
                wid = info.worker_id
                previous = self._workers.get(wid)
                if previous is not None and previous.info != info:
                    self._forget(wid)  # registered again with another identity: start clean
                self._reservations.cover(
                    wid, now - wl.age_ms / 1000.0 - grace_s, [r.num_waiting for r in wl.ranks]
                )
                reserved = self._reservations.totals(wid, info.dp_size)
                workers[wid] = _Worker(info, wl.ranks, reserved, wl.stale)
            for wid in [w for w in self._workers if w not in workers]:
                self._forget(wid)
            self._reservations.retain(set(workers))
            self._workers = workers
            self._pools = _build_pools(workers.values(), mirror=True)
            self._default_model = max(self._pools, key=lambda m: (self._pools[m].num_workers, m), default="")
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
                pools = _build_pools(kept, mirror=False)
            model = f.model or self._default_model
            mp = pools.get(model)
            if mp is None:
                raise Unavailable(self._missing_model(f))
            decision = self._decide(f, model, mp)
        self._count(decision)
        SCHEDULE_SECONDS.observe(time.perf_counter() - start)
        return decision

    def _decide(self, f: RequestFeatures, model: str, mp: _ModelPools) -> Decision:
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
            raise Unavailable(self._missing_pair(f, model))
        rank = self._reserve_rank(worker, f)
        self._prefix.record(worker.info.worker_id, hashes)
        return self._decision(ServingMode.AGGREGATED, model, None, (worker, rank))

    def _uncached_tokens(self, f: RequestFeatures, w: _Worker) -> int:
        """Prompt tokens not already cached on `w` (by the prefix index: sampled, recent)."""
        hit = (
            self._prefix.matched_blocks(f.prefix_block_hashes, w.info.worker_id) * w.info.kv_layout.block_size
        )
        return f.prompt_tokens - min(hit, f.prompt_tokens)

    def _split_unified(self, f: RequestFeatures, model: str, pool: _Pool) -> Decision | None:
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

    def _reserve_rank(self, w: _Worker, f: RequestFeatures) -> int:
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
        prefill: tuple[_Worker, int] | None,
        decode: tuple[_Worker, int],
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

    # --- worker pickers (index into pool.workers) ---

    def _pick_round_robin(self, pool: _Pool, f: RequestFeatures) -> int:
        turn = self._turns.get(pool.key, 0)
        self._turns[pool.key] = turn + 1
        return policies.round_robin(len(pool.workers), turn)

    def _pick_random(self, pool: _Pool, f: RequestFeatures) -> int:
        return policies.random_pick(len(pool.workers), self._rng)

    def _pick_power_of_two(self, pool: _Pool, f: RequestFeatures) -> int:
        return policies.power_of_two(pool.loads, self._rng)

    def _pick_cache_aware(self, pool: _Pool, f: RequestFeatures) -> int:
        matched: list[int] = []
        share = 0.0
        if f.prefix_block_hashes:
            ids, depth = self._prefix.longest_match(f.prefix_block_hashes, pool.index_of)
            matched = policies.candidates_holding(ids, pool.index_of)
            share = depth / len(f.prefix_block_hashes)
        return policies.cache_aware(
            pool.loads, matched, self.policies.balance, pool.least_loaded(), pool.max_load, share
        )

    def _rank_round_robin(self, w: _Worker, f: RequestFeatures) -> int:
        wid = w.info.worker_id
        turn = self._rank_turns.get(wid, 0)
        self._rank_turns[wid] = turn + 1
        return policies.rank_round_robin(w.info.dp_size, turn)

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
        self._rank_turns.pop(worker_id, None)
        self._reservations.forget(worker_id)

    # --- error messages (name what is missing) ---

    def _stale_note(self) -> str:
        return " (the load-monitor is unreachable; routing on its last snapshot)" if self._stale else ""

    def _missing_model(self, f: RequestFeatures) -> str:
        if not self._workers:
            if not self._has_snapshot:
                return "no load snapshot received from the load-monitor yet" + self._stale_note()
            return "no workers are registered with the load-monitor" + self._stale_note()
        served = sorted(self._pools)
        if f.model and f.model not in served:
            return f"model {f.model!r} is not served by any worker; served models: {served}"
        return f"every worker of model {f.model or self._default_model!r} is excluded by the request"

    def _missing_pair(self, f: RequestFeatures, model: str) -> str:
        ws = [w for w in self._workers.values() if w.info.model_id == model]
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
        return msg + self._stale_note()


def _target(w: _Worker, rank: int) -> Target:
    return Target(w.info.worker_id, w.info.address, rank, w.info.capabilities)
