"""KV block manager: the device pool and the host (swap) pool, per-sequence block tables, ref counts,
prefix-cache sharing and copy-on-write.

Blocks are allocated on demand as a sequence grows (nothing is reserved for `max_tokens` up front).
A block may be held by several sequences at once: a cached prefix, or the prompt that `n` samples and
beams fork from. A shared block that one holder is about to write into is first copied for it
(copy-on-write); the copy is queued for the model runner and runs before the step's forward pass.
Swapping moves a sequence's whole table to the host pool and back; the block copies are returned
to the caller, which hands them to the runner the same way.

Swap, end to end (its one description, which docs/architecture.md points to):

1. Sizing (`engine.kv_cache`): in swap mode the host pool holds `swap_space` bytes of blocks, allocated beside the
   device pool with the same per-layer shape (pinned on CUDA, so copies are asynchronous).
2. Decision (`engine.scheduler`, `Scheduler._preempt`): when a running sequence cannot get a block, a victim is
   chosen (`_make_room`); it is swapped out if this pool has room for its whole table (`can_swap_out`) and the
   step's `max_swap_blocks_per_step` can take it, and recomputed otherwise. It waits in the `swapped` queue, in
   schedule order, and comes back (`_admit`) only when its blocks plus the admission watermark are free, never in a
   step that preempted.
3. Bookkeeping (here, `swap_out` / `swap_in`): the table moves between pools in one go; the (source, destination)
   block pairs go out in `SchedulerOutput.blocks_to_swap_out` / `blocks_to_swap_in`.
4. Copies (`engine.model_runner`): before the step's forward pass (the vacated device blocks may be written by it),
   `conveyor_kernels.block_copy.swap_blocks` moves every layer's K and V blocks in one launch per direction (its torch
   reference off Triton; on CUDA the kernel addresses the pinned host pool directly, so no step waits on it); the
   time is read from CUDA events outside the step.
5. Telemetry (`engine.metrics`): preemptions by mode, blocks swapped each way, swap seconds and bytes/s.

On a model whose every layer attends through the same sliding window, a block wholly before the
window of a sequence's next query is never read again: it is released as the sequence advances, and
its table entry becomes FREED (-1), so a long sequence holds about window / block_size + 1 blocks.
With full-attention layers anywhere (Gemma's global layers) nothing can be released this way.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq

from engine.multimodal.inputs import image_block_key
from engine.prefix_cache import LONG_ROPE_ROOT, BlockHash, PrefixCache, adapter_root, extend_block_hashes
from engine.sequence import Sequence

BlockPairs = list[tuple[int, int]]  # (source block, destination block)
FREED = -1  # a table entry whose block was released because no query will read it again


def _hash_root(seq: Sequence) -> BlockHash | None:
    """Where the sequence's prefix-cache names start: apart for K/V rotated with LongRoPE's long factors, and apart
    per LoRA adapter (an adapter's K/V differ from the base model's and from every other adapter's)."""
    root = LONG_ROPE_ROOT if seq.long_rope else None
    return root if seq.params.adapter is None else adapter_root(root, seq.params.adapter)


def _hash_extra_key(seq: Sequence) -> Callable[[int, int], bytes] | None:
    """What a block's name adds to its tokens: the images whose placeholders it holds (None without images)."""
    images = seq.images
    return (lambda start, stop: image_block_key(images, start, stop)) if images else None


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_host_blocks: int = 0,
        enable_prefix_caching: bool = False,
        sliding_window: int | None = None,  # tokens that every layer attends back (None: some layer attends all)
        reuse_cached_before_fresh: bool = False,  # a pool whose untouched blocks cost no memory yet (CPU): see below
    ) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.sliding_window = sliding_window
        self.num_host_blocks = num_host_blocks
        self.block_size = block_size
        self.prefix_cache = PrefixCache() if enable_prefix_caching else None
        # A stack: the most recently freed block is reused first, while it is still in the CPU's
        # caches and its pages are mapped (a fresh page of the lazily zeroed pool faults on first write).
        self._free: list[int] = list(reversed(range(num_blocks)))
        # Blocks never used sit at the bottom of that stack (freed ones are pushed above them): the first
        # `_num_fresh` entries. A CPU pool is lazily zeroed memory, so each fresh block taken adds its pages to the
        # process for good; with `reuse_cached_before_fresh`, once the prefix cache keeps as many idle blocks as
        # the sequences hold, its least recently used block is evicted and reused instead of a fresh one, so the
        # pool's touched part stays within twice the working set however many batches pass (a cache filling every
        # fresh block grew a worker's memory with every batch). On a GPU the pool is committed memory either way
        # and the cache keeps every block it can.
        self._num_fresh = num_blocks
        self.reuse_cached_before_fresh = reuse_cached_before_fresh
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
    def num_fresh_blocks(self) -> int:
        """Blocks never used yet: on a CPU pool, ones whose pages are not yet in the process's memory."""
        return self._num_fresh

    @property
    def num_free_host_blocks(self) -> int:
        return len(self._host_free)

    def block_table(self, seq_id: int) -> list[int]:
        return self._tables.get(seq_id, [])

    def num_held_blocks(self, seq_id: int) -> int:
        """Device blocks the sequence holds (its table less the entries released outside the window)."""
        return sum(1 for block in self._tables.get(seq_id, ()) if block != FREED)

    def num_host_blocks_of(self, seq_id: int) -> int:
        return sum(1 for block in self._host_tables.get(seq_id, ()) if block != FREED)

    def num_blocks_to_swap_in(self, seq_id: int, stop: int) -> int:
        """Device blocks a swapped-out sequence needs to come back and write positions up to `stop`."""
        host_table = self._host_tables[seq_id]
        return self.num_host_blocks_of(seq_id) + max(0, -(-stop // self.block_size) - len(host_table))

    # ---- allocation -----------------------------------------------------------------------

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding the start of `seq`, for a sequence with nothing computed. The last
        token is always left to compute, since its logits are needed."""
        if self.prefix_cache is None:
            return []
        extend_block_hashes(
            seq.block_hashes, seq.token_ids_slice, seq.num_tokens, self.block_size, _hash_root(seq), _hash_extra_key(seq)
        )
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
        """Whether `num_new_blocks` can be taken while keeping `reserve` blocks free."""
        return num_new_blocks <= self._num_allocatable(cached, reserve)

    def num_writable_tokens(self, seq_id: int, start: int, cached: Seq[int] = (), reserve: int = 0) -> int:
        """How many positions from `start` on `seq_id` could write with the blocks free now, keeping
        `reserve` free (`cached`: the prefix a sequence being admitted would claim)."""
        table = self._tables.get(seq_id) or cached
        copy = self.num_blocks_needed(seq_id, start, start, cached)  # a shared block at `start` is copied first
        return max(0, (len(table) + self._num_allocatable(cached, reserve) - copy) * self.block_size - start)

    def num_exclusive_blocks(self, seq_id: int) -> int:
        """Blocks of `seq_id` that no other sequence holds: what freeing it gives back."""
        return sum(1 for block in self._tables.get(seq_id, ()) if self._ref_counts[block] == 1)

    def _num_allocatable(self, cached: Seq[int], reserve: int) -> int:
        """Free blocks beyond `reserve`, less the cached ones in `cached` that nobody holds: claiming
        them takes them out of the free pool."""
        claimed = sum(1 for b in cached if self.prefix_cache is not None and self.prefix_cache.is_evictable(b))
        return self.num_free_blocks - claimed - reserve

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
        self._release_outside_window(table, start)
        index = start // self.block_size
        if index < len(table) and self._ref_counts[table[index]] > 1:
            copy = self._take_empty()
            self._pending_copies.append((table[index], copy))
            self._ref_counts[table[index]] -= 1
            table[index] = copy
        while len(table) * self.block_size < stop:
            table.append(self._take_empty())

    def update(
        self, computed: list[Sequence], forks: list[tuple[Sequence, Sequence]], finished: list[Sequence]
    ) -> None:
        """A step's block bookkeeping, in this order: the `computed` sequences offer their newly full blocks to the
        prefix cache, each (parent, child) of `forks` shares its parent's blocks, the `finished` free theirs."""
        for seq in computed:
            self.cache_full_blocks(seq)
        for parent, child in forks:
            self.fork(parent, child)
        for seq in finished:
            self.free(seq.seq_id)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares every block of the parent; the first write into a shared block copies it.
        It inherits the names of the computed full blocks only: its later tokens may differ."""
        table = self._tables[parent.seq_id]
        for block in table:
            if block != FREED:
                self._ref_counts[block] += 1
        self._tables[child.seq_id] = list(table)
        self._num_registered[child.seq_id] = self._num_registered.get(parent.seq_id, 0)
        child.block_hashes = parent.block_hashes[: parent.num_computed_tokens // self.block_size]
        child.long_rope = parent.long_rope

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Offer the blocks `seq` has completely computed to the prefix cache."""
        if self.prefix_cache is None:
            return
        num_full = seq.num_computed_tokens // self.block_size
        registered = self._num_registered.get(seq.seq_id, 0)
        if num_full <= registered:
            return
        extend_block_hashes(
            seq.block_hashes, seq.token_ids_slice, num_full * self.block_size, self.block_size, _hash_root(seq),
            _hash_extra_key(seq),
        )
        table = self._tables[seq.seq_id]
        for index in range(registered, num_full):
            if table[index] != FREED:
                self.prefix_cache.register(table[index], seq.block_hashes[index])
        self._num_registered[seq.seq_id] = num_full

    def free(self, seq_id: int) -> None:
        """Release the sequence's blocks in both pools. The tail goes first, so that among cached
        blocks the ends of prefixes are evicted before their shared beginnings."""
        for block in reversed(self._tables.pop(seq_id, ())):
            if block != FREED:
                self._release(block)
        self._num_registered.pop(seq_id, None)
        self._host_free.extend(block for block in self._host_tables.pop(seq_id, ()) if block != FREED)

    def take_copies(self) -> BlockPairs:
        """Copy-on-write copies queued since the last call, for the runner to perform."""
        copies, self._pending_copies = self._pending_copies, []
        for block in self._released_copy_sources:
            self._recycle(block)
        self._released_copy_sources.clear()
        return copies

    # ---- swapping -------------------------------------------------------------------------

    def can_swap_out(self, seq_id: int) -> bool:
        return self.num_held_blocks(seq_id) <= len(self._host_free)

    def swap_out(self, seq_id: int) -> BlockPairs:
        """Move the whole table (its held blocks) to the host pool. Returns (device block, host block) copies."""
        needed = self.num_held_blocks(seq_id)
        if needed > len(self._host_free):
            raise RuntimeError(f"host pool full: need {needed}, {len(self._host_free)} free")
        table = self._tables.pop(seq_id)
        host_table = [FREED if block == FREED else self._host_free.pop() for block in table]
        self._host_tables[seq_id] = host_table
        for block in reversed(table):
            if block != FREED:
                self._release(block)
        self._num_registered.pop(seq_id, None)
        return [(block, host) for block, host in zip(table, host_table) if block != FREED]

    def swap_in(self, seq_id: int) -> BlockPairs:
        """Bring a swapped-out table back into fresh device blocks. Returns (host block, device block) copies."""
        needed = self.num_host_blocks_of(seq_id)
        if needed > self.num_free_blocks:
            raise RuntimeError(f"out of KV blocks: need {needed}, {self.num_free_blocks} free")
        host_table = self._host_tables.pop(seq_id)
        table = [FREED if host == FREED else self._take_empty() for host in host_table]
        self._tables[seq_id] = table
        self._host_free.extend(host for host in reversed(host_table) if host != FREED)
        return [(host, block) for host, block in zip(host_table, table) if host != FREED]

    # ---- internals ------------------------------------------------------------------------

    def _release_outside_window(self, table: list[int], start: int) -> None:
        """Release the blocks wholly before the window of a query at `start`, the earliest this
        sequence will compute from now on: it attends keys from start - window + 1 on."""
        if self.sliding_window is None:
            return
        index = max(0, start - self.sliding_window + 1) // self.block_size - 1
        # Released entries form a prefix of the table: walk back from the newest one to release.
        while index >= 0 and table[index] != FREED:
            self._release(table[index])
            table[index] = FREED
            index -= 1

    def _take_empty(self) -> int:
        if self._free and not self._reuse_cached():
            block = self._free.pop()
            self._num_fresh = min(self._num_fresh, len(self._free))
        else:
            block = self.prefix_cache.evict()  # type: ignore[union-attr]
        self._ref_counts[block] = 1
        return block

    def _reuse_cached(self) -> bool:
        """Whether the next empty block is a cached one evicted rather than a fresh one (see `_num_fresh`)."""
        if not self.reuse_cached_before_fresh or self.prefix_cache is None or len(self._free) > self._num_fresh:
            return False  # a freed block is warm and caches nothing: always first
        idle = self.prefix_cache.num_evictable
        held = self.num_blocks - len(self._free) - idle
        return idle > 0 and idle >= held

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
                if block != FREED:
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
        host_held = [b for table in self._host_tables.values() for b in table if b != FREED]
        assert len(host_held) + len(self._host_free) == self.num_host_blocks, "a host block leaked"
        assert len(set(host_held) | set(self._host_free)) == self.num_host_blocks, "a host block is held twice"
