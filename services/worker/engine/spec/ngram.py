"""N-gram prompt lookup (no extra model): propose the tokens that followed the most recent earlier
occurrence of the sequence's last n tokens, longest n first."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= ngram min ({min_n}) <= ngram max ({max_n})")
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to k tokens to follow `token_ids` (prompt + output so far); [] when no n-gram of
        length min_n..max_n of its suffix occurred before."""
        total = len(token_ids)
        if k <= 0 or total < self.min_n + 1:
            return []
        arr = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            # windows starting at 0 .. total-n-1: each has a continuation token after it
            windows = sliding_window_view(arr[: total - 1], n)
            hits = np.flatnonzero((windows == arr[total - n :]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n  # the most recent occurrence
                return [int(t) for t in arr[start : start + k]]
        return []
