"""Host time per engine step (issue 31): what a decode step costs the step thread outside the
model's compute, split by phase, at 1, 8 and 64 concurrent greedy requests (EOS ignored).

The model is `random:tiny` (shared/model_store.py): 2 layers of hidden 64 over the bundled
tokenizer's real vocabulary (49,152 ids), so the forward pass is small while sampling and
detokenization cost what they cost with a real model. On a GPU the host work of step N+1
overlaps the device's step N (async scheduling), so this host time must stay well under the
GPU's step; it is device-independent Python and is measured here on the CPU.

Phases of one step on the rank's step thread (engine/rank.py, engine/step.py), in ms of the
step thread's CPU time (time waiting for the GIL or for a core is not counted: other processes
on a shared machine disturb it far less than wall-clock time):
  schedule  scheduler.schedule + plan_batch (the requests' snapshots); with async scheduling
            (--async-scheduling) the next decode step's plan and snapshots
  inputs    step_inputs.build (packed ids, positions, slots, attention metadata)
  forward   the model's forward pass (includes the LM head over the vocabulary)
  sample    sampling of the step's logits (here mostly the argmax over the vocabulary: device
            work on a GPU)
  update    scheduler.update (tokens appended, detokenization, stop rules)
  outputs   rank.apply (request outputs) and handing them to the event loop
  other     the rest of the step (locks, speculation hooks, bookkeeping)
  step      the whole step; `step_wall`: its wall-clock time
  host      step - forward - sample: the host time per step this benchmark is about
Each figure is the median over the decode steps that run all N requests, then the median over
`--repeats` runs. `loop_cpu_ms` is the process CPU time per step not spent on the step thread:
the event loop consuming the outputs (here a plain `async for`; in a worker, gRPC streaming).

    python -m benchmarks.host_overhead [--concurrency 1 8 64] [--new-tokens 64] [--repeats 3]

Writes benchmarks/results/host-overhead-<machine class>.json (host-overhead-cpu-avx512.json).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from benchmarks.engine_floor import cpu_features
from benchmarks.result_names import machine_class, result_path

WORKLOAD = ("prompt_tokens", "new_tokens", "repeats", "threads", "async_scheduling")
PHASES = ("schedule", "inputs", "forward", "sample", "update", "outputs")


class PhaseClock:
    """Per-step phase times of the rank's step thread, while `on`: each step a dict of phase ->
    nanoseconds, plus its batch (number of sequences, whether every one ran one token)."""

    def __init__(self) -> None:
        self.on = False
        self.steps: list[dict[str, Any]] = []
        self._current: dict[str, Any] | None = None
        self._thread: int | None = None

    def step(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if not self.on:
                return fn(*args, **kwargs)
            self._thread = threading.get_ident()
            self._current = rec = dict.fromkeys(PHASES, 0)
            c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                rec["step"] = time.thread_time_ns() - c0
                rec["step_wall"] = time.perf_counter_ns() - t0
                self._current = None
                if "seqs" in rec:  # it ran a batch (not an idle wait)
                    self.steps.append(rec)

        return wrapped

    def phase(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            rec = self._current
            if rec is None or threading.get_ident() != self._thread:
                return fn(*args, **kwargs)
            t0 = time.thread_time_ns()
            try:
                out = fn(*args, **kwargs)
            finally:
                rec[name] += time.thread_time_ns() - t0
            # the step's plan: the scheduler's, or async scheduling's next decode step
            plan = out if fn.__name__ == "schedule" else None
            if fn.__name__ == "_next_plan" and out is not None:
                plan = out[0]
            if plan is not None and plan.scheduled:
                rec["seqs"] = len(plan.scheduled)
                rec["decode"] = all(s.num_new_tokens == 1 for s in plan.scheduled)
            return out

        return wrapped


@contextlib.contextmanager
def instrumented(clock: PhaseClock) -> Iterator[None]:
    """Patch the step loop's phase functions with timing wrappers (restored afterwards)."""
    from services.worker.engine import async_steps, model_runner, rank, scheduler

    runner_cls = model_runner.ModelRunner
    patches: list[tuple[Any, str, Any]] = [
        (rank.Rank, "_step", clock.step(rank.Rank._step)),
        (scheduler.Scheduler, "schedule", clock.phase("schedule", scheduler.Scheduler.schedule)),
        (rank, "plan_batch", clock.phase("schedule", rank.plan_batch)),
        (async_steps.AsyncSteps, "_next_plan", clock.phase("schedule", async_steps.AsyncSteps._next_plan)),
        (runner_cls, "_build_metadata", clock.phase("inputs", runner_cls._build_metadata)),
        (runner_cls, "_forward", clock.phase("forward", runner_cls._forward)),
        (model_runner, "sample_step", clock.phase("sample", model_runner.sample_step)),
        (model_runner, "draw", clock.phase("sample", model_runner.draw)),
        (scheduler.Scheduler, "update", clock.phase("update", scheduler.Scheduler.update)),
        (rank.Rank, "apply", clock.phase("outputs", rank.Rank.apply)),
        (rank, "deliver_batch", clock.phase("outputs", rank.deliver_batch)),
        (async_steps, "deliver_batch", clock.phase("outputs", async_steps.deliver_batch)),
    ]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, new in patches:
        setattr(owner, name, new)
    try:
        yield
    finally:
        for owner, name, old in saved:
            setattr(owner, name, old)


