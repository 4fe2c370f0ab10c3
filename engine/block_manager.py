"""KV block manager: a free pool of fixed-size blocks, per-sequence block tables and ref counts.

Blocks are allocated on demand as a sequence grows (nothing is reserved for `max_tokens` up front)
and return to the pool the step their last owner lets go of them.
"""

from __future__ import annotations

class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # A stack: the most recently freed block is reused first, while it is still in the CPU's
        # caches and its pages are mapped (a fresh page of the lazily zeroed pool faults on first write).
        self._free: list[int] = list(reversed(range(num_blocks)))
        self._ref_counts = [0] * num_blocks
        self._tables: dict[int, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def block_table(self, seq_id: int) -> list[int]:
        return self._tables.get(seq_id, [])

    def num_blocks_needed(self, seq_id: int, num_tokens: int) -> int:
        """Blocks to add so that `seq_id` can hold `num_tokens` tokens in total."""
        required = -(-num_tokens // self.block_size)
        return max(0, required - len(self._tables.get(seq_id, ())))

    def can_grow(self, seq_id: int, num_tokens: int) -> bool:
        return self.num_blocks_needed(seq_id, num_tokens) <= len(self._free)

    def grow(self, seq_id: int, num_tokens: int) -> None:
        needed = self.num_blocks_needed(seq_id, num_tokens)
        if needed > len(self._free):
            raise RuntimeError(f"out of KV blocks: need {needed}, {len(self._free)} free")
        table = self._tables.setdefault(seq_id, [])
        for _ in range(needed):
            block = self._free.pop()
            self._ref_counts[block] = 1
            table.append(block)

    def free(self, seq_id: int) -> None:
        for block in self._tables.pop(seq_id, ()):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free.append(block)

    def check_invariants(self) -> None:
        """Every block is either free or owned, ref counts match ownership. Used by tests."""
        owners = [0] * self.num_blocks
        for table in self._tables.values():
            for block in table:
                owners[block] += 1
        free = set(self._free)
        assert len(free) == len(self._free), "a block is in the free pool twice"
        for block in range(self.num_blocks):
            assert owners[block] == self._ref_counts[block], f"block {block}: ref count != owners"
            assert (block in free) == (owners[block] == 0), f"block {block}: free xor owned violated"
