"""A rank's model backend: the one forward path chosen at start (`ModelBackend.choose`) from the
backend flags and the device, with the options that path owns.

- TRANSFORMERS: transformers' module tree with the paged attention (--no-lean-forward).
- LEAN_CPU: the flat Llama loop of lean_llama.py on a CPU (same numbers, about half the ops).
- LEAN_CUDA: the flat loop on CUDA: decode steps padded to static shapes and replayed as CUDA
  graphs (decode_graphs.py), attention reading the pool in place through FlexAttention with
  fused, compiled layers (flex_paged.py), or the torch-only eager path without them.

On a CPU either forward runs the linear layers prepacked for oneDNN, with a row copy for steps
of few rows (cpu_linear.py), and decode attention in one C++ kernel call (cpu_kernels.py):
`CpuOptions`. A model the lean loop does not cover runs transformers' forward with the same
options (ModelRunner). The flags themselves (`BackendOptions`) are part of the engine's config
and of the worker's settings, which embed them (their names and defaults are the CLI's).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from services.worker.engine import flex_paged
from services.worker.engine.options import BackendOptions


class ForwardPath(enum.Enum):
    TRANSFORMERS = "transformers"
    LEAN_CPU = "lean-cpu"
    LEAN_CUDA = "lean-cuda"


@dataclass(frozen=True)
class CpuOptions:
    """What a forward on a CPU uses (each where it applies: see cpu_linear, cpu_kernels)."""

    prepack: bool = False  # linear weights prepacked for oneDNN (at load)
    row_copy: bool = False  # with prepack: the panel copy for steps of up to 16 rows (at load)
    attention_kernel: bool = False  # decode attention in one C++ kernel call per layer


@dataclass(frozen=True)
class CudaOptions:
    """What the lean forward on CUDA uses."""

    # decode and verify steps padded to static shapes (decode_graphs.py): captured as CUDA
    # graphs on CUDA, run eagerly elsewhere (tests)
    graphs: bool = False
    # FlexAttention in place and fused, compiled layers (tests: True runs them eagerly on CPU)
    kernels: bool = False


@dataclass(frozen=True)
class ModelBackend:
    """One rank's forward path and the options it owns."""

    path: ForwardPath
    cpu: CpuOptions = CpuOptions()
    cuda: CudaOptions = CudaOptions()

    @classmethod
    def choose(cls, options: BackendOptions, device: torch.device) -> ModelBackend:
        """The backend the flags select on `device` (the target's and the draft model's)."""
        if device.type == "cuda":
            if not options.lean_forward:
                return cls(ForwardPath.TRANSFORMERS)
            kernels = options.cuda_kernels and flex_paged.available()
            return cls(ForwardPath.LEAN_CUDA, cuda=CudaOptions(graphs=options.cuda_graphs, kernels=kernels))
        cpu = CpuOptions(options.cpu_prepack, options.cpu_row_copy, options.cpu_attention_kernel)
        return cls(ForwardPath.LEAN_CPU if options.lean_forward else ForwardPath.TRANSFORMERS, cpu=cpu)

    @property
    def lean(self) -> bool:
        return self.path is not ForwardPath.TRANSFORMERS

    def without_graphs(self) -> ModelBackend:
        """The same forward with every step eager (the start-up memory probe)."""
        return ModelBackend(self.path, self.cpu, CudaOptions(graphs=False, kernels=self.cuda.kernels))
