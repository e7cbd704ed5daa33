"""Giving freed heap memory back to the OS (glibc malloc_trim), so a long-running process's RSS
tracks what it uses: per-request tensors of varying sizes (prompts, KV chunks, logits) leave
freed-but-kept pages in glibc's arenas that otherwise show as slow RSS growth."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.malloc_trim  # noqa: B018 - glibc only (musl has none)
    except (OSError, AttributeError):
        return None
    return libc


def trim_heap() -> bool:
    """Release free heap pages to the OS; True when glibc released any (False elsewhere)."""
    libc = _libc()
    return bool(libc.malloc_trim(0)) if libc is not None else False
