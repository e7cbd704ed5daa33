"""Per-step dispatch profile of a pure decode step (issue 15 item 3).

For a few batch sizes (each sequence holding `context` cached tokens) this counts the aten ops
one `ModelRunner.execute` dispatches (a TorchDispatchMode counter, so views and in-place ops
count too) and the median process CPU time of a step with one torch thread, for both forwards
of the same loaded model: engine/lean_llama.py's flat loop (the default) and transformers' own
module tree (`--no-lean-forward`). The op counts are deterministic and are what to compare
across changes; CPU ms are noisy on a shared machine, so the two paths run interleaved in one
process.

    python -m benchmarks.step_profile [--batches 1 8 16] [--context 300] [--top 15] [--out F]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class OpCounter(TorchDispatchMode):
    """Counts every aten op dispatched while active (by overload packet name)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.counts[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def decode_seqs(runner: Any, batch: int, context: int) -> list[Any]:
    from services.worker.engine.api import SamplingConfig
    from services.worker.engine.model_runner import ScheduledSeq

    bs = runner.layout.block_size
    per_seq = -(-(context + 1) // bs)
    greedy = SamplingConfig(max_tokens=1, temperature=0.0)
    return [
        ScheduledSeq([100 + i], context, list(range(i * per_seq, (i + 1) * per_seq)), True, greedy, None)
        for i in range(batch)
    ]


def profile(runners: dict[str, Any], batch: int, context: int, reps: int) -> dict[str, Any]:
    """Op counts per path, then CPU ms per path with the paths interleaved step by step (so
    machine noise hits both alike)."""
    any_runner = next(iter(runners.values()))
    seqs = decode_seqs(any_runner, batch, context)
    out: dict[str, Any] = {}
    for name, runner in runners.items():
        runner.execute(seqs)
        counter = OpCounter()
        with counter:
            runner.execute(seqs)
        out[name] = {"aten_ops": sum(counter.counts.values()), "by_op": counter.counts, "cpu": []}
    for _ in range(reps):
        for name, runner in runners.items():
            c0 = time.process_time()
            runner.execute(seqs)
            out[name]["cpu"].append(time.process_time() - c0)
    for r in out.values():
        r["cpu_ms_median"] = round(statistics.median(r.pop("cpu")) * 1e3, 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16])
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = ap.parse_args()
    from benchmarks.engine_floor import cpu_features
    from services.worker.engine.backend import ModelBackend
    from services.worker.engine.model_loading import kv_layout_of, load_model
    from services.worker.engine.model_runner import ModelRunner
    from services.worker.engine.options import BackendOptions
    from shared.model_store import resolve_model

    torch.set_num_threads(1)
    device, dtype = torch.device("cpu"), torch.float32
    model = load_model(str(resolve_model("default")), device, dtype)
    layout = kv_layout_of(model.config, 16, dtype)
    per_seq = -(-(args.context + 1) // 16)
    blocks = max(args.batches) * per_seq + 1
    # the same model object under both forwards (each runner has its own KV pool)
    runners = {
        name: ModelRunner(
            model,
            layout,
            blocks,
            device,
            dtype,
            backend=ModelBackend.choose(BackendOptions(lean_forward=lean, cuda_graphs=False), device),
        )
        for name, lean in (("lean", True), ("transformers", False))
    }
    for runner in runners.values():
        runner.warm_up()
    load_before = os.getloadavg()
    print(f"load average: {load_before}, layers: {layout.num_layers}")
    results = []
    for b in args.batches:
        r = profile(runners, b, args.context, args.reps)
        for name, p in r.items():
            per_layer = p["aten_ops"] / layout.num_layers
            print(
                f"{name:>12} seqs={b:3d} aten_ops/step={p['aten_ops']:6d} (~{per_layer:.1f}/layer) "
                f"cpu_ms/step(median of {args.reps})={p['cpu_ms_median']}"
            )
            print("   ", ", ".join(f"{k}={v}" for k, v in p["by_op"].most_common(args.top)))
        lean, hf = r["lean"], r["transformers"]
        print(
            f"   lean/transformers: ops {lean['aten_ops'] / hf['aten_ops']:.2f}x, "
            f"cpu {lean['cpu_ms_median'] / hf['cpu_ms_median']:.2f}x"
        )
        results.append(
            {
                "seqs": b,
                **{f"{n}_aten_ops": p["aten_ops"] for n, p in r.items()},
                **{f"{n}_cpu_ms": p["cpu_ms_median"] for n, p in r.items()},
            }
        )
    load_after = os.getloadavg()
    print(f"load average: {load_after}")
    if args.out:
        doc = {
            "command": "python -m benchmarks.step_profile " + " ".join(sys.argv[1:]),
            "machine": {**cpu_features(), "load_average": [load_before, load_after]},
            "context_tokens": args.context,
            "results": results,
        }
        args.out.write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
