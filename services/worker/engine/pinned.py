"""Host staging of a step's small index inputs (issue 31, item 4): `Staging` owns reusable host
buffers (pinned on CUDA) that a step's values are written into through numpy views, without
building a torch tensor per step, and the one non-blocking host-to-device copy per buffer.

Why: `torch.tensor(list).copy_(dst, non_blocking=True)` from pageable memory is a synchronous
copy in disguise (the CUDA driver stages it through its own pinned buffer, and torch synchronizes
the stream for a pageable source), and building the tensor costs host time every step. From
pinned memory the copy is a DMA queued on the stream: the host goes on at once.

Invariant: a host buffer is never rewritten while a copy from it may still be in flight. Each
Staging keeps `slots` buffers used in turn, and an event recorded after each copy; acquiring a
buffer waits for its previous copy's event (already complete in the common case, since the
buffer was last used `slots` steps ago). On CPU there is no event and no pinning: the copy is a
plain memcpy done when `copy_to` returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

_SLOTS = 2  # buffers used in turn: one may be in flight while the next step fills the other


class Staging:
    """Host buffers of one dtype for copies to `device` (one buffer per step, in turn)."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device, slots: int = _SLOTS) -> None:
        self.dtype = dtype
        self.device = device
        self.pinned = device.type == "cuda"
        self._slots = slots
        self._host: list[torch.Tensor] = [self._alloc(numel) for _ in range(slots)]
        self._events: list[Any] = [None] * slots
        self._next = 0
        self._current = 0

    def _alloc(self, numel: int) -> torch.Tensor:
        return torch.empty(max(1, numel), dtype=self.dtype, pin_memory=self.pinned)

    def acquire(self, numel: int) -> np.ndarray:
        """The next host buffer as a writable numpy view of `numel` elements, once no copy from
        it is in flight (a buffer too small is replaced: torch's host allocator keeps the old
        one alive until its recorded copies are done)."""
        i = self._next
        self._next = (i + 1) % self._slots
        self._current = i
        event = self._events[i]
        if event is not None:
            event.synchronize()  # the copy of `slots` steps ago: normally long done
            self._events[i] = None
        if self._host[i].numel() < numel:
            self._host[i] = self._alloc(max(numel, 2 * self._host[i].numel()))
        return self._host[i][:numel].numpy()

    def copy_to(self, dst: torch.Tensor, numel: int) -> None:
        """The acquired buffer's first `numel` elements into dst (flat, numel elements), queued
        on the current stream (CUDA) or done now (CPU)."""
        src = self._host[self._current][:numel]
        dst.view(-1).copy_(src, non_blocking=self.pinned)
        if self.pinned:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self._events[self._current] = event

    def pack(self, parts: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Several index lists as tensors on the device, in one copy: views of one new device
        tensor, each starting 16-byte aligned (compiled kernels may assume aligned inputs)."""
        align = max(1, 16 // torch.empty((), dtype=self.dtype).element_size())
        starts = [0]
        for p in parts:
            starts.append(starts[-1] + -(-len(p) // align) * align)
        total = starts[-1]
        arr = self.acquire(total)
        for p, at in zip(parts, starts, strict=False):
            arr[at : at + len(p)] = p
        packed = torch.empty(max(1, total), dtype=self.dtype, device=self.device)
        self.copy_to(packed[:total], total)
        return [packed[at : at + len(p)] for p, at in zip(parts, starts, strict=False)]


def to_device(values: Any, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A small host list (sampling parameters, row indices) as a tensor on `device` without a
    synchronizing copy: on CUDA it goes through pinned memory (torch's host allocator keeps that
    block until the copy is done) with a non-blocking copy; elsewhere it is the host tensor.
    `torch.tensor(values, device="cuda")` would copy from pageable memory, which waits for
    every kernel queued before it."""
    t = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)
