"""The stateful side of the routing policies: round-robin turns (per pool and per worker's ranks),
the random generator and prefix matches, around the pure functions of `policies.py`. A picker
returns an index into its pool's workers (or a DP rank of a worker). Used under the router's lock."""

from __future__ import annotations

import random
from collections.abc import Callable

from services.scheduler import policies
from services.scheduler.pools import Pool, PoolWorker
from services.scheduler.prefix_index import PrefixIndex
from services.scheduler.types import RequestFeatures

WorkerPicker = Callable[[Pool, RequestFeatures], int]
RankPicker = Callable[[PoolWorker, RequestFeatures], int]


class Pickers:
    def __init__(self, rng: random.Random, prefix: PrefixIndex, balance: policies.Balance) -> None:
        self._rng = rng
        self._prefix = prefix
        self._balance = balance
        self._turns: dict[str, int] = {}  # pool key -> next round-robin turn
        self._rank_turns: dict[str, int] = {}  # worker id -> next round-robin rank turn
        self._workers: dict[str, WorkerPicker] = {
            "round_robin": self._pick_round_robin,
            "random": self._pick_random,
            "power_of_two": self._pick_power_of_two,
            "cache_aware": self._pick_cache_aware,
        }
        self._ranks: dict[str, RankPicker] = {
            "min_tokens": lambda w, f: policies.min_tokens(w.rank_tokens),
            "round_robin": self._rank_round_robin,
            "hash": lambda w, f: policies.rank_hash(f.request_id, w.info.dp_size),
        }

    def worker(self, policy: str) -> WorkerPicker:
        """The picker of a worker policy (policies.WORKER_POLICIES)."""
        return self._workers[policy]

    def rank(self, policy: str) -> RankPicker:
        """The picker of a DP rank policy (policies.RANK_POLICIES)."""
        return self._ranks[policy]

    def forget(self, worker_id: str) -> None:
        self._rank_turns.pop(worker_id, None)

    def _pick_round_robin(self, pool: Pool, f: RequestFeatures) -> int:
        turn = self._turns.get(pool.key, 0)
        self._turns[pool.key] = turn + 1
        return policies.round_robin(len(pool.workers), turn)

    def _pick_random(self, pool: Pool, f: RequestFeatures) -> int:
        return policies.random_pick(len(pool.workers), self._rng)

    def _pick_power_of_two(self, pool: Pool, f: RequestFeatures) -> int:
        return policies.power_of_two(pool.loads, self._rng)

    def _pick_cache_aware(self, pool: Pool, f: RequestFeatures) -> int:
        matched: list[int] = []
        share = 0.0
        if f.prefix_block_hashes:
            ids, depth = self._prefix.longest_match(f.prefix_block_hashes, pool.index_of)
            matched = policies.candidates_holding(ids, pool.index_of)
            share = depth / len(f.prefix_block_hashes)
        return policies.cache_aware(
            pool.loads, matched, self._balance, pool.least_loaded(), pool.max_load, share
        )

    def _rank_round_robin(self, w: PoolWorker, f: RequestFeatures) -> int:
        wid = w.info.worker_id
        turn = self._rank_turns.get(wid, 0)
        self._rank_turns[wid] = turn + 1
        return policies.rank_round_robin(w.info.dp_size, turn)
