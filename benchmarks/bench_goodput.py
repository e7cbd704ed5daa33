"""Goodput under latency SLOs (DESIGN "Speed is measured"): disaggregated vs unified vs
conditional serving, through the OpenAI-compatible HTTP API, with plots.

For every serving configuration (started here with `pdserve up`, each on the same two cores: two
model processes or DP ranks with one torch thread each; the exact command is printed) and every
workload (seeded, text from a bundled corpus):

1. quiet runs: a few requests one at a time give the uncontended TTFT and TPOT; the SLOs are
   factors of the fastest configuration's p90 (printed with their derivation), so the figures
   mean the same on a faster or slower machine;
2. open-loop Poisson load at a rate, stepping the rate up until SLO attainment (share of
   requests meeting both the TTFT and the TPOT SLO) falls below 90 %, then bisecting: goodput is
   the highest rate with >= 90 % attainment (DistServe's definition).

    python -m benchmarks.bench_goodput [--quick] [--workloads chat,...] [--configs ...]
    python -m benchmarks.bench_goodput --base-url http://HOST:PORT/v1   (any OpenAI-compatible server)
    make bench-goodput [GOODPUT_ARGS=...]

Writes benchmarks/results/goodput-<machine class>.json (goodput-cpu-avx512.json, goodput-cuda-h200.json
with --device cuda on an H200; -quick with --quick) and the plots beside it (<stem>.png,
<stem>-latency.png, <stem>-itl.png).
"""

# This module is the command (its docstring is --help's text); the parts are in
# benchmarks/goodput/: cli (flags), harness (a run), report (table, checks, --merge), and the
# load generator, statistics, workloads, configurations and plots.

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.goodput import cli, workloads
from benchmarks.goodput.harness import Harness
from benchmarks.goodput.report import merge_files


class _FastTokenizer:
    """A `tokenizer.json` through the `tokenizers` library: the same token ids as transformers'
    fast tokenizer, without importing transformers (seconds saved per run)."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(path))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))


def load_tokenizer(name: str) -> workloads.Tokenizer:
    """The tokenizer of model folder or name `name` ('default': the bundled model)."""
    from shared.model_store import resolve_model

    path = Path(name) if Path(name).exists() else resolve_model(name)
    if (path / "tokenizer.json").exists():
        return _FastTokenizer(path / "tokenizer.json")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))  # type: ignore[return-value]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    return cli.parse_args(argv, __doc__ or "")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    a = parse_args(argv)
    out = Path(a.out) if a.out else cli.default_out(a)
    if a.merge:
        return merge_files(
            [Path(f) for f in a.merge], out, a.note, plots=not a.no_plots, replace=a.replace_with_later
        )
    tokenizer = load_tokenizer(a.tokenizer or a.model)
    h = Harness(a, tokenizer, out)
    print(f"machine: {h.doc['machine']}", flush=True)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="goodput-logs-") as logs:
        h.run(a.configs, Path(logs))
    h.doc["total_wall_s"] = round(time.monotonic() - t0, 1)
    h.report()
    if not a.no_plots:
        from benchmarks.goodput.plots import plot_all

        for path in plot_all(h.doc, out.parent, out.stem):
            print(f"wrote {path}")
    print(f"wrote {out} ({h.doc['total_wall_s']} s)")
    return h.doc


if __name__ == "__main__":
    main()
