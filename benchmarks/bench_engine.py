"""Engine benchmark (`make bench-engine`): the pdserve engine in process against transformers'
`generate` (one request at a time, and one padded batch) and transformers' continuous batching
(`generate_batch`), on the same machine, model and dtype, in one run.

Workload: N concurrent requests (default 16) arriving together, prompts spread evenly over
[64, 512] tokens (random token ids, fixed seed), exactly 64 new tokens each (EOS ignored).
Every contender gets the whole machine: transformers with torch's default threads, pdserve (by
default on CPU) as one DP rank per core, up to 2, with one torch thread each (one thread per
rank beats two threads in one on this 2-core CPU, see docs/architecture.md); `--threads 1
--engine-dp-size 1` compares on one core instead. Each contender runs in its own subprocess so
peak RSS is its own. `pdserve_transformers` is the same engine with transformers' own forward
(`--no-lean-forward`), to show what the lean forward (engine/lean_llama.py) gains. Reported per
contender:
aggregate generated tokens/s (all tokens / wall time from the common arrival), TTFT (arrival to
first token) and TPOT (mean gap between a request's later tokens) p50/p99, peak RSS.

Then a prefix-heavy run on the engine: N requests sharing a 448-token prefix (+ 64 own tokens),
one token each, after one warm-up request; prefill wall time with vs without the prefix cache.

Then the floor probe (benchmarks/engine_floor.py): memory read bandwidth (one core, all cores),
the CPU capability torch reports, and one rank's pure decode step for 1, 8 and 16 sequences next
to its floor (weights + KV bytes read per step / single-core bandwidth).

Writes benchmarks/results/engine-<machine class>.json (engine-cpu-avx512.json,
engine-cuda-h200.json; benchmarks/result_names.py): tokens_per_s (per contender),
ratio_vs_hf_sequential, ratio_vs_hf_padded, ratio_vs_hf_continuous,
ratio_lean_vs_transformers_forward (null when that contender did not run), cpu (what torch
reports), decode_step_vs_floor (8 sequences per rank), floor (the probe), details.
This module is the command and each contender's subprocess; the parts are in `benchmarks/engine/`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.engine import hf, report
from benchmarks.engine import pdserve as engine_runs
from benchmarks.engine.config import child_argv, parse_args
from benchmarks.engine.workload import make_prompts, peak_rss_mib

RUNNERS = {
    "hf_sequential": hf.run_hf_sequential,
    "hf_padded": hf.run_hf_padded,
    "hf_continuous": hf.run_hf_continuous,
    "pdserve": engine_runs.run_pdserve,
    "pdserve_transformers": engine_runs.run_pdserve_transformers,
    "pdserve_eager": engine_runs.run_pdserve_eager,
    "pdserve_torch": engine_runs.run_pdserve_torch,
    "pdserve_fp8": engine_runs.run_pdserve_fp8,
    "pdserve_no_row_copy": engine_runs.run_pdserve_no_row_copy,
    "prefix": engine_runs.run_prefix,
    "floor": engine_runs.run_floor,
}


def run_one(args: argparse.Namespace) -> None:
    """Child process: run one contender, write its JSON to args.child_out."""
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoConfig

    args.vocab_size = AutoConfig.from_pretrained(args.model_path).vocab_size
    prompts = make_prompts(args.num_requests, args.min_prompt, args.max_prompt, args.vocab_size)
    result = RUNNERS[args.contender](args, prompts)
    result["peak_rss_mib"] = round(peak_rss_mib(), 1)
    Path(args.child_out).write_text(json.dumps(result))


def _child(args: argparse.Namespace, contender: str, argv: list[str]) -> dict[str, Any] | None:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        cmd = [
            sys.executable,
            "-m",
            "benchmarks.bench_engine",
            *argv,
            "--contender",
            contender,
            "--child-out",
            str(out),
            "--model-path",
            args.model_path,
        ]
        print(f"-- {contender} ...", flush=True)
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.child_timeout_s)
        except subprocess.TimeoutExpired:  # a loaded machine: report it, run the others
            print(f"   {contender} timed out after {args.child_timeout_s:.0f} s")
            return None
        if proc.returncode != 0 or not out.exists():
            print(
                f"   {contender} failed (rc {proc.returncode}): {proc.stderr.strip().splitlines()[-1:] or ''}"
            )
            return None
        print(f"   done in {time.perf_counter() - t0:.1f} s", flush=True)
        return dict(json.loads(out.read_text()))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv, __doc__.split("\n\n")[0])
    if args.contender:
        run_one(args)
        return

    from shared.model_store import resolve_model

    args.model_path = str(resolve_model(args.model))
    argv_of_child = child_argv(args)
    print(
        f"model {args.model_path}, {args.device} {args.dtype}, {args.num_requests} requests, "
        f"prompts {args.min_prompt}-{args.max_prompt}, {args.new_tokens} new tokens, "
        f"{os.cpu_count()} CPUs"
    )
    results: dict[str, dict[str, Any] | None] = {}
    for name in args.contenders.split(","):
        if name in ("pdserve_eager", "pdserve_torch", "pdserve_fp8") and args.device != "cuda":
            continue  # the same engine as pdserve off CUDA
        if name == "pdserve_no_row_copy" and args.device != "cpu":
            continue  # the row copy is a CPU kernel
        results[name] = _child(args, name, argv_of_child)
    prefix = None if args.no_prefix_run else _child(args, "prefix", argv_of_child)
    floor = None if args.no_floor_run else _child(args, "floor", argv_of_child)

    report.write(args, results, prefix, floor)


if __name__ == "__main__":
    main()
