"""Host time of one n-gram proposal: a scan of the whole sequence (the baseline, as the proposer
did before 2026-11-26) against spec/ngram.py's per-request index, on the same sequences.

Requests with chat-sized prompts decode one token per step and propose after each, as a rank
does at concurrency 8; proposals of both methods are checked to be equal. On a GPU a decode
step takes ~3.5 ms, so a proposal's host time times the requests of a step is what speculation
has to win back before it saves anything.

    python -m benchmarks.ngram_proposer [--requests 8] [--prompt 400] [--steps 96] [--out F]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from benchmarks.bench_spec import machine
from services.worker.engine.spec.ngram import NgramProposer


def scan_propose(token_ids: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The baseline: per n (longest first) compare every earlier window with the suffix."""
    total = len(token_ids)
    if k <= 0 or total < min_n + 1:
        return []
    arr = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        windows = sliding_window_view(arr[: total - 1], n)
        hits = np.flatnonzero((windows == arr[total - n :]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return [int(t) for t in arr[start : start + k]]
    return []


class _Owner:
    """Stands for a request (the index lives as long as it does)."""


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=400, help="prompt tokens per request")
    ap.add_argument("--steps", type=int, default=96, help="decode steps (one proposal each)")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--min-n", type=int, default=2)
    ap.add_argument("--max-n", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=2000, help="token ids drawn from 0..vocab-1")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    rng = random.Random(0)
    prompts = [[rng.randrange(args.vocab) for _ in range(args.prompt)] for _ in range(args.requests)]
    outputs = [[rng.randrange(args.vocab) for _ in range(args.steps)] for _ in range(args.requests)]

    def run(propose: object) -> tuple[float, list[list[int]]]:
        seqs = [list(p) for p in prompts]
        owners = [_Owner() for _ in seqs]
        got: list[list[int]] = []
        t0 = time.perf_counter()
        for step in range(args.steps):
            for i, seq in enumerate(seqs):
                seq.append(outputs[i][step])
                got.append(propose(seq, owners[i]))  # type: ignore[operator]
        return (time.perf_counter() - t0) / (args.steps * args.requests), got

    proposer = NgramProposer(args.min_n, args.max_n)
    scan_s, scan_got = run(lambda seq, _o: scan_propose(seq, args.k, args.min_n, args.max_n))
    index_s, index_got = run(lambda seq, owner: proposer.propose(seq, args.k, owner=owner))
    if index_got != scan_got:
        sys.exit("the index proposed something the scan did not")
    per_step_scan = scan_s * args.requests * 1e3
    per_step_index = index_s * args.requests * 1e3
    print(f"machine: {machine()}")
    print(
        f"per proposal: scan {scan_s * 1e6:.1f} us, index {index_s * 1e6:.1f} us "
        f"({scan_s / index_s:.1f}x); per step of {args.requests} requests: "
        f"{per_step_scan:.2f} vs {per_step_index:.2f} ms (the index's first build included)"
    )
    if args.out:
        doc = {
            "command": "python -m benchmarks.ngram_proposer " + " ".join(argv or sys.argv[1:]),
            "machine": machine(),
            "settings": vars(args) | {"out": str(args.out)},
            "scan_us_per_proposal": round(scan_s * 1e6, 2),
            "index_us_per_proposal": round(index_s * 1e6, 2),
            "ratio": round(scan_s / index_s, 2),
            "proposals_equal": True,
        }
        args.out.write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
