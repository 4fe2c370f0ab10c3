"""KV block manager: the device pool and the host (swap) pool, per-sequence block tables, ref counts,
prefix-cache sharing and copy-on-write.

Blocks are allocated on demand as a sequence grows (nothing is reserved for `max_tokens` up front).
A block may be held by several sequences at once: a cached prefix, or the prompt that `n` samples and
beams fork from. A shared block that one holder is about to write into is first copied for it
(copy-on-write); the copy is queued for the model runner and runs before the step's forward pass.
Swapping moves a sequence's whole table to the host pool and back; the block copies are returned
to the caller, which hands them to the runner the same way.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from engine.prefix_cache import PrefixCache, extend_block_hashes
from engine.sequence import Sequence

BlockPairs = list[tuple[int, int]]  # (source block, destination block)


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, num_host_blocks: int = 0, enable_prefix_caching: bool = False
    ) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.num_host_blocks = num_host_blocks
        self.block_size = block_size
        self.prefix_cache = PrefixCache() if enable_prefix_caching else None
        # A stack: the most recently freed block is reused first, while it is still in the CPU's
        # caches and its pages are mapped (a fresh page of the lazily zeroed pool faults on first write).
        self._free: list[int] = list(reversed(range(num_blocks)))
        self._ref_counts = [0] * num_blocks
        self._tables: dict[int, list[int]] = {}
        self._num_registered: dict[int, int] = {}  # seq id -> leading blocks offered to the prefix cache
        self._host_free: list[int] = list(reversed(range(num_host_blocks)))
        self._host_tables: dict[int, list[int]] = {}
        self._pending_copies: BlockPairs = []
        # Copy sources released while their copy is pending: reused only once the copies are taken,
        # so no block is both read and overwritten by one step's (concurrent) copies.
        self._released_copy_sources: list[int] = []

    # ---- reading --------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks available to allocate: empty ones plus cached ones nobody holds."""
        return len(self._free) + (self.prefix_cache.num_evictable if self.prefix_cache else 0)

    @property
    def num_free_host_blocks(self) -> int:
        return len(self._host_free)

    def block_table(self, seq_id: int) -> list[int]:
        return self._tables.get(seq_id, [])

    def num_host_blocks_of(self, seq_id: int) -> int:
        return len(self._host_tables.get(seq_id, ()))

    # ---- allocation -----------------------------------------------------------------------

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding the start of `seq`, for a sequence with nothing computed. The last
        token is always left to compute, since its logits are needed."""
        if self.prefix_cache is None:
            return []
        extend_block_hashes(seq.block_hashes, seq.token_ids_slice, seq.num_tokens, self.block_size)
        usable = (seq.num_tokens - 1) // self.block_size
        return self.prefix_cache.lookup(seq.block_hashes[:usable])

    def num_blocks_needed(self, seq_id: int, start: int, stop: int, cached: Seq[int] = ()) -> int:
        """Blocks to take from the free pool so `seq_id` can write positions [start, stop): new
        blocks past its table (or past `cached`, for a sequence being admitted), plus one if the
        block that `start` falls in is shared and has to be copied first."""
        table = self._tables.get(seq_id) or cached
        needed = max(0, -(-stop // self.block_size) - len(table))
        index = start // self.block_size
        if index < len(table) and self._ref_counts[table[index]] > 1:
            needed += 1
        return needed

    def can_allocate(self, num_new_blocks: int, cached: Seq[int] = (), reserve: int = 0) -> bool:
        """Whether `num_new_blocks` can be taken while keeping `reserve` blocks free. Claiming a
        cached block nobody holds also takes it out of the free pool."""
        claimed = sum(1 for b in cached if self.prefix_cache is not None and self.prefix_cache.is_evictable(b))
        return num_new_blocks + claimed + reserve <= self.num_free_blocks

    def allocate(self, seq_id: int, start: int, stop: int, cached: Seq[int] = ()) -> None:
        """Make `seq_id` able to write positions [start, stop): claim `cached` (for a sequence being
        admitted), copy a shared block it writes into, and append new blocks."""
        needed = self.num_blocks_needed(seq_id, start, stop, cached)
        if not self.can_allocate(needed, cached if seq_id not in self._tables else ()):
            raise RuntimeError(f"out of KV blocks: need {needed}, {self.num_free_blocks} free")
        table = self._tables.setdefault(seq_id, [])
        if not table:
            for block in cached:
                self._take_shared(block)
                table.append(block)
        index = start // self.block_size
        if index < len(table) and self._ref_counts[table[index]] > 1:
            copy = self._take_empty()
            self._pending_copies.append((table[index], copy))
            self._ref_counts[table[index]] -= 1
            table[index] = copy
        while len(table) * self.block_size < stop:
            table.append(self._take_empty())

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares every block of the parent; the first write into a shared block copies it.
        It inherits the names of the computed full blocks only: its later tokens may differ."""
        table = self._tables[parent.seq_id]
        for block in table:
            self._ref_counts[block] += 1
        self._tables[child.seq_id] = list(table)
        self._num_registered[child.seq_id] = self._num_registered.get(parent.seq_id, 0)
        child.block_hashes = parent.block_hashes[: parent.num_computed_tokens // self.block_size]

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Offer the blocks `seq` has completely computed to the prefix cache."""
        if self.prefix_cache is None:
            return
        num_full = seq.num_computed_tokens // self.block_size
        registered = self._num_registered.get(seq.seq_id, 0)
        if num_full <= registered:
            return
        extend_block_hashes(seq.block_hashes, seq.token_ids_slice, num_full * self.block_size, self.block_size)
        table = self._tables[seq.seq_id]
        for index in range(registered, num_full):
            self.prefix_cache.register(table[index], seq.block_hashes[index])
        self._num_registered[seq.seq_id] = num_full

    def free(self, seq_id: int) -> None:
        """Release the sequence's blocks in both pools. The tail goes first, so that among cached
        blocks the ends of prefixes are evicted before their shared beginnings."""
        for block in reversed(self._tables.pop(seq_id, ())):
            self._release(block)
        self._num_registered.pop(seq_id, None)
        self._host_free.extend(self._host_tables.pop(seq_id, ()))

    def take_copies(self) -> BlockPairs:
        """Copy-on-write copies queued since the last call, for the runner to perform."""
        copies, self._pending_copies = self._pending_copies, []
        for block in self._released_copy_sources:
            self._recycle(block)
        self._released_copy_sources.clear()
        return copies

    # ---- swapping -------------------------------------------------------------------------

    def can_swap_out(self, seq_id: int) -> bool:
        return len(self._tables.get(seq_id, ())) <= len(self._host_free)

    def swap_out(self, seq_id: int) -> BlockPairs:
        """Move the whole table to the host pool. Returns (device block, host block) copies."""
        table = self._tables.pop(seq_id)
        if len(table) > len(self._host_free):
            raise RuntimeError(f"host pool full: need {len(table)}, {len(self._host_free)} free")
        host_table = [self._host_free.pop() for _ in table]
        self._host_tables[seq_id] = host_table
        for block in reversed(table):
            self._release(block)
        self._num_registered.pop(seq_id, None)
        return list(zip(table, host_table))

    def swap_in(self, seq_id: int) -> BlockPairs:
        """Bring a swapped-out table back into fresh device blocks. Returns (host block, device block) copies."""
        host_table = self._host_tables.pop(seq_id)
        if len(host_table) > self.num_free_blocks:
            raise RuntimeError(f"out of KV blocks: need {len(host_table)}, {self.num_free_blocks} free")
        table = [self._take_empty() for _ in host_table]
        self._tables[seq_id] = table
        self._host_free.extend(reversed(host_table))
        return list(zip(host_table, table))

    # ---- internals ------------------------------------------------------------------------

    def _take_empty(self) -> int:
        block = self._free.pop() if self._free else self.prefix_cache.evict()  # type: ignore[union-attr]
        self._ref_counts[block] = 1
        return block

    def _take_shared(self, block: int) -> None:
        if self._ref_counts[block] == 0:
            self.prefix_cache.claim(block)  # type: ignore[union-attr]
        self._ref_counts[block] += 1

    def _release(self, block: int) -> None:
        self._ref_counts[block] -= 1
        if self._ref_counts[block] > 0:
            return
        if any(source == block for source, _ in self._pending_copies):
            self._released_copy_sources.append(block)
        else:
            self._recycle(block)

    def _recycle(self, block: int) -> None:
        if not (self.prefix_cache and self.prefix_cache.release(block)):
            self._free.append(block)

    def check_invariants(self) -> None:
        """Every block is free, cached-and-unheld, or held, with ref counts matching its holders; the
        host pool likewise. Used by tests."""
        holders = [0] * self.num_blocks
        for table in self._tables.values():
            for block in table:
                holders[block] += 1
        free = set(self._free)
        assert len(free) == len(self._free), "a block is in the free pool twice"
        cache = self.prefix_cache
        for block in range(self.num_blocks):
            assert holders[block] == self._ref_counts[block], f"block {block}: ref count != holders"
            unheld = (
                block in free
                or (cache is not None and cache.is_evictable(block))
                or block in self._released_copy_sources
            )
            assert unheld == (holders[block] == 0), f"block {block}: free xor held violated"
            assert not (block in free and cache is not None and cache.is_evictable(block)), f"block {block} twice"
        if cache is not None:
            cache.check_invariants()
        host_held = [b for table in self._host_tables.values() for b in table]
        assert len(host_held) + len(self._host_free) == self.num_host_blocks, "a host block leaked"
        assert len(set(host_held) | set(self._host_free)) == self.num_host_blocks, "a host block is held twice"
