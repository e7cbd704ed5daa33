"""The speculative decoding benchmark's report: the results document (speedups, the targets,
every case, the configuration, the machine) in spec-<machine class>.json, the plot beside it,
and the target lines printed at the end."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from benchmarks.result_names import result_path
from benchmarks.spec.config import TARGETS
from benchmarks.spec.run import machine


def target_lines(report: dict[str, Any]) -> list[str]:
    """One line per case: the wall-clock ratio (and per CPU second) against its target."""
    lines = []
    for w, cases in TARGETS.items():
        for c, target in cases.items():
            got = report["speedup"].get(w, {}).get(c)
            cpu = report["speedup_cpu"].get(w, {}).get(c)
            verdict = "n/a" if got is None else ("ok" if got >= target else "BELOW")
            lines.append(f"  {w:>8} {c}: {got}x (per CPU second {cpu}x) vs target >= {target}x: {verdict}")
    return lines


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = [(w, c) for w in ("grounded", "open") for c in ("c1", "c8")]
    labels = [f"{w}\n{c}" for w, c in cases]
    off = [report["results"][w][c]["off"]["tokens_per_s"] for w, c in cases]
    ngram = [report["results"][w][c]["ngram"]["tokens_per_s"] for w, c in cases]
    fig, ax = plt.subplots(figsize=(7, 4))
    x = range(len(cases))
    ax.bar([i - 0.2 for i in x], off, 0.4, label="speculation off")
    ax.bar([i + 0.2 for i in x], ngram, 0.4, label="ngram")
    for i, (a, b) in enumerate(zip(off, ngram, strict=True)):
        ax.text(i + 0.2, b, f"{b / a:.2f}x", ha="center", va="bottom", fontsize=9)
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("generated tokens/s")
    m = report["machine"]
    ax.set_title(
        f"pdserve speculative decoding, {report['config']['model_id']} "
        f"{report['config']['device']} {report['config']['dtype']}\n"
        f"{m.get('cuda_device') or m['cpu_capability']}, {m['cpu_count']} cores ({m['note']})",
        fontsize=10,
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(args: argparse.Namespace, results: dict[str, Any], path: str, dtype: str) -> None:
    identical_expected = dtype == "float32" and args.device == "cpu"
    report = {
        "speedup": {w: {c: results[w][c]["speedup"] for c in results[w]} for w in results},
        "speedup_cpu": {w: {c: results[w][c]["speedup_cpu"] for c in results[w]} for w in results},
        "targets": TARGETS,
        "draft": (
            {w: {c: results[w][c]["draft"]["speedup"] for c in results[w]} for w in results}
            if args.draft_model
            else "not measured: SmolLM2-135M is the smallest model available offline, so there is "
            "no meaningful smaller draft (run with --draft-model to measure one)"
        ),
        "results": results,
        "config": {
            "model": args.model,
            "model_id": Path(path).name,
            "device": args.device,
            "dtype": dtype,
            "max_tokens": args.max_tokens,
            "num_speculative_tokens": args.num_speculative_tokens,
            "spec_step_cost": not args.no_step_cost,
            "draft_model": args.draft_model,
            "requests_c1": args.requests_c1,
            "concurrency": args.concurrency,
            "quick": args.quick,
            "repeat": args.repeat,
            "sampling": "greedy",
            "command": "make bench-spec",
            # greedy output with speculation equals output without only where a verify step's
            # logits are bit-equal to a plain step's: fp32 on the CPU. In bf16 (CUDA) a verify
            # step runs other kernel shapes, whose rounding can flip near-ties
            "identical_expected": identical_expected,
        },
        "machine": machine(),
    }
    out = Path(args.output) if args.output else result_path("spec", args.device, args.quick)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    png = out.with_suffix(".png")
    plot(report, png)
    if not identical_expected:
        print(
            f"({dtype} on {args.device}: outputs may differ with speculation; identity holds in fp32 on CPU)"
        )
    print(f"speedup (ngram / off tokens/s): {report['speedup']}")
    for line in target_lines(report):
        print(line)
    print(f"wrote {out} and {png}")
