"""Linear layers with oneDNN-prepacked weights for CPU ranks.

Why: torch's CPU `F.linear` goes to MKL sgemm, which packs the weight's panels inside every
call. At serving batch sizes (a few to a few dozen rows) that is most of the cost: on the 2-core
EPYC the benchmarks run on, SmolLM2's 30 layers at 8 rows took ~58 ms with MKL and ~36 ms with
weights packed once for oneDNN; the LM head (49,152 x 576) ~22 ms vs ~8 ms; prefill chunks of
512-2048 rows were 15-30 % faster too. End to end: `make bench-engine` 64.6 -> 81.5 tokens/s.

`prepack_linears(model)` swaps every `nn.Linear` in a loaded model for a `PackedLinear` that
holds the packed weight (the same numbers in oneDNN's blocked layout; results differ from MKL's
only by float rounding, ~1e-6 relative). The model classes stay transformers' own: only the leaf
modules change. Ops used are the ones torch's inductor uses for the same job
(`torch.ops.mkldnn._reorder_linear_weight` / `_linear_pointwise`); when they are missing the
model is left as it is.

Steps of up to 16 rows (decoding up to 16 sequences) read every weight once for few
multiply-adds, and oneDNN's packed kernel streams weights at ~12-14 GB/s there on one core of that
EPYC (a plain sum reads 27 GB/s, 34 on huge pages). So with `row_copy` a PackedLinear also holds
its weight as panels of 16 output features (`[N/16, K, 16]`, all of a model's in one buffer on
huge pages) and runs such steps on engine/cpu_kernels.py's kernel: SmolLM2's 30 layers took
18.8 / 33.2 ms at 8 / 16 rows against oneDNN's 36.2 / 48.0. (Before it, the copy was
`[N/32, K, 32]` blocks through `torch.matmul`, faster than oneDNN at 1-2 rows only; it remains
the copy where the kernel cannot be built, e.g. without a C++ compiler.) The cost is a second
copy of every linear weight in memory. Both forwards (transformers' modules and
engine/lean_llama.py) go through `linear` / `linear_add` / `linear_mul` here, so they stay
bit-identical to each other, and a row's result from the panel kernel does not depend on the
other rows of its step.

Memory: oneDNN keeps a compiled kernel for every input shape it has seen, in two caches (oneDNN's
primitive cache and ideep's LRU, 1,024 entries each by default), ~0.3 MiB per entry. Decode steps
see a few row counts; prefill chunks see a new one for almost every prompt length, so a prefill
worker's RSS grew by ~5 MiB a minute for hours (the 30-minute soak: +7.3 %) until both caches held
1,024 entries (~600 MiB). `bound_kernel_caches` caps them before the first kernel is built; a
miss costs ~0.3 ms per distinct weight shape (5 in SmolLM2) per step.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from services.worker.engine import cpu_kernels

log = logging.getLogger(__name__)

# Row count the packed layout is tuned for. 16 measured best over 1..2048 rows on this CPU.
_PACK_BATCH_HINT = 16
# The row copy: panels for cpu_kernels, serving steps of up to cpu_kernels.MAX_ROWS
# rows; where that kernel cannot be built, [N/32, K, 32] blocks through torch.matmul, faster
# than oneDNN for steps of up to _MATMUL_MAX_ROWS rows only
_MATMUL_BLOCK = 32
_MATMUL_MAX_ROWS = 2
_PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


# Environment variables oneDNN and ideep read once, when their first kernel is built.
_KERNEL_CACHE_VARS = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def bound_kernel_caches(capacity: int) -> None:
    """Cap oneDNN's and ideep's kernel caches at `capacity` entries each (0 = no cache).

    Takes effect only if called before the process builds its first oneDNN kernel (both
    libraries read the setting once); the engine calls it before loading any model."""
    if capacity < 0:
        raise ValueError(f"kernel cache capacity must be >= 0, got {capacity}")
    for var in _KERNEL_CACHE_VARS:
        os.environ[var] = str(capacity)


def prepack_available(device: torch.device, dtype: torch.dtype) -> bool:
    ops = torch.ops.mkldnn
    if not (
        device.type == "cpu"
        and dtype in _PACKABLE_DTYPES
        and torch.backends.mkldnn.is_available()
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
    ):
        return False
    # oneDNN's bf16 kernels need CPU support (AVX-512 BF16/BW or AVX-NE-CONVERT)
    return dtype != torch.bfloat16 or bool(ops._is_mkldnn_bf16_supported())


def row_copy_of(weight: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor | None:
    """W [N, K] as panels [N/16, K, 16] for the panel kernel (in `into` when given: see
    `cpu_kernels.panels_of`); without the kernel as [N/32, K, 32] blocks for torch.matmul; None
    where neither applies (not fp32, N not a multiple of 16 / 32)."""
    panels = cpu_kernels.panels_of(weight, into)
    if panels is not None:
        return panels
    n, k = weight.shape
    if weight.dtype != torch.float32 or n % _MATMUL_BLOCK:
        return None
    return weight.detach().view(n // _MATMUL_BLOCK, _MATMUL_BLOCK, k).transpose(1, 2).contiguous()


def row_copy_max_rows(row_weight: torch.Tensor) -> int:
    """The largest step (rows) this row copy serves."""
    return cpu_kernels.MAX_ROWS if row_weight.shape[-1] == cpu_kernels.PANEL else _MATMUL_MAX_ROWS


def _by_rows(x: torch.Tensor, row_weight: torch.Tensor | None) -> torch.Tensor | None:
    """x W^T from the row copy for a step of few rows (x [M, K]), else None."""
    if row_weight is None or x.shape[0] > row_copy_max_rows(row_weight):
        return None
    if row_weight.shape[-1] == cpu_kernels.PANEL:
        return cpu_kernels.panel_mm(x, row_weight)
    # [M, K] x [N/32, K, 32] -> [N/32, M, 32] -> [M, N]
    return torch.matmul(x, row_weight).transpose(0, 1).reshape(x.shape[0], -1)


def linear(
    x: torch.Tensor, packed: torch.Tensor, row_weight: torch.Tensor | None, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x W^T (+ b) for x [M, K]."""
    out = _by_rows(x, row_weight)
    if out is None:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return out if bias is None else out + bias


