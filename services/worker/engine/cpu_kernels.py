"""C++ kernels for CPU decode steps (fp32), built once per machine.

`panel_mm`: a small-batch matrix product, x [M, K] times a weight held as panels of 16 output
features (`[N/16, K, 16]`, each panel one contiguous K x 16 block), M <= 64 (the engine: <= 16).

Why: a decode step of a few sequences multiplies a few rows by every weight of the model once.
oneDNN's packed kernel streams those weights at ~12-14 GB/s on one core of the project's 2-core
AMD EPYC (AVX-512), half of what the core can read (~27 GB/s), and at 8 rows reaches ~50 GFLOP/s.
This kernel keeps a tile of rows x 32 outputs in registers (AVX-512: 8 x 2 zmm; AVX2: 4 x 2 ymm)
and streams two panels at a time, one fused multiply-add per weight vector and row; where a step
needs several row tiles, the tiles together prefetch the next panels at the rate they consume
them, so memory keeps streaming while the core computes from cache (`panels`). Over SmolLM2's
30 layers on one core (weights on huge pages, `empty_on_huge_pages`) it took 18.8 / 33.2 ms at
8 / 16 rows against oneDNN's 36.2 / 48.0 with AVX-512, and 18.8 / 35.1 against 50.6 / 66.0 with
AVX2 kernels (`python -m benchmarks.linear_kernels` compares them: the `panel_kernel`
contender). It stays ahead of oneDNN up to 64 rows there; the engine uses it up to MAX_ROWS.

Numerics of panel_mm: every output is x[m, 0] w[0] + ... + x[m, K-1] w[K-1] accumulated in that order with one
rounding per fused multiply-add, whatever M, the row's position in the step, the tile or the
instruction set (AVX-512 and AVX2 give the same bits): a row's result does not depend on the
batch it runs in.

`decode_attention`: one layer's attention for every decoding sequence of a step in one call
(from each sequence's first visible key: a sliding window's start, 0 without one),
each sequence's KV blocks read in place through its block table (consecutive, scattered or
shared with other sequences by the prefix cache alike), instead of one SDPA call per sequence:
scores a K row at a time for up to 4 query heads (their horizontal sums in one reduction tree),
torch's softmax, then the probability-weighted V rows (AVX-512: the outputs held in registers
over a block's rows). While it reads a block it asks for the sequence's next one, a row per
token (blocks lie anywhere in the pool, where the hardware prefetcher does not follow). 8
sequences of 319 tokens over 30 layers (SmolLM2's shapes, one core, pools on huge pages;
`python -m benchmarks.attention_kernel`, `attention-kernel-cpu-avx512.json`): 7.4 ms (AVX-512) /
7.8 ms (AVX2) with consecutive blocks, 13.7 / 12.2 with shuffled ones, 4.6 / 6.5 from cache,
against 20.7 / 30.4 / 15.3 for SDPA per sequence (the path without the kernel); before the
prefetch the kernel took 8.3 / 16.0 (AVX-512, consecutive / shuffled). Its results are not
bit-equal across instruction sets (the dot products' reduction trees differ), only close (1e-6).

The C++ is built once per machine with torch's JIT extension builder (g++ and ninja; ~25 s),
cached on disk (torch's extension directory), and loaded in ~0.1 s by later processes. The ISA is
picked at run time (`__builtin_cpu_supports`, and AVX2 where torch's CPU capability is AVX2), so
one cached build serves AVX2 and AVX-512 hosts. The container image compiles it in its build
stage (`python -m services.worker.engine.cpu_kernels --prebuild`, into PREBUILT_DIR inside the
installed package), and its runtime, which has no compiler and a read-only root, loads that build.
Without a compiler or a prebuilt module, or on a CPU without AVX2 + FMA, `available()` is False
and callers keep their other kernels.

`empty_on_huge_pages`: the engine's big CPU buffers (the panel copies, the KV pool) on 2 MiB
transparent huge pages.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import math
import os
import threading
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

PANEL = 16  # output features per panel (floats)
# rows per call the engine gives the kernel (larger steps: oneDNN). 16: 27-47 % faster than
# oneDNN at 16 rows on both ISAs of the EPYC (notes above); beyond it fewer steps gain
MAX_ROWS = 16

# instruction sets `panel_mm(isa=...)` accepts (0: the best this CPU has)
ISA_AUTO, ISA_AVX2, ISA_AVX512 = 0, 1, 2

# The kernels' C++ (with its Python bindings): csrc/cpu_kernels.cpp beside this module.
SOURCE = Path(__file__).with_name("csrc") / "cpu_kernels.cpp"

_lock = threading.Lock()
_module: Any = None
_tried = False
_isa = ISA_AVX2  # the ISA panel_mm uses by default (set when the module loads)


# Where an image keeps the kernels it built at build time (`prebuild`; the runtime image has no
# compiler and a read-only root filesystem). The name carries a hash of the source, so a build
# of other source is never loaded.
PREBUILT_DIR = Path(__file__).with_name("_prebuilt_kernels")
_NAME = "pdserve_cpu_kernels_" + hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
CFLAGS = ["-O3", "-Wall", "-Wextra"]
# Built with warnings as errors first; a compiler that warns where CI's does not (a newer g++)
# still gets the kernels, built again without -Werror and logged, and `built_strict()` says so
# (a CI test requires the strict build on CI's compiler).
_strict: bool | None = None


def _compile(build_directory: str | None = None) -> Any:
    global _strict
    from torch.utils import cpp_extension

    try:  # torch's builder runs `ninja` from PATH; the pip package puts it next to Python
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        pass

    def build(flags: list[str]) -> Any:
        return cpp_extension.load(
            name=_NAME,
            sources=[str(SOURCE)],
            extra_cflags=flags,
            build_directory=build_directory,
            verbose=False,
        )

    try:
        mod = build([*CFLAGS, "-Werror"])
        _strict = True
        return mod
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        log.warning("CPU kernels: the build with -Werror failed (%s); building without it", first)
    _strict = False
    return build(CFLAGS)


def built_strict() -> bool | None:
    """Whether this process compiled the kernels with -Werror (None: it compiled nothing, e.g.
    it loaded a prebuilt module or has no compiler)."""
    return _strict


def _build() -> Any:
    """The prebuilt module where there is one (loaded as it is: nothing written), else torch's
    JIT build (compiled once per machine into torch's extension directory)."""
    prebuilt = PREBUILT_DIR / f"{_NAME}.so"
    if prebuilt.is_file():
        spec = importlib.util.spec_from_file_location(_NAME, prebuilt)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    return _compile()


def prebuild(directory: Path = PREBUILT_DIR) -> Path:
    """Compile the kernels into `directory` (the image build does, where g++ is installed), for
    `_build` to load without a compiler; returns the module's path."""
    directory.mkdir(parents=True, exist_ok=True)
    _compile(str(directory))
    if not _strict:  # the image's compiler is CI's: a warning there is a defect to fix
        raise RuntimeError("the CPU kernels built only without -Werror (see the warnings above)")
    return directory / f"{_NAME}.so"


def _load() -> Any:
    """The built extension, or None when it cannot be built here (logged once)."""
    global _module, _tried, _isa
    with _lock:
        if not _tried:
            _tried = True
            try:
                mod = _build()
                _module = mod if mod.has_avx2() else None
                if _module is None:
                    log.info("CPU kernels: this CPU has no AVX2 + FMA; decode steps use the fallbacks")
                # AVX-512 where torch uses it too: ATEN_CPU_CAPABILITY=avx2 (which makes an
                # AVX-512 host take an AVX2 machine's code path) applies to this kernel as well
                elif mod.has_avx512() and "AVX512" in torch.backends.cpu.get_cpu_capability():
                    _isa = ISA_AVX512
            except Exception as exc:  # no compiler, no headers: the engine still runs
                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                log.warning("CPU kernels unavailable (%s); decode steps use the fallbacks", first)
        return _module


def available() -> bool:
    """Whether the kernel can run in this process (builds or loads it on first call)."""
    return _load() is not None


def has_avx512() -> bool:
    """Whether the CPU has AVX-512 (whatever torch's capability setting)."""
    mod = _load()
    return bool(mod is not None and mod.has_avx512())


def panel_copy_applies(weight: torch.Tensor) -> bool:
    """Whether `panels_of` makes panels of this [N, K] weight (fp32 on CPU, N a multiple of 16,
    the kernel available)."""
    return (
        weight.dtype == torch.float32
        and weight.shape[0] % PANEL == 0
        and weight.device.type == "cpu"
        and available()
    )


def panels_of(weight: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor | None:
    """W [N, K] as [N/16, K, 16] (panel j: output features 16j..16j+15, K-major), or None where the
    kernel does not apply (`panel_copy_applies`). into: N x K contiguous fp32 elements to hold
    them (a slice of a shared buffer), else new memory."""
    if not panel_copy_applies(weight):
        return None
    n, k = weight.shape
    src = weight.detach().view(n // PANEL, PANEL, k).transpose(1, 2)
    if into is None:
        return src.contiguous()
    return into.view(n // PANEL, k, PANEL).copy_(src)


def empty_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized CPU tensor whose memory is 2 MiB-aligned and advised for transparent huge
    pages, or torch.empty's where the kernels are not built.

    Why: a decode step streams every weight and its sequences' KV once; on 4 KiB pages that walk
    misses the TLB every 4 KiB. On the 2-core EPYC a one-core sum read 26.5 GB/s from torch's
    memory and 33.7 GB/s from huge pages, and the panel product over SmolLM2's layers got ~20 %
    faster. (torch itself does this for every large allocation with THP_MEM_ALLOC_ENABLE=1, a
    process-wide switch read once at start-up; this is for the engine's big buffers only.)"""
    numel = math.prod(shape)
    mod = _load()
    if mod is None:
        return torch.empty(shape, dtype=dtype)
    return mod.huge_empty(numel * dtype.itemsize).view(dtype).view(shape)


def decode_attention(
    q: torch.Tensor,  # [B, H, R, D]: each sequence's query token, R query heads per KV head
    k: torch.Tensor,  # [H, S, D]: the layer's K pool (S slots = blocks x block_size)
    v: torch.Tensor,  # [H, S, D]
    blocks: torch.Tensor,  # [B, max blocks] int64: each sequence's block table (padding unread)
    lens: torch.Tensor,  # [B] int64: its context length (tokens)
    block_size: int,  # tokens per block
    scale: float,
    isa: int | None = None,
    starts: torch.Tensor | None = None,  # [B] int64: its first visible key (a sliding window)
) -> torch.Tensor:
    """One layer's decode attention for every sequence in one call, reading each sequence's
    blocks in place -> [B, H, R, D] (fp32, D a multiple of 16). Sequence b attends to its keys
    starts[b] .. lens[b] - 1 (all of them without `starts`); blocks wholly before its first key
    are not read."""
    mod = _load()
    assert mod is not None, "decode_attention without the kernels (check available() first)"
    chosen = _isa if isa is None else isa
    first = _NO_STARTS if starts is None else starts.contiguous()
    return mod.decode_attention(q.contiguous(), k, v, blocks, lens, first, block_size, scale, chosen)


_NO_STARTS = torch.empty(0, dtype=torch.int64)  # decode_attention: every sequence from key 0


def panel_mm(
    x: torch.Tensor, panels: torch.Tensor, isa: int | None = None, prefetch: bool | None = None
) -> torch.Tensor:
    """x [M, K] times the panelled weight -> [M, N] (= x W^T), fp32, M <= 64; isa: unless given,
    AVX-512 where the CPU has it and torch's CPU capability includes it, else AVX2 (ISA_AUTO: the
    best the CPU has); prefetch: unless given, from the row count (same results either way)."""
    mod = _load()
    assert mod is not None, "panel_mm without the kernel (check available() first)"
    pf = -1 if prefetch is None else int(prefetch)
    return mod.panel_mm(x.contiguous(), panels, _isa if isa is None else isa, pf)


if __name__ == "__main__":  # python -m services.worker.engine.cpu_kernels --prebuild (the image)
    import sys

    if sys.argv[1:] != ["--prebuild"]:
        sys.exit("usage: python -m services.worker.engine.cpu_kernels --prebuild")
    print(prebuild())
