"""benchmarks/result_names.py: the machine class a result file is named after."""

from __future__ import annotations

from benchmarks.result_names import RESULTS, cpu_class, cpu_flags, gpu_tag, result_path

CPUINFO = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse avx2 avx512f avx512bw\n"


def test_cpu_class_follows_torch_capability_and_names_forced_avx2_emulated() -> None:
    flags = cpu_flags(CPUINFO)
    assert {"avx2", "avx512f"} <= flags and cpu_flags("processor\t: 0\n") == set()
    assert cpu_class("AVX512", flags) == "cpu-avx512"
    assert cpu_class("AVX2", flags) == "cpu-avx2-emulated"  # ATEN_CPU_CAPABILITY=avx2 on AVX-512
    assert cpu_class("AVX2", {"avx2"}) == "cpu-avx2"
    assert gpu_tag("NVIDIA H200") == "h200" and gpu_tag("NVIDIA A100-SXM4-80GB") == "a100-sxm4-80gb"


def test_result_path_on_this_cpu() -> None:
    path = result_path("engine", "cpu", quick=True)
    assert path.parent == RESULTS and path.name.startswith("engine-cpu-")
    assert path.name.endswith("-quick.json")