def linear_add(
    x: torch.Tensor, residual: torch.Tensor, packed: torch.Tensor, row_weight: torch.Tensor | None
) -> torch.Tensor:
    """residual + x W^T (no bias): oneDNN's fused post-op adds the finished fp32 accumulator,
    the same single rounding as the separate add of the row path."""
    out = _by_rows(x, row_weight)
    if out is None:
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, packed, None, "add")
    return residual + out


def linear_mul(
    x: torch.Tensor, other: torch.Tensor, packed: torch.Tensor, row_weight: torch.Tensor | None
) -> torch.Tensor:
    """other * x W^T (no bias)."""
    out = _by_rows(x, row_weight)
    if out is None:
        return torch.ops.mkldnn._linear_pointwise.binary(x, other, packed, None, "mul")
    return other * out


class PackedLinear(torch.nn.Module):
    """y = x W^T + b with W held in oneDNN's packed layout, and with `row_copy` also as panels
    for few-row steps (`row_copy_max_rows`; inference only)."""

    packed_weight: torch.Tensor
    row_weight: torch.Tensor | None
    bias: torch.Tensor | None

    def __init__(
        self, linear: torch.nn.Linear, row_copy: bool = False, row_into: torch.Tensor | None = None
    ) -> None:
        """row_into: where the panel copy goes (a slice of prepack_linears' shared buffer)."""
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach()
        # buffers, not parameters: never trained, and state_dict tools must not mistake them
        # for the checkpoint's weight
        self.register_buffer(
            "packed_weight",
            torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_BATCH_HINT),
            persistent=False,
        )
        self.register_buffer(
            "row_weight", row_copy_of(weight, row_into) if row_copy else None, persistent=False
        )
        bias = linear.bias.detach() if linear.bias is not None else None
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).contiguous()
        out = linear(rows, self.packed_weight, self.row_weight, self.bias)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        rw = self.row_weight
        rows = f", row copy for <= {row_copy_max_rows(rw)} rows" if rw is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=onednn{rows}"


def prepack_linears(model: Any, row_copy: bool = False) -> int:
    """Replace every nn.Linear of `model` (on CPU, fp32/bf16) in place; returns how many.
    row_copy: each also keeps its weight as panels for few-row steps (fp32; see the module
    docstring)."""
    first = next(model.parameters())
    if not prepack_available(first.device, first.dtype):
        return 0
    # names only: holding the old modules would keep every unpacked weight alive until the end
    names = [name for name, mod in model.named_modules() if type(mod) is torch.nn.Linear]
    # every panel copy in one buffer on huge pages (cpu_kernels.empty_on_huge_pages): one
    # allocation rounds up to 2 MiB once, where one per weight would for every small weight
    sizes = {
        name: model.get_submodule(name).weight.numel()
        for name in names
        if row_copy and cpu_kernels.panel_copy_applies(model.get_submodule(name).weight)
    }
    arena = cpu_kernels.empty_on_huge_pages((sum(sizes.values()),), torch.float32) if sizes else None
    offset = 0
    for name in names:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        into = None
        if arena is not None and name in sizes:
            into = arena[offset : offset + sizes[name]]
            offset += sizes[name]
        setattr(parent, attr, PackedLinear(getattr(parent, attr), row_copy, into))
    # The remaining tensors (embedding, norms) may still be views of the checkpoint's memory
    # map, which would keep every original weight page mapped (and counted in RSS) next to the
    # packed copies: give them memory of their own so the map is released.
    with torch.no_grad():
        for param in model.parameters():
            param.data = param.data.clone()
    log.debug("prepacked %d linear layers for oneDNN", len(names))
    return len(names)