async def _run(engine: Any, prompts: list[tuple[int, ...]], new_tokens: int, tag: str) -> None:
    from services.worker.engine.api import EngineRequest, SamplingConfig

    sampling = SamplingConfig(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    handles = [engine.add_request(EngineRequest(f"{tag}-{i}", p, sampling)) for i, p in enumerate(prompts)]

    async def consume(h: Any) -> int:
        return sum([len(out.new_token_ids) async for out in h])

    counts = await asyncio.gather(*(consume(h) for h in handles))
    assert all(c == new_tokens for c in counts), counts


def measure(
    engine: Any, clock: PhaseClock, prompts: list[tuple[int, ...]], new_tokens: int, tag: str
) -> dict[str, float]:
    """One run of len(prompts) concurrent requests: median ms per full decode step and phase."""
    clock.steps = []
    clock.on = True
    p0 = time.process_time_ns()
    try:
        asyncio.run(_run(engine, prompts, new_tokens, tag))
    finally:
        clock.on = False
    process_ns = time.process_time_ns() - p0
    steps = [s for s in clock.steps if s["decode"] and s["seqs"] == len(prompts)]
    if not steps:
        raise RuntimeError("no decode step ran every request")
    for s in steps:
        s["other"] = s["step"] - sum(s[p] for p in PHASES)
        s["host"] = s["step"] - s["forward"] - s["sample"]
    keys = (*PHASES, "other", "step", "step_wall", "host")
    out = {k: statistics.median(s[k] for s in steps) / 1e6 for k in keys}
    rank_cpu = sum(s["step"] for s in clock.steps)
    out["loop_cpu_ms"] = (process_ns - rank_cpu) / len(clock.steps) / 1e6
    out["decode_steps"] = len(steps)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="random:tiny", help="random:<shape>, default or a folder")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--async-scheduling", action="store_true", help="overlap steps (the CUDA default)")
    parser.add_argument("--out", default="", help="default benchmarks/results/host-overhead-<class>.json")
    args = parser.parse_args(argv)
    from services.worker.engine import create_engine
    from services.worker.engine.api import EngineConfig
    from shared.model_store import resolve_model

    top = max(args.concurrency)
    engine = create_engine(
        EngineConfig(
            model_path=str(resolve_model(args.model)),
            kv_cache_tokens=top * (args.prompt_tokens + args.new_tokens + 32),
            max_num_seqs=top,
            torch_threads=args.threads,
            enable_prefix_caching=False,
            async_scheduling=args.async_scheduling,
        )
    )
    engine.start()
    rng = random.Random(0)
    top_id = min(int(getattr(engine, "vocab_size", 0)) or 49152, 40000)
    prompts = [tuple(rng.randrange(3, top_id) for _ in range(args.prompt_tokens)) for _ in range(top)]
    clock = PhaseClock()
    load_before = os.getloadavg()
    runs: dict[int, list[dict[str, float]]] = {n: [] for n in args.concurrency}
    try:
        with instrumented(clock):
            asyncio.run(_run(engine, prompts[:4], 8, "warm"))
            for r in range(args.repeats):
                for n in args.concurrency:
                    runs[n].append(measure(engine, clock, prompts[:n], args.new_tokens, f"n{n}r{r}"))
    finally:
        engine.shutdown()
    load_after = os.getloadavg()
    results = []
    for n, rs in runs.items():
        row: dict[str, Any] = {"concurrency": n}
        for key in rs[0]:
            if key != "decode_steps":
                name = key if key.endswith("_ms") else f"{key}_ms"
                row[name] = round(statistics.median(r[key] for r in rs), 3)
        row["host_ms_runs"] = [round(r["host"], 3) for r in rs]
        row["host_us_per_seq"] = round(row["host_ms"] * 1e3 / n, 1)
        results.append(row)
        print(
            f"n={n:3d} host {row['host_ms']:.3f} ms/step ({row['host_us_per_seq']} us/seq) | "
            + " ".join(f"{k} {row[f'{k}_ms']:.3f}" for k in (*PHASES, "other"))
            + f" | step {row['step_ms']:.3f} wall {row['step_wall_ms']:.3f} loop_cpu {row['loop_cpu_ms']:.3f}"
        )
    doc = {
        "command": "python -m benchmarks.host_overhead " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": {
            **cpu_features(),
            "class": machine_class("cpu"),
            "load_average": [load_before, load_after],
        },
        "model": args.model,
        "workload": {k: getattr(args, k) for k in WORKLOAD},
        "results": results,
    }
    out = Path(args.out) if args.out else result_path("host-overhead")
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
