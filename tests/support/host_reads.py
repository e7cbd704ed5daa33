"""A guard for "little host time per step" (issue 31, item 4): during a step, our code
(modules under `services.`) may read a tensor's values on the host only through `.tolist()`, and
may never build a device tensor from a host list. On CUDA each of those waits for every queued
kernel (`.item()`, `bool()`, `.nonzero()`, and `torch.tensor(..., device=...)`, a copy from
pageable memory); on CPU the same calls are cheap, so the guard fails them outright to catch
them in CI, where no GPU runs."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch


def _caller(depth: int) -> str:
    return str(sys._getframe(depth + 1).f_globals.get("__name__", ""))


def _ours() -> bool:
    """Whether the caller of the guarded call is our code (two frames up: the guard's wrapper)."""
    return _caller(2).startswith("services.")


@contextmanager
def host_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Yields the sizes of the `.tolist()` reads made inside; torch's own reads (FlexAttention's
    CPU reference, compiled away on CUDA) are allowed, as they depend on what earlier tests left
    in dynamo's caches."""
    reads: list[int] = []
    real_tolist, real_tensor = torch.Tensor.tolist, torch.tensor

    def tolist(t: torch.Tensor) -> Any:
        reads.append(t.numel())
        return real_tolist(t)

    def forbidden(real: Any) -> Any:
        def guarded(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            assert not _ours(), f"{_caller(1)} read a tensor's value on the host"
            return real(t, *args, **kwargs)

        return guarded

    def tensor(*args: Any, **kwargs: Any) -> torch.Tensor:
        assert kwargs.get("device") is None or not _ours(), (
            f"{_caller(1)} built a tensor from a host list on the device"
        )
        return real_tensor(*args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "tolist", tolist)
        m.setattr(torch.Tensor, "item", forbidden(torch.Tensor.item))
        m.setattr(torch.Tensor, "__bool__", forbidden(torch.Tensor.__bool__))
        m.setattr(torch.Tensor, "nonzero", forbidden(torch.Tensor.nonzero))
        m.setattr(torch, "tensor", tensor)
        yield reads
