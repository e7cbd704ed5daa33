"""The candidates of one load snapshot, as the router picks among them: each worker with its live
token counts per DP rank (reported in use + reserved since), grouped into pools per model and role
(decode workers with a compatible prefill worker, prefill workers per KV layout, unified workers,
and every decode worker for a model without prefill workers). Workers flagged stale are
candidates only when no fresh worker of the same model and role exists. A pool keeps its
candidates' total loads in a parallel list, a running max and a lazily pruned heap.

A LoRA adapter is a model of its own here: a worker joins its base model's pools and those of
each adapter it lists (of that base model: shared.cluster.lora_adapter_bases), under the same
role and pairing rules, so both halves of an adapter's request run on workers that have it, and
a worker that lists no adapter (or predates them) never gets one's request. Its reservations
count in every pool it is in."""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from shared.cluster import KvLayout, RankLoad, Role, WorkerInfo, lora_adapter_bases


class PoolWorker:
    """One worker of the snapshot with its live token counts (reported + reserved)."""

    __slots__ = ("info", "rank_tokens", "ranks", "slots", "stale")

    def __init__(
        self, info: WorkerInfo, ranks: tuple[RankLoad, ...], reserved: list[int], stale: bool
    ) -> None:
        self.info = info
        self.ranks = ranks
        self.stale = stale
        self.rank_tokens = [r.num_used_tokens + q for r, q in zip(ranks, reserved, strict=True)]
        self.slots: list[tuple[Pool, int]] = []  # (pool, index) entries that mirror its total


class Pool:
    """Candidates of one model and role, with their total tokens in a parallel list. Loads only
    grow between snapshots (reservations), so the largest is a running max and the least loaded
    comes from a heap with lazy deletion: O(log n) per decision instead of a scan."""

    __slots__ = ("_heap", "index_of", "key", "loads", "max_load", "workers")

    def __init__(self, key: str, workers: list[PoolWorker], mirror: bool) -> None:
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
class ModelPools:
    pairable_decode: Pool  # decode workers with at least one compatible prefill worker
    prefill_by_layout: dict[KvLayout, Pool]
    unified: Pool
    decode: Pool  # every decode worker (AGGREGATED when the model has no prefill worker)
    members: tuple[PoolWorker, ...]  # every worker serving the model, stale ones too
    parent: str = ""  # a LoRA adapter's base model id; "" for a base model

    @property
    def num_workers(self) -> int:
        return len(self.members)


def prefer_fresh(workers: list[PoolWorker]) -> list[PoolWorker]:
    fresh = [w for w in workers if not w.stale]
    return fresh or workers


def served_models(info: WorkerInfo, bases: Mapping[str, str]) -> list[str]:
    """The model ids a worker serves: its base model, then its adapters that `bases` (adapter ->
    base model, lora_adapter_bases) places on that base model."""
    return [info.model_id, *(a for a in dict.fromkeys(info.lora_adapters) if bases.get(a) == info.model_id)]


def build_pools(workers: Iterable[PoolWorker], mirror: bool) -> dict[str, ModelPools]:
    """Pools per model id (base models and LoRA adapters); `mirror`: each worker's reservations
    update the pools' loads (PoolWorker.slots)."""
    workers = list(workers)
    bases = lora_adapter_bases(w.info for w in workers)
    by_model: dict[str, dict[Role, list[PoolWorker]]] = {}
    for w in workers:
        for model in served_models(w.info, bases):
            roles = by_model.setdefault(model, {role: [] for role in Role})
            roles[w.info.role].append(w)
    pools: dict[str, ModelPools] = {}
    for model, roles in sorted(by_model.items()):
        prefill = prefer_fresh(roles[Role.PREFILL])
        decode = prefer_fresh(roles[Role.DECODE])
        by_layout: dict[KvLayout, list[PoolWorker]] = {}
        for w in prefill:
            by_layout.setdefault(w.info.kv_layout, []).append(w)
        pairable = [w for w in decode if w.info.kv_layout in by_layout]
        pools[model] = ModelPools(
            pairable_decode=Pool(f"{model}/decode", pairable, mirror),
            prefill_by_layout={
                layout: Pool(f"{model}/prefill", ws, mirror) for layout, ws in by_layout.items()
            },
            unified=Pool(f"{model}/unified", prefer_fresh(roles[Role.UNIFIED]), mirror),
            # Only used when the model has no prefill worker at all (then nothing is pairable).
            decode=Pool(f"{model}/decode", [] if by_layout else decode, mirror),
            members=tuple(w for ws in roles.values() for w in ws),
            parent=bases.get(model, ""),
        )
    return pools
