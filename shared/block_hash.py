"""Chained hashes of full KV blocks of token ids, identical in the gateway (routing) and the engine
(prefix cache): block i's hash covers every token of blocks 0..i, so equal hashes mean equal
prefixes. A request's cache salt (vLLM's `cache_salt`) roots its chain elsewhere (`salt_root`):
its blocks never match another salt's, or an unsalted request's, so tenants that use different
salts cannot find (or time) each other's cached prompts. A request served through a LoRA adapter
roots it at the adapter's (and its salt's) root too (`chain_root`): the adapter changes every
layer's K/V, so its blocks must never match the base model's or another adapter's."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

_SEED = b"pdserve-kv-v1"
_SALT_SEED = b"pdserve-kv-salt-v1"
_LORA_SEED = b"pdserve-kv-lora-v1"


def salt_root(salt: str) -> int | None:
    """The parent hash a salted request's first block hangs off (None: no salt, the common root)."""
    if not salt:
        return None
    h = hashlib.blake2b(_SALT_SEED + salt.encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little")


def chain_root(salt: str, lora_adapter: str = "") -> int | None:
    """Where a request's chain starts: None for the base model without a salt (the common root),
    salt_root(salt) for the base model, else a root of the adapter's name and the salt."""
    if not lora_adapter:
        return salt_root(salt)
    h = hashlib.blake2b(_LORA_SEED, digest_size=8)
    for part in (lora_adapter, salt):  # length-prefixed: ("a", "bc") != ("ab", "c")
        raw = part.encode()
        h.update(len(raw).to_bytes(4, "little") + raw)
    return int.from_bytes(h.digest(), "little")


def chain_hash(parent: int | None, block_tokens: Sequence[int]) -> int:
    """64-bit hash of one block given its parent's hash (None for the first block)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(_SEED if parent is None else parent.to_bytes(8, "little"))
    h.update(b"".join(int(t).to_bytes(4, "little") for t in block_tokens))
    return int.from_bytes(h.digest(), "little")


def block_hashes(token_ids: Sequence[int], block_size: int, root: int | None = None) -> list[int]:
    """Hashes of every full block of `token_ids` (a trailing partial block has none); `root`: the
    chain's start (chain_root of the request's cache salt and LoRA adapter)."""
    hashes: list[int] = []
    parent = root
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = chain_hash(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes
