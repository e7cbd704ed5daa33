"""N-gram prompt lookup (no extra model): propose the tokens that followed the most recent earlier
occurrence of the sequence's last n tokens, longest n first.

Each request keeps an index (`_Index`: n-gram -> start of its most recent occurrence that has a
token after it), extended by the tokens appended since its last proposal, so a proposal costs a
few dictionary lookups instead of a scan of the whole sequence. Why: a scan per request per step
(numpy over ~400 tokens, each n from max to min) took ~0.1 ms on the 2-core CPU and ~0.5 ms on an
H200's host, about 4 ms per step of 8 requests there: as long as the step replayed as a CUDA
graph, which made speculation a loss on open-ended chat. A request's token list only grows
(proposals are never in it), which the index checks before trusting itself. Memory: ~400 bytes
per token of the request with the default 2..4-grams (measured with tracemalloc), under 1 % of
the KV cache SmolLM2 keeps for the same token (~46 KB in fp32). Time: `python -m
benchmarks.ngram_proposer` (6.9 against 82.3 us per proposal on the 2-core EPYC); a prompt's
first index costs ~0.8 us per token (27 ms for 32k tokens, once).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

# new windows per n above which the index is extended in bulk (zip) rather than one by one
_BULK_WINDOWS = 32


class _Index:
    """For each n in min_n..max_n: n-gram -> start of its most recent occurrence among the
    windows that end before the last indexed token (every indexed window has a continuation)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.sizes = range(min_n, max_n + 1)
        self.starts: dict[int, dict[tuple[int, ...], int]] = {}
        self.tokens: list[int] = []  # the sequence as indexed (a copy: the caller's list grows)
        self._reset()

    def _reset(self) -> None:
        self.starts = {n: {} for n in self.sizes}
        self.tokens = []

    def extend(self, token_ids: Sequence[int]) -> None:
        """Catch up with `token_ids` (which extends what was indexed; else start over)."""
        seen = len(self.tokens)
        if len(token_ids) < seen or (seen and token_ids[seen - 1] != self.tokens[-1]):
            self._reset()
            seen = 0
        toks = self.tokens
        toks.extend(token_ids[seen:])
        # windows ending at e <= len - 2 (a token follows them) not indexed yet: those ending at
        # seen - 1 .. len - 2 (the one ending at seen - 1 had no continuation at the last call);
        # later windows overwrite earlier ones (the most recent wins)
        for n in self.sizes:
            first = max(seen - 1, n - 1) + 1 - n  # start of the first new window
            last = len(toks) - 1 - n  # start of the last window with a continuation
            starts = self.starts[n]
            if last - first < _BULK_WINDOWS:  # a decode step's few tokens
                for i in range(first, last + 1):
                    starts[tuple(toks[i : i + n])] = i
            else:  # a prompt: the windows built by zip in C (27 instead of 41 ms for 32k tokens)
                windows = zip(*(toks[first + j : last + j + 1] for j in range(n)), strict=True)
                starts.update(zip(windows, range(first, last + 1), strict=True))

    def lookup(self, k: int) -> list[int]:
        toks = self.tokens
        total = len(toks)
        for n in reversed(self.sizes):
            if n > total - 1:
                continue
            start = self.starts[n].get(tuple(toks[total - n :]))
            if start is not None:
                return toks[start + n : start + n + k]
        return []


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= ngram min ({min_n}) <= ngram max ({max_n})")
        self.min_n = min_n
        self.max_n = max_n
        # one index per request, gone with the request
        self._indexes: weakref.WeakKeyDictionary[object, _Index] = weakref.WeakKeyDictionary()

    def propose(self, token_ids: Sequence[int], k: int, owner: object | None = None) -> list[int]:
        """Up to k tokens to follow `token_ids` (prompt + output so far); [] when no n-gram of
        length min_n..max_n of its suffix occurred before. `owner` (the request) keeps its index
        between calls; without one the sequence is indexed from scratch."""
        if k <= 0 or len(token_ids) < self.min_n + 1:
            return []
        index = self._indexes.get(owner) if owner is not None else None
        if index is None:
            index = _Index(self.min_n, self.max_n)
            if owner is not None:
                self._indexes[owner] = index
        index.extend(token_ids)
        return index.lookup(k)
