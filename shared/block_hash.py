"""Chained hashes of full KV blocks of token ids, identical in the gateway (routing) and the engine
(prefix cache): block i's hash covers every token of blocks 0..i, so equal hashes mean equal
prefixes."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

_SEED = b"pdserve-kv-v1"


def chain_hash(parent: int | None, block_tokens: Sequence[int]) -> int:
    """64-bit hash of one block given its parent's hash (None for the first block)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(_SEED if parent is None else parent.to_bytes(8, "little"))
    h.update(b"".join(int(t).to_bytes(4, "little") for t in block_tokens))
    return int.from_bytes(h.digest(), "little")


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Hashes of every full block of `token_ids` (a trailing partial block has none)."""
    hashes: list[int] = []
    parent: int | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = chain_hash(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes
