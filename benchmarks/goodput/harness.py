"""One goodput run (`Harness`): for each configuration, start its stack (or drive --base-url),
run the quiet requests that set the SLOs and the open-loop rate search per workload, and fill in
the result document (saved after every step), with the machine it ran on."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.goodput import configs, loadgen, report, stats, workloads
from benchmarks.goodput.stats import RequestResult, SearchPlan, Slo, SloRule

ROOT = Path(__file__).resolve().parents[2]  # the repository: where `pdserve up` runs


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
        report.report(self.doc, self.args.target, self.args.note)
        self.save()


def _pct(x: object) -> str:
    return f"{100 * float(x):5.1f} %"  # type: ignore[arg-type]


class _external:
    def __init__(self, url: str) -> None:
        self.url = url

    def __enter__(self) -> str:
        return self.url

    def __exit__(self, *exc: object) -> None:
        return None
