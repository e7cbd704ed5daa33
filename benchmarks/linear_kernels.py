"""Which fp32 kernel streams a decode step's weights fastest on this CPU (issue 15).

A decode step on CPU is ~86 % linear layers (benchmarks/step_profile.py), so its distance from
the memory floor is mostly the linear kernels' weight-streaming rate. This probe runs the
linears of a SmolLM2-shaped stack (hidden 576, MLP 1536, KV 192, 30 layers: 425 MB of distinct
fp32 weights, so they come from DRAM and not from cache) over `rows` input rows (= sequences in
a decode step) with one torch thread, through each kernel:

- `onednn_packed`: oneDNN's linear on weights reordered once (`mkldnn._linear_pointwise`),
  what the engine runs (engine/cpu_linear.py);
- `torch_linear`: plain `F.linear` on the nn.Linear weights (MKL sgemm);
- `inductor_cpp`: torch.compile with inductor's C++ GEMM template (max-autotune, CPP backend,
  frozen weights), when a C++ compiler is present;
- `panel_kernel`: engine/cpu_kernels.py on weights as 16-feature panels, what the engine
  runs for steps of up to 16 rows (fp32, with the row copy on).

It prints and records ms per pass, GB/s of weights read, and the largest difference from the
oneDNN outputs, next to the machine's single-core read bandwidth (a tensor sum).

    python -m benchmarks.linear_kernels [--rows 1 8] [--layers 30] [--out F]
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F

from benchmarks.engine_floor import cpu_features, read_bandwidth

HIDDEN, MLP, KV = 576, 1536, 192  # SmolLM2-135M


def _rows_for(in_features: int, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """The input a linear of `in_features` reads: `x` (hidden-wide rows) or `h` (the MLP's
    down projection's intermediate-wide rows)."""
    return x if in_features == x.shape[1] else h


class Stack(torch.nn.Module):
    """Every linear of `layers` layers applied to its input width's rows; returns each output's
    sum (so nothing is dead code and the outputs stay small to compare)."""

    def __init__(self, layers: int, hidden: int = HIDDEN, mlp: int = MLP, kv: int = KV) -> None:
        super().__init__()
        # (out_features, in_features) of one layer's linears: q, k, v, o, gate, up, down
        shapes = (
            (hidden, hidden),
            (kv, hidden),
            (kv, hidden),
            (hidden, hidden),
            (mlp, hidden),
            (mlp, hidden),
            (hidden, mlp),
        )
        self.lins = torch.nn.ModuleList(
            torch.nn.Linear(k, n, bias=False) for _ in range(layers) for n, k in shapes
        )
        gen = torch.Generator().manual_seed(0)
        for lin in self.linears():
            lin.weight.data = torch.randn(lin.weight.shape, generator=gen) * 0.02
        self.eval().requires_grad_(False)

    def linears(self) -> list[torch.nn.Linear]:
        return [cast(torch.nn.Linear, m) for m in self.lins]

    def weight_bytes(self) -> int:
        return sum(lin.weight.numel() * lin.weight.element_size() for lin in self.linears())

    def forward(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return torch.stack([lin(_rows_for(lin.in_features, x, h)).sum() for lin in self.linears()])


def onednn_packed(stack: Stack) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    ops = torch.ops.mkldnn
    if not (torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")):
        return None
    packed = [(ops._reorder_linear_weight(lin.weight, 16), lin.in_features) for lin in stack.linears()]

    def run(x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return torch.stack(
            [ops._linear_pointwise(_rows_for(k, x, h), w, None, "none", [], "").sum() for w, k in packed]
        )

    return run


def torch_linear(stack: Stack) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    weights = [lin.weight for lin in stack.linears()]

    def run(x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return torch.stack([F.linear(_rows_for(w.shape[1], x, h), w).sum() for w in weights])

    return run


def inductor_cpp(stack: Stack) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    if shutil.which("g++") is None and shutil.which("c++") is None:
        return None  # inductor's CPU backend compiles C++
    import torch._inductor.config as inductor

    compiled = torch.compile(stack, dynamic=False)
    # compilation happens at a new shape's first call, so every call runs under the settings;
    # patched, not set, so nothing else in the process compiles with them
    settings = inductor.patch(
        freezing=True,  # weights become constants the template prepacks
        max_autotune=True,
        max_autotune_gemm_backends="CPP",
    )

    def run(x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        with settings:
            return cast(torch.Tensor, compiled(x, h))

    return run


def panel_kernel(stack: Stack) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    from services.worker.engine import cpu_kernels

    if not cpu_kernels.available():
        return None  # no compiler, or no AVX2
    linears = list(stack.linears())
    if not all(cpu_kernels.panel_copy_applies(lin.weight) for lin in linears):
        return None
    # in one buffer on huge pages, as cpu_linear.prepack_linears keeps them
    arena = cpu_kernels.empty_on_huge_pages((sum(lin.weight.numel() for lin in linears),), torch.float32)
    panels = []
    offset = 0
    for lin in linears:
        n = lin.weight.numel()
        p = cpu_kernels.panels_of(lin.weight, arena[offset : offset + n])
        assert p is not None
        offset += n
        panels.append((p, lin.in_features))

    def run(x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return torch.stack([cpu_kernels.panel_mm(_rows_for(k, x, h), p).sum() for p, k in panels])

    return run


CONTENDERS: dict[str, Callable[[Stack], Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None]] = {
    "panel_kernel": panel_kernel,
    "onednn_packed": onednn_packed,
    "torch_linear": torch_linear,
    "inductor_cpp": inductor_cpp,
}


def time_pass(
    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x: torch.Tensor, h: torch.Tensor, reps: int
) -> float:
    """Median seconds of one pass over every weight (after warm-up passes)."""
    for _ in range(2):
        fn(x, h)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(x, h)
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def measure(
    rows: Sequence[int],
    layers: int,
    reps: int = 15,
    contenders: Sequence[str] = tuple(CONTENDERS),
    stack: Stack | None = None,
) -> dict[str, Any]:
    """Per row count and contender: ms per pass, GB/s of weights, max |difference| from the
    reference (oneDNN when available, else F.linear) and the first-call (compile) seconds."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one rank's thread; restored on return
    try:
        return _measure(rows, layers, reps, contenders, stack or Stack(layers))
    finally:
        torch.set_num_threads(threads)


def _measure(
    rows: Sequence[int], layers: int, reps: int, contenders: Sequence[str], stack: Stack
) -> dict[str, Any]:
    nbytes = stack.weight_bytes()
    out: dict[str, Any] = {"weight_mb": round(nbytes / 1e6, 1), "layers": layers, "threads": 1, "rows": {}}
    with torch.no_grad():
        fns = {name: CONTENDERS[name](stack) for name in contenders}
        ref_fn = fns.get("onednn_packed") or torch_linear(stack)
        gen = torch.Generator().manual_seed(1)
        for r in rows:
            x = torch.randn(r, stack.linears()[0].in_features, generator=gen)
            h = torch.randn(r, stack.linears()[-1].in_features, generator=gen)
            ref = ref_fn(x, h)
            row: dict[str, Any] = {}
            for name, fn in fns.items():
                if fn is None:
                    row[name] = {"skipped": "not available on this machine"}
                    continue
                t0 = time.perf_counter()
                got = fn(x, h)
                first = time.perf_counter() - t0
                s = time_pass(fn, x, h, reps)
                row[name] = {
                    "ms": round(s * 1e3, 2),
                    "gb_s": round(nbytes / s / 1e9, 2),
                    "max_abs_diff": float((got - ref).abs().max()),
                    "first_call_s": round(first, 2),
                }
            out["rows"][str(r)] = row
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    doc: dict[str, Any] = {
        "cpu": cpu_features(),
        "single_core_read_gb_s": round(read_bandwidth(1) / 1e9, 2),
        "single_core_read_huge_pages_gb_s": round(read_bandwidth(1, huge_pages=True) / 1e9, 2),
    }
    doc.update(measure(a.rows, a.layers, a.reps, a.contenders.split(",")))
    print(
        f"{doc['cpu']['model']} ({doc['cpu']['torch_cpu_capability']}), torch {doc['cpu']['torch']}, 1 thread"
    )
    print(
        f"single-core read bandwidth {doc['single_core_read_gb_s']} GB/s "
        f"({doc['single_core_read_huge_pages_gb_s']} GB/s on huge pages); "
        f"{doc['weight_mb']} MB of weights per pass"
    )
    for r, row in doc["rows"].items():
        for name, m in row.items():
            if "skipped" in m:
                print(f"  rows {r:>3s}  {name:14s} skipped: {m['skipped']}")
            else:
                print(
                    f"  rows {r:>3s}  {name:14s} {m['ms']:8.1f} ms  {m['gb_s']:5.1f} GB/s  "
                    f"max |diff| {m['max_abs_diff']:.1e}  first call {m['first_call_s']:.1f} s"
                )
    if a.out:
        Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
