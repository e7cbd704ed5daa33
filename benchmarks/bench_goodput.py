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

Writes benchmarks/results/goodput.json (goodput-quick.json with --quick, goodput-cuda.json with
--device cuda) and the plots beside it (goodput.png, goodput-latency.png, goodput-itl.png).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.goodput import configs, loadgen, stats, workloads
from benchmarks.goodput.stats import RequestResult, SearchPlan, Slo, SloRule

RESULTS = Path(__file__).parent / "results"
ROOT = Path(__file__).resolve().parents[1]
UNIFIED = ("unified_dp2", "unified_2workers")


def machine() -> dict[str, object]:
    import torch

    try:
        load1 = os.getloadavg()[0]
    except OSError:
        load1 = -1.0
    info: dict[str, object] = {
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_model": _cpu_model(),
        "load_average_1m_at_start": round(load1, 2),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    if torch.cuda.is_available():
        info["cuda_device"] = torch.cuda.get_device_name(0)
    return info


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def requests_at(rate_rps: float, args: argparse.Namespace) -> int:
    """Requests of one run: enough for `--duration-s` at this rate, within the count bounds."""
    return max(args.min_requests, min(args.max_requests, math.ceil(rate_rps * args.duration_s)))


class Harness:
    """One benchmark run: its settings, the tokenizer, and the result document it fills in."""

    def __init__(self, args: argparse.Namespace, tokenizer: workloads.Tokenizer, out: Path) -> None:
        self.args = args
        self.tokenizer = tokenizer
        self.corpus = workloads.load_corpus()
        self.out = out
        self.workloads = {
            name: (
                workloads.WORKLOADS[name].quick(args.quick_max_tokens)
                if args.quick
                else workloads.WORKLOADS[name]
            )
            for name in args.workloads
        }
        self.doc: dict[str, Any] = {
            "note": args.note,
            "machine": machine(),
            "settings": {
                k: None if isinstance(v, float) and math.isinf(v) else v
                for k, v in vars(args).items()
                if isinstance(v, str | int | float | bool | list | type(None))
            }
            | {"attainment_target": args.target},
            "workloads": {n: vars(w) for n, w in self.workloads.items()},
            "commands": {},
            "slo": {},
            "runs": {w: {} for w in self.workloads},
            "goodput_rps": {w: {} for w in self.workloads},
            "goodput_lower_bound_only": {},
            "itl_samples": {},
        }
        self.quiet: dict[str, dict[str, list[RequestResult]]] = {w: {} for w in self.workloads}

    def save(self) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps(self.doc, indent=1) + "\n")

    # --- stacks ---

    def stack(self, config: str, log_dir: Path) -> Any:
        """Context manager yielding (base_url, model) for `config`: the given --base-url, or a
        stack started with `pdserve up`."""
        args = self.args
        if args.base_url:
            return _external(args.base_url)
        cmd = configs.up_command(
            config,
            model=args.model,
            port_base=args.port_base,
            device=args.device,
            dtype=args.dtype,
            log_dir=log_dir / config,
            local_prefill_threshold=args.local_prefill_threshold,
            unified_threshold=args.unified_disaggregate_threshold,
            cpus=args.cpus,
            extra=args.up_arg,
        )
        self.doc["commands"][config] = configs.printable(cmd)
        print(f"[{config}] {configs.printable(cmd)}", flush=True)
        return configs.running(cmd, cwd=ROOT)

    async def target(self, base_url: str) -> loadgen.Target:
        model = self.args.served_model or await loadgen.served_model(base_url, self.args.api_key) or "default"
        target = loadgen.Target(
            base_url=base_url,
            model=model,
            api_key=self.args.api_key,
            ignore_eos=not self.args.no_ignore_eos,
            request_timeout_s=self.args.request_timeout_s,
        )
        warm = workloads.make_requests(
            workloads.WORKLOADS["chat"].quick(8),
            self.tokenizer,
            self.args.warmup_requests,
            self.args.seed,
            "warmup",
            self.corpus,
        )
        results = await loadgen.run_sequential(target, warm)
        bad = [r for r in results if not r.ok]
        if bad:
            raise RuntimeError(f"warm-up request failed: {bad[0].status} {bad[0].error}")
        return target

    # --- phase 1: uncontended latencies -> SLOs ---

    def warm(self, target: loadgen.Target, w: workloads.Workload) -> None:
        """One short request of workload `w` (not recorded): the first long prompt and the shared
        system prompt are then as warm as they are in a running deployment."""
        reqs = workloads.make_requests(w.quick(8), self.tokenizer, 1, self.args.seed, "warmup", self.corpus)
        asyncio.run(loadgen.run_sequential(target, reqs))

    def quiet_runs(self, config: str, target: loadgen.Target) -> None:
        for name, w in self.workloads.items():
            self.warm(target, w)
            reqs = workloads.make_requests(
                w, self.tokenizer, self.args.quiet_requests, self.args.seed, "quiet", self.corpus
            )
            results = asyncio.run(loadgen.run_sequential(target, reqs))
            self.quiet[name][config] = results
            s = stats.summarize(results, None)
            print(
                f"[{config}] {name} quiet x{len(results)}: TTFT p50 {s['ttft_p50_ms']} ms, "
                f"TPOT p50 {s['tpot_p50_ms']} ms, output tokens mean {s['completion_tokens_mean']}",
                flush=True,
            )

    def set_slos(self) -> dict[str, tuple[Slo, float]]:
        """Per workload: the SLO and the sweep's first rate."""
        quiet = self.quiet
        out = {}
        rule = SloRule(self.args.ttft_factor, self.args.tpot_factor)
        for name in self.workloads:
            if self.args.slo_ttft_ms and self.args.slo_tpot_ms:
                slo = Slo(self.args.slo_ttft_ms / 1000, self.args.slo_tpot_ms / 1000)
                lines = ["  SLOs given on the command line"]
            else:
                slo, lines = stats.derive_slo(quiet[name], rule)
            single = stats.single_stream_rps(quiet[name]) if quiet[name] else 1.0
            start = self.args.start_rps or self.args.start_factor * single
            print(f"SLOs for {name}:\n" + "\n".join(lines), flush=True)
            print(
                f"  one request at a time: {single:.3g} req/s; sweep starts at {start:.3g} req/s", flush=True
            )
            self.doc["slo"][name] = {
                "ttft_ms": round(1000 * slo.ttft_s, 2),
                "tpot_ms": round(1000 * slo.tpot_s, 2),
                "rule": f"{rule.ttft_factor:g} x TTFT p90 and {rule.tpot_factor:g} x TPOT p90 "
                "of the fastest configuration's quiet runs",
                "derivation": [line.strip() for line in lines],
                "single_stream_rps": round(single, 4),
                "quiet": {c: stats.summarize(r, slo) for c, r in quiet[name].items()},
            }
            out[name] = (slo, start)
        self.save()
        return out

    # --- phase 2: load sweeps ---

    def run(self, config_names: Sequence[str], log_dir: Path) -> None:
        """Quiet runs on every configuration, then the sweeps; one start per configuration when
        the SLOs are known before it starts (given, or a single configuration), else two."""
        fixed = bool(self.args.slo_ttft_ms)
        slos = self.set_slos() if fixed else None
        if fixed or len(config_names) == 1:
            for config in config_names:
                with self.stack(config, log_dir) as base_url:
                    target = asyncio.run(self.target(base_url))
                    if slos is None:
                        self.quiet_runs(config, target)
                        slos = self.set_slos()
                    self.sweeps(config, target, slos)
            return
        for config in config_names:
            with self.stack(config, log_dir) as base_url:
                self.quiet_runs(config, asyncio.run(self.target(base_url)))
        slos = self.set_slos()
        for config in config_names:
            with self.stack(config, log_dir) as base_url:
                self.sweeps(config, asyncio.run(self.target(base_url)), slos)

    def sweeps(self, config: str, target: loadgen.Target, slos: dict[str, tuple[Slo, float]]) -> None:
        for name, w in self.workloads.items():
            slo, start = slos[name]
            self.warm(target, w)
            self.sweep(config, name, w, target, slo, start)

    def sweep(
        self, config: str, name: str, w: workloads.Workload, target: loadgen.Target, slo: Slo, start: float
    ) -> None:
        args = self.args
        plan = SearchPlan(
            start_rps=start,
            growth=args.growth,
            resolution=args.resolution,
            max_rps=args.max_rps,
            min_rps=args.min_rps,
            target=args.target,
            max_points=args.max_points,
        )
        fixed = list(args.rates)
        points: list[tuple[float, float]] = []
        rows: list[dict[str, Any]] = self.doc["runs"][name].setdefault(config, [])
        first_rate: float | None = None
        while True:
            rate = (fixed.pop(0) if fixed else None) if args.rates else stats.next_rate(points, plan)
            if rate is None:
                break
            rate = float(f"{rate:.4g}")
            first_rate = first_rate or rate
            n = requests_at(rate, args)
            reqs = workloads.make_requests(w, self.tokenizer, n, args.seed, f"rate-{rate:g}", self.corpus)
            t0 = time.perf_counter()
            results = asyncio.run(loadgen.run_open_loop(target, reqs, rate, args.seed, args.max_send_s))
            s = stats.summarize(results, slo)
            s["rate_rps"] = rate
            s["wall_s"] = round(time.perf_counter() - t0, 2)
            rows.append(s)
            points.append((rate, float(s["attainment"])))  # type: ignore[arg-type]
            if rate == first_rate:
                itl_at = self.doc["itl_samples"].setdefault(name, {"rate_rps": rate, "by_config": {}})
                if itl_at["rate_rps"] == rate:
                    itl_at["by_config"][config] = [
                        round(1000 * x, 2) for r in results if r.ok for x in r.itl_s
                    ]
            print(
                f"[{config}] {name} {rate:7.3g} req/s {len(results)}/{n} sent, "
                f"attainment {_pct(s['attainment'])} "
                f"(TTFT {_pct(s['ttft_attainment'])}, TPOT {_pct(s['tpot_attainment'])})  "
                f"TTFT p90 {s['ttft_p90_ms']} ms  ITL p90 {s['itl_p90_ms']} ms  "
                f"TPOT p90 {s['tpot_p90_ms']} ms  {s['output_tokens_per_s']} tok/s  "
                f"errors {s['errors'] or 0}  ({s['wall_s']} s)",
                flush=True,
            )
            self.doc["goodput_rps"][name][config] = stats.goodput(points, args.target)
            # no rate missed the target: the goodput is only a lower bound
            lower = all(a >= args.target for _, a in points)
            self.doc["goodput_lower_bound_only"].setdefault(name, {})[config] = lower
            self.save()
        lower = self.doc["goodput_lower_bound_only"][name].get(config, False)
        gp = self.doc["goodput_rps"][name][config]
        print(f"[{config}] {name}: goodput {'>= ' if lower else ''}{gp:.3g} req/s", flush=True)

    # --- summary ---

    def report(self) -> None:
        report(self.doc, self.args.target, self.args.note)
        self.save()


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


def _pct(x: object) -> str:
    return f"{100 * float(x):5.1f} %"  # type: ignore[arg-type]


class _external:
    def __init__(self, url: str) -> None:
        self.url = url

    def __enter__(self) -> str:
        return self.url

    def __exit__(self, *exc: object) -> None:
        return None


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


def _csv(kind: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    return lambda text: [kind(x) for x in text.split(",") if x.strip()]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
        "--out", default="", help="result file (default benchmarks/results/goodput[-cuda][-quick].json)"
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
    stem = "goodput" + ("-cuda" if a.device == "cuda" else "") + ("-quick" if a.quick else "")
    return RESULTS / f"{stem}.json"


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    a = parse_args(argv)
    out = Path(a.out) if a.out else default_out(a)
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


if __name__ == "__main__":
    main()
