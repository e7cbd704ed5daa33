"""The goodput benchmark's flags: what to run (workloads, configurations, rates, SLOs, the
search), where (started stacks or --base-url) and where results go (`default_out`)."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.goodput import configs, workloads
from benchmarks.result_names import result_path


def _csv(kind: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    return lambda text: [kind(x) for x in text.split(",") if x.strip()]


def parse_args(argv: Sequence[str] | None, description: str) -> argparse.Namespace:
    """The flags (`description`: the command's help text), checked: each problem an argparse error."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a small run: few requests, few rates, short outputs")
    p.add_argument("--workloads", type=_csv(str), default=list(workloads.WORKLOADS), help="comma-separated")
    p.add_argument(
        "--configs",
        type=_csv(str),
        default=list(configs.CONFIG_NAMES),
        help="comma-separated; conditional@N / conditional_unified@N: that configuration at threshold N",
    )
    p.add_argument(
        "--base-url", default="", help="drive this OpenAI-compatible server (…/v1) instead of starting stacks"
    )
    p.add_argument(
        "--api-key", default=os.environ.get("OPENAI_API_KEY", ""), help="bearer key (default $OPENAI_API_KEY)"
    )
    p.add_argument(
        "--served-model", default="", help="the request's `model` (default: the first of GET /v1/models)"
    )
    p.add_argument("--model", default="default", help="model of the started stacks (pdserve up --model)")
    p.add_argument("--tokenizer", default="", help="tokenizer that cuts prompts to length (default: --model)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="", help="default float32 on cpu, bfloat16 on cuda")
    p.add_argument(
        "--port-base", type=int, default=57000, help="pdserve up --port-base of the started stacks"
    )
    p.add_argument("--cpus", default="", help="pin each started stack to these CPUs (taskset -c), e.g. 0,1")
    p.add_argument("--up-arg", action="append", default=[], help="extra pdserve up flag (repeatable)")
    p.add_argument(
        "--local-prefill-threshold",
        type=int,
        default=configs.DEFAULT_LOCAL_PREFILL_THRESHOLD,
        help="the conditional configuration's local-prefill threshold (tokens of uncached prompt)",
    )
    p.add_argument(
        "--unified-disaggregate-threshold",
        type=int,
        default=configs.DEFAULT_UNIFIED_THRESHOLD,
        help="the conditional_unified configuration's split threshold (tokens of uncached prompt; "
        "default: the scheduler's)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--no-ignore-eos", action="store_true", help="do not send ignore_eos (outputs may end early)"
    )
    p.add_argument("--warmup-requests", type=int, default=2)
    p.add_argument(
        "--quiet-requests", type=int, default=None, help="uncontended requests per workload (8; quick 3)"
    )
    p.add_argument("--ttft-factor", type=float, default=4.0, help="TTFT SLO = this x quiet TTFT p90")
    p.add_argument("--tpot-factor", type=float, default=3.0, help="TPOT SLO = this x quiet TPOT p90")
    p.add_argument(
        "--slo-ttft-ms", type=float, default=0.0, help="fixed TTFT SLO (with --slo-tpot-ms: no quiet runs)"
    )
    p.add_argument("--slo-tpot-ms", type=float, default=0.0, help="fixed TPOT SLO")
    p.add_argument("--target", type=float, default=0.9, help="attainment that counts as meeting the SLOs")
    p.add_argument("--rates", type=_csv(float), default=[], help="measure exactly these rates (no search)")
    p.add_argument(
        "--start-rps", type=float, default=0.0, help="first rate (default start-factor x single-stream)"
    )
    p.add_argument("--start-factor", type=float, default=0.5, help="first rate / one-request-at-a-time rate")
    p.add_argument("--growth", type=float, default=2.0, help="sweep step factor")
    p.add_argument(
        "--resolution", type=float, default=None, help="bisect until bracket ratio <= 1+this (0.1; quick 0.5)"
    )
    p.add_argument(
        "--max-points", type=int, default=None, help="rates per configuration and workload (8; quick 3)"
    )
    p.add_argument("--max-rps", type=float, default=math.inf)
    p.add_argument("--min-rps", type=float, default=0.0)
    p.add_argument(
        "--duration-s", type=float, default=None, help="requests per rate = rate x this (120; quick 20) ..."
    )
    p.add_argument(
        "--min-requests", type=int, default=None, help="... but at least this many (20; quick 4) ..."
    )
    p.add_argument("--max-requests", type=int, default=None, help="... and at most this many (80; quick 8)")
    p.add_argument(
        "--max-send-s", type=float, default=None, help="stop sending after this long per rate (300; quick 60)"
    )
    p.add_argument(
        "--request-timeout-s", type=float, default=None, help="one request at most (600; quick 120)"
    )
    p.add_argument(
        "--quick-max-tokens", type=int, default=16, help="--quick caps outputs at this many tokens"
    )
    p.add_argument(
        "--out",
        default="",
        help="result file (default benchmarks/results/goodput-<machine class>[-quick].json)",
    )
    p.add_argument("--no-plots", action="store_true")
    p.add_argument(
        "--merge",
        nargs="+",
        default=[],
        metavar="JSON",
        help="run nothing: merge these result files (one workload or configuration set each, "
        "same machine, same SLOs per workload) into --out, with its report and plots",
    )
    p.add_argument(
        "--replace-with-later",
        type=_csv(str),
        default=[],
        metavar="PAIRS",
        help="with --merge: CONFIG or WORKLOAD:CONFIG, comma-separated; a later file's rates of "
        "those replace the earlier files' instead of joining them (the code they ran changed)",
    )
    p.add_argument("--note", default="", help="a remark stored with the results and shown on the plots")
    a = p.parse_args(argv)
    q = a.quick
    for name, full, quick in (
        ("quiet_requests", 8, 3),
        ("resolution", 0.1, 0.5),
        ("max_points", 8, 3),
        ("duration_s", 120.0, 20.0),
        ("min_requests", 20, 4),
        ("max_requests", 80, 8),
        ("max_send_s", 300.0, 60.0),
        ("request_timeout_s", 600.0, 120.0),
    ):
        if getattr(a, name) is None:
            setattr(a, name, quick if q else full)
    a.dtype = a.dtype or ("bfloat16" if a.device == "cuda" else "float32")
    for w in a.workloads:
        if w not in workloads.WORKLOADS:
            p.error(f"unknown workload {w!r}; known: {', '.join(workloads.WORKLOADS)}")
    for c in a.configs:
        if not configs.is_config(c):
            p.error(
                f"unknown configuration {c!r}; known: {', '.join(configs.CONFIG_NAMES)}, "
                "conditional@N, conditional_unified@N"
            )
    if a.base_url:
        a.configs = ["external"]
    if bool(a.slo_ttft_ms) != bool(a.slo_tpot_ms):
        p.error("--slo-ttft-ms and --slo-tpot-ms go together")
    if a.slo_ttft_ms and not (a.rates or a.start_rps):
        p.error("with fixed SLOs there are no quiet runs: give --rates or --start-rps")
    return a


def default_out(a: argparse.Namespace) -> Path:
    """benchmarks/results/goodput-<machine class>[-quick].json, e.g. goodput-cuda-h200.json."""
    return result_path("goodput", a.device, a.quick)
