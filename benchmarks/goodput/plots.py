"""Figures of the goodput benchmark (matplotlib, PNG) from its result document:
- `<stem>.png`: SLO attainment vs request rate per configuration, one panel per workload, with
  the target line and each configuration's goodput (the main plot);
- `<stem>-latency.png`: TTFT p90 and ITL p90 vs rate (SLO lines where they apply);
- `<stem>-itl.png`: the distribution (CDF) of inter-token latencies at one rate per workload.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _panels(plt: Any, n: int, rows: int = 1) -> tuple[Any, Any]:
    fig, axes = plt.subplots(rows, n, figsize=(max(4.2 * n, 6.0), 3.4 * rows + 0.4), squeeze=False)
    return fig, axes


def plot_all(doc: Mapping[str, Any], out_dir: Path, stem: str) -> list[Path]:
    """Writes the three figures; returns their paths."""
    plt = _pyplot()
    runs: Mapping[str, Mapping[str, list[dict[str, Any]]]] = doc["runs"]
    workloads = [w for w in runs if runs[w]]
    if not workloads:
        return []
    target = doc["settings"]["attainment_target"]
    note = "\n" + doc["note"] if doc.get("note") else ""
    written = []

    fig, axes = _panels(plt, len(workloads))
    for ax, w in zip(axes[0], workloads, strict=True):
        for config, points in runs[w].items():
            pts = sorted(points, key=lambda p: p["rate_rps"])
            line = ax.plot(
                [p["rate_rps"] for p in pts], [100 * p["attainment"] for p in pts], "o-", label=config
            )
            gp = doc["goodput_rps"].get(w, {}).get(config)
            if gp:
                ax.axvline(gp, color=line[0].get_color(), linestyle=":", linewidth=1)
        ax.axhline(100 * target, color="grey", linestyle="--", linewidth=1)
        ax.set_title(w)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("SLO attainment (%)")
        ax.set_ylim(-3, 103)
        ax.legend(fontsize=7)
    fig.suptitle(f"SLO attainment vs rate (dotted: goodput at {100 * target:.0f} %) {note}", fontsize=9)
    fig.tight_layout()
    written.append(_save(fig, plt, out_dir / f"{stem}.png"))

    fig, axes = _panels(plt, len(workloads), rows=2)
    for col, w in enumerate(workloads):
        slo = doc["slo"].get(w, {})
        for row, (key, label) in enumerate(
            (("ttft_p90_ms", "TTFT p90 (ms)"), ("itl_p90_ms", "ITL p90 (ms)"))
        ):
            ax = axes[row][col]
            for config, points in runs[w].items():
                pts = sorted((p for p in points if p.get(key) is not None), key=lambda p: p["rate_rps"])
                ax.plot([p["rate_rps"] for p in pts], [p[key] for p in pts], "o-", label=config)
            bound = slo.get("ttft_ms" if row == 0 else "tpot_ms")
            if bound:
                ax.axhline(bound, color="grey", linestyle="--", linewidth=1)
            ax.set_yscale("log")
            ax.set_title(w, fontsize=9)
            ax.set_xlabel("request rate (req/s)")
            ax.set_ylabel(label)
            ax.legend(fontsize=7)
    fig.suptitle(f"Latency p90 vs rate (dashed: TTFT SLO; TPOT SLO for reference) {note}", fontsize=9)
    fig.tight_layout()
    written.append(_save(fig, plt, out_dir / f"{stem}-latency.png"))

    samples: Mapping[str, Mapping[str, Any]] = doc.get("itl_samples", {})
    with_samples = [w for w in workloads if samples.get(w, {}).get("by_config")]
    if with_samples:
        fig, axes = _panels(plt, len(with_samples))
        for ax, w in zip(axes[0], with_samples, strict=True):
            for config, itls in samples[w]["by_config"].items():
                xs = sorted(itls)
                if xs:
                    ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=config)
            ax.set_xscale("log")
            ax.set_title(f"{w} at {samples[w]['rate_rps']:.3g} req/s", fontsize=9)
            ax.set_xlabel("inter-token latency (ms)")
            ax.set_ylabel("CDF")
            ax.legend(fontsize=7)
        fig.suptitle(f"ITL distribution {note}", fontsize=9)
        fig.tight_layout()
        written.append(_save(fig, plt, out_dir / f"{stem}-itl.png"))
    return written


def _save(fig: Any, plt: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
