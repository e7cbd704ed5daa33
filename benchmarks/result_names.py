"""Where a benchmark's result goes by default: `benchmarks/results/<benchmark>-<machine class>.json`,
one current file per benchmark and machine class (benchmarks/results/README.md indexes them).

The machine class is `cpu-<capability>` from torch's CPU capability (`cpu-avx512`, `cpu-avx2`;
`cpu-avx2-emulated` where AVX2 kernels are forced, `ATEN_CPU_CAPABILITY=avx2`, on a CPU that has
AVX-512) or `cuda-<gpu>` on a GPU ("NVIDIA H200" -> `cuda-h200`). torch is imported only when a
name is asked for, and CUDA is touched only for a CUDA device.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def gpu_tag(name: str) -> str:
    """A GPU's name as result files carry it: "NVIDIA H200" -> "h200" (as scripts/gpu_checks.sh)."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower().replace("nvidia", "")).strip("-")


def cpu_flags(cpuinfo: str) -> set[str]:
    """The ISA flags of the first processor in a /proc/cpuinfo text (empty if it has none)."""
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def cpu_class(capability: str, flags: set[str]) -> str:
    """`cpu-avx512` / `cpu-avx2` from torch's capability string; AVX2 on an AVX-512 CPU is emulated."""
    cap = capability.lower()
    if cap == "avx2" and "avx512f" in flags:
        return "cpu-avx2-emulated"
    return f"cpu-{cap}"


def machine_class(device: str) -> str:
    """This machine's class for a run on `device` ("cpu", "cuda", "cuda:1")."""
    import torch

    if device.startswith("cuda"):
        return f"cuda-{gpu_tag(torch.cuda.get_device_name(device))}"
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: the capability alone names the class
        cpuinfo = ""
    return cpu_class(torch.backends.cpu.get_cpu_capability(), cpu_flags(cpuinfo))


def result_path(benchmark: str, device: str = "cpu", quick: bool = False) -> Path:
    """The default result file of `benchmark` run on `device` here (`-quick` for a harness check)."""
    return RESULTS / f"{benchmark}-{machine_class(device)}{'-quick' if quick else ''}.json"


def describe_machine(device: str) -> dict[str, Any]:
    """What a result file records of the machine a run on `device` used: the CPU's features and
    torch (engine_floor.cpu_features), the class, and the GPU's name on CUDA."""
    import torch

    from benchmarks.engine_floor import cpu_features

    machine: dict[str, Any] = {**cpu_features(), "class": machine_class(device)}
    if device.startswith("cuda"):
        machine["gpu"] = torch.cuda.get_device_name(device)
    return machine
