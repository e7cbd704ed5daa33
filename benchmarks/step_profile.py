"""Per-step dispatch profile of a pure decode step (issue 15 item 3).

For a few batch sizes (each sequence holding `context` cached tokens) this counts the aten ops
one `ModelRunner.execute` dispatches (a TorchDispatchMode counter, so views and in-place ops
count too) and the median process CPU time of a step with one torch thread. The op counts are
deterministic and are what to compare across changes; CPU ms are noisy on a shared machine
(compare only within one process, interleaved).

    python -m benchmarks.step_profile [--batches 1 8 16] [--context 300] [--top 15]
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import time
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


def profile(runner: Any, batch: int, context: int, reps: int) -> dict[str, Any]:
    seqs = decode_seqs(runner, batch, context)
    runner.execute(seqs)
    counter = OpCounter()
    with counter:
        runner.execute(seqs)
    cpu = []
    for _ in range(reps):
        c0 = time.process_time()
        runner.execute(seqs)
        cpu.append(time.process_time() - c0)
    return {
        "seqs": batch,
        "aten_ops": sum(counter.counts.values()),
        "by_op": counter.counts,
        "cpu_ms_median": round(statistics.median(cpu) * 1e3, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16])
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    from services.worker.engine.model_runner import ModelRunner, kv_layout_of, load_model
    from shared.model_store import resolve_model

    torch.set_num_threads(1)
    device, dtype = torch.device("cpu"), torch.float32
    model = load_model(str(resolve_model("default")), device, dtype)
    layout = kv_layout_of(model.config, 16, dtype)
    per_seq = -(-(args.context + 1) // 16)
    runner = ModelRunner(model, layout, max(args.batches) * per_seq + 1, device, dtype)
    runner.warm_up()
    print(f"load average: {os.getloadavg()}, layers: {layout.num_layers}")
    for b in args.batches:
        r = profile(runner, b, args.context, args.reps)
        per_layer = r["aten_ops"] / layout.num_layers
        print(
            f"seqs={b:3d} aten_ops/step={r['aten_ops']:6d} (~{per_layer:.1f}/layer) "
            f"cpu_ms/step(median of {args.reps})={r['cpu_ms_median']}"
        )
        print("   ", ", ".join(f"{k}={v}" for k, v in r["by_op"].most_common(args.top)))
    print(f"load average: {os.getloadavg()}")


if __name__ == "__main__":
    main()
