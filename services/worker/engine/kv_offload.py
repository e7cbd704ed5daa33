"""The host-memory tier of a rank's prefix cache (`--kv-offload-tokens`).

Owns `HostKvCache`: full KV blocks that the device pool's prefix cache evicts (BlockManager
hands a cached block out again) are copied into host memory first, under their chain hash,
least recently used dropped first; a later request whose prompt continues past its device
prefix hits into blocks held here gets them copied back into fresh device blocks instead of
recomputing them. On a GPU that turns prefix-cache capacity from the pool's few GB of HBM into
host RAM (a multi-turn conversation, a shared system prompt, an agent's long context that left
the pool while other requests ran); the copy back costs a fraction of the prefill it replaces.
On a CPU the pool is host memory already: the tier works the same (and is tested there) but
only adds capacity.

What is kept: every layer's K and V of one block, exactly as the pool held them ([layers, 2,
kv_heads, block_size, head_dim] per block, the pool's dtype), so a restored block is the block
that was evicted, bit for bit, and a request served from it decodes the same tokens. The chain
hash names a block's whole prefix (shared.block_hash), so a block is only ever restored under
the same tokens after the same prefix.

Copies happen under the rank's lock, in the step thread or the caller adding a request: on
eviction (before the block is handed out, so before anything can write it) and on restore (before
the step that reads the blocks is launched). On CUDA both go through pinned host memory
(synchronously: an eviction is rare next to a step, and a restore replaces a prefill).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch

from shared.block_hash import chain_hash


class HostKvCache:
    """Blocks evicted from one rank's KV pool, by chain hash (LRU). Not thread-safe: used under
    the rank's lock."""

    def __init__(self, pool_blocks: Callable[[], torch.Tensor], num_blocks: int, block_size: int) -> None:
        """pool_blocks: the device pool viewed by block, [layers, 2, kv_heads, blocks,
        block_size, head_dim] (ModelRunner.blocks_view); num_blocks: host blocks to keep."""
        if num_blocks < 1:
            raise ValueError(f"a host KV tier needs at least one block, got {num_blocks}")
        self._pool_blocks = pool_blocks
        self.num_blocks = num_blocks
        self.block_size = block_size
        pool = pool_blocks()
        layers, two, heads, _, bs, dim = pool.shape
        self._device = pool.device
        # empty, not zeros: a slot is read only after a save wrote it (zeroing GBs of pinned
        # memory would only slow the start)
        self._store = torch.empty(
            (layers, two, heads, num_blocks, bs, dim),
            dtype=pool.dtype,
            pin_memory=pool.device.type == "cuda",
        )
        self._slots: OrderedDict[int, int] = OrderedDict()  # chain hash -> host block, LRU first
        self._free = list(range(num_blocks - 1, -1, -1))
        self.saved_blocks = 0  # blocks copied in since start (count)
        self.restored_blocks = 0  # blocks copied back into the pool since start (count)

    @property
    def num_used_blocks(self) -> int:
        return len(self._slots)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._slots

    def save(self, evicted: Sequence[tuple[int, int]]) -> None:
        """Keep these (device block, chain hash) pairs, which the pool is about to hand out
        again; a hash already held is only marked recently used."""
        todo: list[tuple[int, int]] = []
        for block, block_hash in evicted:
            if block_hash in self._slots:
                self._slots.move_to_end(block_hash)
                continue
            if not self._free:
                _, slot = self._slots.popitem(last=False)  # the least recently used goes
                self._free.append(slot)
            slot = self._free.pop()
            self._slots[block_hash] = slot
            todo.append((block, slot))
        if not todo:
            return
        src = torch.tensor([b for b, _ in todo], device=self._device)
        dst = torch.tensor([s for _, s in todo])
        self._store.index_copy_(3, dst, self._pool_blocks().index_select(3, src).to("cpu"))
        self.saved_blocks += len(todo)

    def lookup(self, token_ids: Sequence[int], parent: int | None, start: int, max_blocks: int) -> list[int]:
        """Chain hashes of the full blocks `start`, `start + 1`, ... of `token_ids` held here,
        while they are (at most up to block `max_blocks`); `parent` is block start - 1's hash (None
        at 0). Found blocks become the most recently used."""
        found: list[int] = []
        bs = self.block_size
        for i in range(start, min(max_blocks, len(token_ids) // bs)):
            parent = chain_hash(parent, token_ids[i * bs : (i + 1) * bs])
            if parent not in self._slots:
                break
            self._slots.move_to_end(parent)
            found.append(parent)
        return found

    def fetch(self, hashes: Sequence[int]) -> torch.Tensor:
        """The blocks of `hashes` (all held: from `lookup`), copied out of the tier now, as
        [layers, 2, kv_heads, n, block_size, head_dim] on the pool's device; taken before the
        device blocks they go to are allocated (which may evict, and so save, other blocks)."""
        src = torch.tensor([self._slots[h] for h in hashes])
        return self._store.index_select(3, src).to(self._device)

    def restore(self, blocks: torch.Tensor, device_blocks: Sequence[int]) -> None:
        """Write fetched blocks into these (freshly allocated) device blocks."""
        dst = torch.tensor(list(device_blocks), device=self._device)
        self._pool_blocks().index_copy_(3, dst, blocks)
        self.restored_blocks += len(device_blocks)
