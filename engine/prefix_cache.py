"""Automatic prefix caching: full KV blocks are named by the hash of their whole token prefix, so a
later sequence that starts with the same tokens reuses them instead of recomputing them.

A block's hash chains its parent's hash with its own tokens, so equal hashes mean equal prefixes,
not just equal blocks. A block's K/V also depend on the rotary table they were computed with: a
sequence on LongRoPE's long factors starts its chain from LONG_ROPE_ROOT, so its blocks and the short
factors' never mix; and on the LoRA adapter they were computed with (`adapter_root`), so two adapters never share;
and on the images whose placeholder tokens a block holds (their content hash enters its hash: `extra_key`), so the
same tokens over a different image never share. Cached blocks whose last owner let go stay resident, in least-recently-used order,
and are evicted only when the free pool runs dry.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence

BlockHash = bytes
LONG_ROPE_ROOT: BlockHash = b"long-rope"  # the parent of a long-factor sequence's first block


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra_key: bytes = b"") -> BlockHash:
    """A 128-bit digest: collisions, which would hand one prompt another's KV, are out of reach
    (Python's 64-bit tuple hash is not collision-resistant). `extra_key`: what else the block's K/V depend on
    (the images whose placeholder tokens it holds)."""
    digest = hashlib.blake2b(parent or b"", digest_size=16)
    digest.update(array("q", token_ids).tobytes())
    if extra_key:
        digest.update(b"extra:" + extra_key)
    return digest.digest()


def adapter_root(parent: BlockHash | None, adapter: str) -> BlockHash:
    """The parent of the first block of a sequence running LoRA adapter `adapter` (adapter names are unique per engine)."""
    digest = hashlib.blake2b(parent or b"", digest_size=16)
    digest.update(b"lora-adapter:" + adapter.encode())
    return digest.digest()


def extend_block_hashes(
    hashes: list[BlockHash],
    token_slice: Callable[[int, int], Sequence[int]],
    num_tokens: int,
    block_size: int,
    root: BlockHash | None = None,
    extra_key: Callable[[int, int], bytes] | None = None,
) -> None:
    """Append the hashes of the full blocks among the first `num_tokens` tokens not hashed yet;
    `token_slice(start, stop)` gives a sequence's tokens, `root` is the first block's parent, `extra_key(start, stop)`
    what else the block over those positions depends on (see hash_block)."""
    for index in range(len(hashes), num_tokens // block_size):
        parent = hashes[-1] if hashes else root
        start, stop = index * block_size, (index + 1) * block_size
        extra = extra_key(start, stop) if extra_key is not None else b""
        hashes.append(hash_block(parent, token_slice(start, stop), extra))


class PrefixCache:
    """Which block holds which hashed prefix, and which cached blocks nobody holds (evictable)."""

    def __init__(self) -> None:
        self._block_of: dict[BlockHash, int] = {}
        self._hash_of: dict[int, BlockHash] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest first

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def lookup(self, hashes: Sequence[BlockHash]) -> list[int]:
        """Blocks holding the longest cached prefix of `hashes`."""
        blocks = []
        for block_hash in hashes:
            block = self._block_of.get(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def is_evictable(self, block: int) -> bool:
        return block in self._evictable

    def register(self, block: int, block_hash: BlockHash) -> None:
        """Name `block` by `block_hash`, unless another block already holds that prefix."""
        if block_hash not in self._block_of and block not in self._hash_of:
            self._block_of[block_hash] = block
            self._hash_of[block] = block_hash

    def release(self, block: int) -> bool:
        """The block's last owner let go. Returns True if the cache keeps it (it is named)."""
        if block in self._hash_of:
            self._evictable[block] = None
            return True
        return False

    def claim(self, block: int) -> None:
        """A cache hit takes a block nobody held back into use."""
        del self._evictable[block]

    def evict(self) -> int:
        """Forget the least recently released cached block and hand it over for reuse."""
        block, _ = self._evictable.popitem(last=False)
        del self._block_of[self._hash_of.pop(block)]
        return block

    def check_invariants(self) -> None:
        assert all(self._block_of[h] == b for b, h in self._hash_of.items()), "hash maps disagree"
        assert len(self._block_of) == len(self._hash_of), "hash maps disagree in size"
        assert all(b in self._hash_of for b in self._evictable), "an evictable block has no hash"
