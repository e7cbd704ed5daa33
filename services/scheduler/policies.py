"""Routing policies as pure functions: they read candidate loads (tokens: reported in use plus
reserved since the last report) and request features, and return an index. No state is kept
here: round-robin turns, random generators and prefix matches are passed in by the router.

Ties always break to the lowest index, so equal inputs give equal picks.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

WORKER_POLICIES = ("round_robin", "random", "power_of_two", "cache_aware")
RANK_POLICIES = ("min_tokens", "round_robin", "hash")

# Tokens of uncached prompt from which two or more unified workers split a request (prefill on
# one, decode on another; `unified_split`). Chosen from `make bench-goodput` on 2-core CPUs
# (README, "Goodput"): at 128 the split configuration was at or above the best other on chat,
# long_prompt, long_output and shared_prefix; at 256 chat's 100-255-token prompts ran aggregated
# beside the prefills and failed their TPOT SLO (0.55 req/s against 0.77).
UNIFIED_DISAGGREGATE_THRESHOLD = 128


@dataclass(frozen=True)
class Balance:
    """When loads count as unbalanced for `cache_aware`: the spread exceeds `abs_tokens` AND the
    largest load exceeds `rel` times the smallest. And when a prefix match counts at all: it
    covers at least `min_match_share` of the prompt's full blocks. A chat template's default
    system prompt is one block shared by every request; without the share rule that one block
    sent every request to the first worker that held it until the loads differed by
    `abs_tokens` (measured: two unified workers, the second idle under a burst)."""

    abs_tokens: int = 8192
    rel: float = 1.5
    min_match_share: float = 0.5


# --- worker policies (index into the candidate list) ---


def round_robin(num_candidates: int, turn: int) -> int:
    """The `turn`-th candidate, cycling."""
    return turn % num_candidates


def random_pick(num_candidates: int, rng: random.Random) -> int:
    """A uniformly random candidate."""
    return rng.randrange(num_candidates)


def least_loaded(loads: Sequence[int]) -> int:
    """The candidate with the fewest tokens (lowest index on ties)."""
    return loads.index(min(loads))


def power_of_two(loads: Sequence[int], rng: random.Random) -> int:
    """The less loaded of two distinct random candidates (the lower index on a tie)."""
    n = len(loads)
    if n == 1:
        return 0
    i = rng.randrange(n)
    j = rng.randrange(n - 1)
    if j >= i:
        j += 1
    if loads[j] < loads[i] or (loads[j] == loads[i] and j < i):
        return j
    return i


def is_unbalanced(min_load: int, max_load: int, balance: Balance) -> bool:
    return max_load - min_load > balance.abs_tokens and max_load > min_load * balance.rel


def cache_aware(
    loads: Sequence[int],
    matched: Sequence[int],
    balance: Balance,
    least: int | None = None,
    max_load: int | None = None,
    match_share: float = 1.0,
) -> int:
    """Prefer the candidates (indices in `matched`) that hold the longest prefix of the prompt
    (`match_share` of its full blocks), least loaded among them; the least loaded candidate
    overall when nothing matches, when the match is shorter than `balance.min_match_share`, or
    when loads are unbalanced beyond `balance` (so a hot prefix cannot pile everything on one
    worker).

    `least` (index of the least loaded candidate) and `max_load` may be passed when the caller
    tracks them (the router does, to stay O(log n) per decision); they are computed otherwise.
    """
    if least is None:
        least = least_loaded(loads)
    if max_load is None:
        max_load = max(loads)
    if not matched or match_share < balance.min_match_share or is_unbalanced(loads[least], max_load, balance):
        return least
    return min(matched, key=lambda i: (loads[i], i))


def unified_split(
    loads: Sequence[int], least: int, uncached_tokens: int, threshold: int
) -> tuple[int, int] | None:
    """Conditional disaggregation over unified workers: (prefill index, decode index) when a
    prompt's uncached part (`uncached_tokens`, on the would-be prefill worker) reaches
    `threshold` and there are two candidates or more; None = serve it aggregated.

    The least loaded candidate (`least`) prefills; the least loaded of the others decodes. Loads
    are mostly running sequences' KV (a prefill's KV leaves with its push), so under long prompts
    the workers settle into roles: the one with the fewest decodes takes the prefills, and long
    prefills stall few running decodes; short prompts run aggregated and every worker decodes.
    """
    if threshold <= 0 or len(loads) < 2 or uncached_tokens < threshold:
        return None
    decode = min((i for i in range(len(loads)) if i != least), key=lambda i: (loads[i], i))
    return least, decode


# --- DP rank policies (rank index inside one worker) ---


def min_tokens(rank_tokens: Sequence[int]) -> int:
    """The rank with the fewest tokens (reported in use + reserved); lowest rank on ties.

    The caller must add the request's prompt tokens to the chosen rank's reservation in the same
    critical section as this call (see Router), or a burst would all see the same minimum.
    """
    return rank_tokens.index(min(rank_tokens))


def rank_round_robin(dp_size: int, turn: int) -> int:
    """The `turn`-th rank of the worker, cycling."""
    return turn % dp_size


def rank_hash(request_id: str, dp_size: int) -> int:
    """A stable hash of the request id (CRC-32) modulo the number of ranks."""
    return zlib.crc32(request_id.encode()) % dp_size


def candidates_holding(matched_ids: Sequence[str], index_of: Mapping[str, int]) -> list[int]:
    """Indices of the candidates among `matched_ids` (workers found by the prefix index)."""
    return [index_of[w] for w in matched_ids if w in index_of]
