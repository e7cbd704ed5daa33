"""The goodput benchmark's report: the goodput table and target checks of a result document
(stored in it as `checks`), and `--merge` (one document, report and plots from several runs'
files)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.goodput import configs

UNIFIED = ("unified_dp2", "unified_2workers")


def report(doc: dict[str, Any], target: float, note: str = "") -> None:
    """Prints the goodput table and the target checks of result document `doc`; stores the
    checks in it (`doc["checks"]`)."""
    gp: dict[str, dict[str, float]] = doc["goodput_rps"]
    order = {c: i for i, c in enumerate(configs.CONFIG_NAMES)}
    names = sorted({c for w in gp.values() for c in w}, key=lambda c: (order.get(c, len(order)), c))
    print("\nGoodput (req/s at >= {:.0f} % SLO attainment){}".format(100 * target, f"  {note}"))
    widths = [max(18, len(c) + 2) for c in names]  # a column never runs into its neighbour
    print(f"  {'workload':14s}" + "".join(f"{c:>{n}s}" for c, n in zip(names, widths, strict=True)))
    lower = doc["goodput_lower_bound_only"]
    for w, row in gp.items():
        cells = [
            (">=" if lower.get(w, {}).get(c) else "") + (f"{row[c]:.3g}" if c in row else "n/a")
            for c in names
        ]
        print(f"  {w:14s}" + "".join(f"{x:>{n}s}" for x, n in zip(cells, widths, strict=True)))
    if any(v for row in lower.values() for v in row.values()):
        print("  (>=: no rate tried missed the target; raise --max-points or --start-rps to find the limit)")
    checks = []
    for w, row in gp.items():
        unified = max((row[c] for c in UNIFIED if c in row), default=None)
        if "disaggregated" in row and unified is not None:
            ratio = row["disaggregated"] / unified if unified else math.inf
            checks.append(
                f"  {w}: disaggregated / best unified = {ratio:.2f}x"
                + (" (target >= 1.5x on chat)" if w == "chat" else "")
            )
        others = [row[c] for c in row if not c.startswith("conditional")]
        for c in (c for c in names if c.startswith("conditional") and c in row):
            if others:
                ok = row[c] >= max(others)
                checks.append(
                    f"  {w}: {c} {'>=' if ok else '<'} the best other configuration "
                    f"({row[c]:.3g} vs {max(others):.3g})"
                )
    if checks:
        print("Targets:\n" + "\n".join(checks))
    doc["checks"] = [c.strip() for c in checks]


def merge_files(
    files: Sequence[Path], out: Path, note: str = "", plots: bool = True, replace: Sequence[str] = ()
) -> dict[str, Any]:
    """`--merge`: one result document (report, plots) from several runs' files."""
    from benchmarks.goodput.merge import merge_docs

    doc = merge_docs([(f.name, json.loads(f.read_text())) for f in files], note, replace)
    report(doc, doc["settings"]["attainment_target"], note)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    if plots:
        from benchmarks.goodput.plots import plot_all

        for path in plot_all(doc, out.parent, out.stem):
            print(f"wrote {path}")
    print(f"wrote {out} (from {', '.join(str(f) for f in files)})")
    return doc
