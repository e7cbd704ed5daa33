"""The engine benchmark's report: the contenders' table, the ratios against transformers, the
prefix-cache and engine-start lines, the floor probe, and the results file
(benchmarks/results/engine-<machine class>.json unless --output; same keys as ever)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from benchmarks.result_names import result_path


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a and b else None


def _fmt(v: Any, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def write(
    args: argparse.Namespace,
    results: dict[str, dict[str, Any] | None],
    prefix: dict[str, Any] | None,
    floor: dict[str, Any] | None,
) -> None:
    print(
        f"\n{'contender':<15}{'tok/s':>8}{'TTFT p50':>10}{'p99':>9}{'TPOT p50':>10}{'p99':>8}{'RSS MiB':>9}"
    )
    for name, r in results.items():
        if r is None:
            print(f"{name:<15}{'(not run)':>8}")
            continue
        print(
            f"{name:<15}{r['tokens_per_s']:>8.1f}{_fmt(r['ttft_ms_p50'], 0):>10}"
            f"{_fmt(r['ttft_ms_p99'], 0):>9}{_fmt(r['tpot_ms_p50']):>10}"
            f"{_fmt(r['tpot_ms_p99']):>8}{r['peak_rss_mib']:>9.0f}"
        )
    tps = {k: (v["tokens_per_s"] if v else None) for k, v in results.items()}
    ours = tps.get("pdserve")

    def ratio(base: str) -> float | None:
        return _ratio(ours, tps.get(base))

    ratios = {
        "ratio_vs_hf_sequential": ratio("hf_sequential"),
        "ratio_vs_hf_padded": ratio("hf_padded"),
        "ratio_vs_hf_continuous": ratio("hf_continuous"),
        # the lean forward (default) over transformers' module tree, same engine otherwise (on
        # CUDA both without graphs, which need the lean forward: pdserve_eager's rate)
        "ratio_lean_vs_transformers_forward": _ratio(
            tps.get("pdserve_eager") or ours, tps.get("pdserve_transformers")
        ),
    }
    if tps.get("pdserve_eager"):
        ratios["ratio_cuda_graphs_vs_eager"] = ratio("pdserve_eager")
    if tps.get("pdserve_torch"):
        ratios["ratio_cuda_kernels_vs_torch_path"] = ratio("pdserve_torch")
    if tps.get("pdserve_fp8"):  # > 1: FP8 weights are faster than the model's dtype
        ratios["ratio_fp8_vs_model_dtype"] = _ratio(tps.get("pdserve_fp8"), ours)
    if tps.get("pdserve_no_row_copy"):
        ratios["ratio_row_copy_vs_onednn_only"] = ratio("pdserve_no_row_copy")
    print("\n" + "  ".join(f"{k} {_fmt(v, 2)}" for k, v in ratios.items()))
    if prefix is not None:
        w, wo = prefix["with_cache"], prefix["without_cache"]
        print(
            f"prefix-heavy ({prefix['requests']} x {prefix['prefix_tokens']}-token shared "
            f"prefix + 64): prefill {wo['prefill_wall_s']:.2f} s without cache, "
            f"{w['prefill_wall_s']:.2f} s with (hit rate {w['hit_rate']:.1%}): "
            f"{prefix['speedup']:.2f}x"
        )
    graphs = " + CUDA graph capture" if args.device == "cuda" else ""
    for name, what in (("pdserve", f"load + warm-up{graphs}"), ("pdserve_eager", "load + warm-up")):
        if (r := results.get(name)) is not None:
            print(f"{name} engine start ({what}, {args.engine_dp_size} rank(s)): {r['engine_start_s']:.1f} s")
    if (r := results.get("pdserve")) is not None and r.get("steps"):
        print(
            "pdserve steps of the round: "
            + ", ".join(
                f"{kind} {s['steps']} x {s['ms_mean']:.2f} ms ({s['tokens_per_step']:.0f} tokens)"
                for kind, s in r["steps"].items()
            )
        )
    if floor is not None:
        from benchmarks.engine_floor import format_report

        print("\n".join(format_report(floor)))
    report = {
        "tokens_per_s": tps,
        **ratios,
        "cpu": floor["cpu"] if floor else None,
        "decode_step_vs_floor": floor["decode_step_vs_floor"] if floor else None,
        "floor": floor,
        "prefix_heavy": prefix,
        "config": {
            "model": args.model,
            "device": args.device,
            "dtype": args.dtype,
            "num_requests": args.num_requests,
            "prompt_tokens": [args.min_prompt, args.max_prompt],
            "new_tokens": args.new_tokens,
            "quick": args.quick,
            "threads": args.threads,
            "engine_dp_size": args.engine_dp_size,
            "engine_threads": args.engine_threads,
            "block_size": args.block_size,
        },
        "details": results,
    }
    out = Path(args.output) if args.output else result_path("engine", args.device, args.quick)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
