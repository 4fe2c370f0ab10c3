"""Block manager: prefix-cache sharing and eviction, copy-on-write, and swapping between pools."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from engine.block_manager import BlockManager
from engine.model_runner import ModelRunner
from engine.sampling_params import SamplingParams
from engine.scheduler import SchedulerOutput
from engine.sequence import Sequence


def make_seq(seq_id: int, tokens: list[int]) -> Sequence:
    return Sequence(seq_id, str(seq_id), 0, tokens, SamplingParams(), seed=0)


def admit(manager: BlockManager, seq: Sequence) -> int:
    """What the scheduler does on admission, computing the whole prompt at once."""
    cached = manager.cached_prefix(seq)
    start = len(cached) * manager.block_size
    manager.allocate(seq.seq_id, start, seq.num_tokens, cached)
    seq.num_computed_tokens = seq.num_tokens
    manager.cache_full_blocks(seq)
    return start


def test_a_shared_prefix_is_reused_but_the_last_token_is_always_computed():
    manager = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    first = make_seq(0, list(range(10)))  # blocks [0..3] [4..7] and a partial one
    assert admit(manager, first) == 0
    second = make_seq(1, list(range(8)) + [99, 98])
    assert admit(manager, second) == 8  # two full blocks found
    assert manager.block_table(1)[:2] == manager.block_table(0)[:2]
    exact = make_seq(2, list(range(8)))  # a prompt that is exactly two cached blocks
    assert admit(manager, exact) == 4  # the second block is recomputed for the last token's logits
    manager.check_invariants()


def test_cached_blocks_outlive_their_owner_and_are_evicted_least_recently_used_tail_first():
    manager = BlockManager(num_blocks=6, block_size=2, enable_prefix_caching=True)
    old = make_seq(0, [1, 2, 3, 4, 5])  # full blocks [1,2] [3,4]
    admit(manager, old)
    manager.free(0)
    assert manager.num_free_blocks == 6 and manager.prefix_cache.num_evictable == 2
    assert admit(manager, make_seq(1, [1, 2, 3, 4, 9])) == 4  # served after its owner finished
    manager.free(1)
    # Four fresh blocks plus one evicted: the tail block [3,4] goes before its parent [1,2].
    admit(manager, make_seq(2, [7] * 10))
    manager.free(2)
    assert admit(manager, make_seq(3, [1, 2, 3, 4, 0])) == 2
    manager.check_invariants()


def test_fork_shares_every_block_and_the_first_write_copies_the_partial_one():
    manager = BlockManager(num_blocks=8, block_size=4)
    parent = make_seq(0, [1, 2, 3, 4, 5, 6])
    admit(manager, parent)
    child = make_seq(1, parent.prompt_token_ids)
    child.num_computed_tokens = parent.num_computed_tokens
    manager.fork(parent, child)
    assert manager.block_table(1) == manager.block_table(0)
    shared_full, shared_partial = manager.block_table(0)
    assert manager.num_blocks_needed(1, 6, 7) == 1  # the copy of the partial block
    manager.allocate(1, 6, 7)
    (source, copy), = manager.take_copies()
    assert source == shared_partial and manager.block_table(1) == [shared_full, copy]
    manager.allocate(0, 6, 7)  # the parent now holds its partial block alone: no copy
    assert manager.take_copies() == [] and manager.block_table(0) == [shared_full, shared_partial]
    manager.check_invariants()


def test_swap_is_all_or_nothing_per_sequence():
    manager = BlockManager(num_blocks=8, block_size=4, num_host_blocks=2)
    seq = make_seq(0, list(range(12)))  # 3 blocks
    admit(manager, seq)
    assert not manager.can_swap_out(0)
    small = make_seq(1, [1, 2])
    admit(manager, small)
    assert manager.can_swap_out(1)
    (device, host), = manager.swap_out(1)
    assert manager.num_free_host_blocks == 1 and manager.block_table(1) == []
    (host_back, device_back), = manager.swap_in(1)
    assert host_back == host and manager.block_table(1) == [device_back]
    manager.check_invariants()


def test_a_swap_round_trip_restores_the_kv_bytes_exactly():
    """Random bit patterns (NaNs and denormals included) must come back bit for bit."""
    torch.manual_seed(0)
    layers, num_blocks, host_blocks, shape = 3, 10, 6, (4, 2, 8)

    def pool(blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [
            tuple(torch.randint(-(2**15), 2**15, (blocks, *shape), dtype=torch.int16).view(torch.bfloat16) for _ in "kv")
            for _ in range(layers)
        ]

    device_pool, host_pool = pool(num_blocks), pool(host_blocks)
    no_model = SimpleNamespace(kernels="torch")  # nothing runs a forward pass here: only blocks move
    runner = ModelRunner(no_model, device_pool, host_pool, block_size=4, device=torch.device("cpu"), kernel_backend="torch")  # type: ignore[arg-type]
    blocks = [7, 2, 5]
    before = [(k[blocks].clone(), v[blocks].clone()) for k, v in device_pool]
    runner._move_blocks(SchedulerOutput(scheduled=(), blocks_to_swap_out=((7, 0), (2, 4), (5, 1))))
    for k, v in device_pool:  # the vacated blocks are reused and overwritten
        k.view(torch.int16)[blocks] = -1
        v.view(torch.int16)[blocks] = -1
    runner._move_blocks(SchedulerOutput(scheduled=(), blocks_to_swap_in=((0, 3), (4, 9), (1, 0))))
    for (k, v), (k_before, v_before) in zip(device_pool, before):
        assert torch.equal(k[[3, 9, 0]].view(torch.int16), k_before.view(torch.int16))
        assert torch.equal(v[[3, 9, 0]].view(torch.int16), v_before.view(torch.int16))


def test_window_releases_blocks_behind_it_through_fork_swap_and_the_prefix_cache():
    """Window 8, blocks of 4: a query at position p reads keys from p - 7 on, so before computing
    position 20 the blocks of positions 0-11 are never read again and are released (FREED)."""
    from engine.block_manager import FREED

    manager = BlockManager(num_blocks=16, block_size=4, num_host_blocks=8, enable_prefix_caching=True,
                           sliding_window=8)
    seq = make_seq(0, list(range(20)))
    admit(manager, seq)  # positions 0-19: five full blocks, all still held (the next query reads from 13)
    assert manager.num_held_blocks(0) == 5
    first_blocks = manager.block_table(0)[:3]
    manager.allocate(0, 20, 21)  # before computing position 20: keys 13.. needed, blocks 0-2 released
    assert manager.block_table(0)[:3] == [FREED] * 3 and manager.num_held_blocks(0) == 3
    assert all(manager.prefix_cache.is_evictable(block) for block in first_blocks)  # named: kept, evictable
    manager.check_invariants()

    child = make_seq(1, list(range(21)))
    seq.num_computed_tokens = 20
    manager.fork(seq, child)  # shares the held blocks only
    assert manager.block_table(1)[:3] == [FREED] * 3
    manager.check_invariants()

    pairs = manager.swap_out(1)  # three held blocks move; the FREED entries stay FREED
    assert len(pairs) == 3 and manager.num_host_blocks_of(1) == 3
    assert manager.num_blocks_to_swap_in(1, 24) == 3
    back = manager.swap_in(1)
    assert len(back) == 3 and manager.block_table(1)[:3] == [FREED] * 3
    manager.check_invariants()

    later = make_seq(2, list(range(20)) + [7])  # the released-but-cached prefix is still found
    assert admit(manager, later) == 20
    manager.free(0), manager.free(1), manager.free(2)
    manager.check_invariants()
    assert manager.num_free_blocks == 16 and manager.num_free_host_blocks == 8


def test_on_a_lazily_committed_pool_cached_blocks_are_reused_before_fresh_ones():
    """A CPU pool's fresh blocks add memory when first written: sequence after sequence of distinct prompts keeps
    within twice the blocks one sequence holds (3), while a GPU pool's cache keeps every block it
    can."""
    for reuse, blocks_touched in ((True, 4), (False, 16)):
        manager = BlockManager(num_blocks=16, block_size=2, enable_prefix_caching=True, reuse_cached_before_fresh=reuse)
        touched: set[int] = set()
        for seq_id in range(8):  # one sequence at a time, each with a prompt of its own: two full blocks and a part
            seq = make_seq(seq_id, [seq_id * 10 + token for token in range(5)])
            admit(manager, seq)
            touched.update(manager.block_table(seq_id))
            manager.free(seq_id)
            manager.check_invariants()
        assert len(touched) == blocks_touched, (reuse, sorted(touched))
        # The prompt that ran last is still cached either way: least recently used blocks go first.
        assert admit(manager, make_seq(99, [70, 71, 72, 73, 0])) == 4
