"""Scheduler and block manager without a model: plain data in, plain data out."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceStatus


def make_scheduler(num_blocks: int, block_size: int = 4, **options: int) -> Scheduler:
    config = EngineConfig(block_size=block_size, num_kv_blocks=num_blocks, **options)
    return Scheduler(config, BlockManager(num_blocks, block_size))


def make_seq(seq_id: int, prompt_len: int, priority: int = 0) -> Sequence:
    return Sequence(
        seq_id=seq_id,
        request_id=str(seq_id),
        sample_index=0,
        prompt_token_ids=list(range(1, prompt_len + 1)),
        params=SamplingParams(),
        seed=seq_id,
        priority=priority,
        arrival_order=seq_id,
    )


def run_step(scheduler: Scheduler, seqs: dict[int, Sequence]):
    out = scheduler.schedule()
    sampled = {item.seq_id: 7 for item in out.scheduled if item.needs_sample}
    scheduler.update(out, sampled, seqs)
    return out


def test_blocks_are_allocated_on_demand_not_for_max_tokens():
    scheduler = make_scheduler(num_blocks=100, block_size=4)
    seq = make_seq(0, prompt_len=5)
    scheduler.add(seq)
    run_step(scheduler, {0: seq})
    assert len(scheduler.block_manager.block_table(0)) == 2  # 5 tokens -> 2 blocks of 4
    for _ in range(3):  # tokens 6, 7, 8 still fit in block 2
        run_step(scheduler, {0: seq})
    assert len(scheduler.block_manager.block_table(0)) == 2
    run_step(scheduler, {0: seq})
    assert len(scheduler.block_manager.block_table(0)) == 3


def test_long_prompt_is_chunked_and_decodes_share_the_step():
    scheduler = make_scheduler(num_blocks=100, block_size=4, max_num_batched_tokens=8)
    short, long = make_seq(0, prompt_len=3), make_seq(1, prompt_len=20)
    seqs = {0: short, 1: long}
    scheduler.add(short)
    first = run_step(scheduler, seqs)
    assert [(s.seq_id, s.num_new_tokens) for s in first.scheduled] == [(0, 3)]
    scheduler.add(long)
    second = run_step(scheduler, seqs)
    # the decode of seq 0 comes first, the long prompt fills the rest of the 8-token budget
    assert [(s.seq_id, s.num_new_tokens, s.needs_sample) for s in second.scheduled] == [(0, 1, True), (1, 7, False)]
    third = run_step(scheduler, seqs)
    assert [(s.seq_id, s.num_new_tokens, s.start_position) for s in third.scheduled] == [(0, 1, 4), (1, 7, 7)]


def test_chunking_disabled_waits_for_room_for_the_whole_prompt():
    scheduler = make_scheduler(num_blocks=100, max_num_batched_tokens=8, enable_chunked_prefill=False)
    first, second = make_seq(0, prompt_len=4), make_seq(1, prompt_len=6)
    scheduler.add(first)
    scheduler.add(second)
    out = scheduler.schedule()
    assert [(s.seq_id, s.num_new_tokens) for s in out.scheduled] == [(0, 4)]  # 6 > the 4 tokens left
    assert scheduler.waiting == [second]


def test_max_num_seqs_bounds_the_running_batch():
    scheduler = make_scheduler(num_blocks=100, max_num_seqs=2)
    seqs = {i: make_seq(i, 2) for i in range(4)}
    for seq in seqs.values():
        scheduler.add(seq)
    out = run_step(scheduler, seqs)
    assert [s.seq_id for s in out.scheduled] == [0, 1]
    assert [s.seq_id for s in scheduler.waiting] == [2, 3]


def test_priority_orders_admission():
    scheduler = make_scheduler(num_blocks=100, max_num_seqs=1)
    low, high = make_seq(0, 2, priority=5), make_seq(1, 2, priority=-1)
    scheduler.add(low)
    scheduler.add(high)
    assert [s.seq_id for s in scheduler.schedule().scheduled] == [1]


def test_preemption_takes_lowest_priority_then_newest_and_it_resumes_first():
    # 3 sequences of 4 tokens fill 3 of 4 blocks; then two of them need a new block each
    scheduler = make_scheduler(num_blocks=4, block_size=4)
    seqs = {0: make_seq(0, 4), 1: make_seq(1, 4, priority=1), 2: make_seq(2, 4)}
    for seq in seqs.values():
        scheduler.add(seq)
    run_step(scheduler, seqs)
    out = run_step(scheduler, seqs)
    assert out.preempted == (1,)  # priority 1 is the lowest priority, even though seq 2 is newer
    assert seqs[1].num_computed_tokens == 0 and seqs[1].status is SequenceStatus.WAITING
    assert [s.seq_id for s in out.scheduled] == [0, 2]
    assert seqs[1].output_token_ids == [7]  # recompute keeps what was generated
    scheduler.finish(seqs[0])
    out = run_step(scheduler, seqs)
    resumed = [s for s in out.scheduled if s.seq_id == 1][0]
    assert resumed.num_new_tokens == 5  # prompt + the generated token, recomputed


@settings(max_examples=60, deadline=None)
@given(
    num_blocks=st.integers(min_value=8, max_value=40),
    block_size=st.sampled_from([1, 2, 4, 16]),
    budget=st.integers(min_value=4, max_value=64),
    max_num_seqs=st.integers(min_value=1, max_value=8),
    events=st.lists(
        st.tuples(st.sampled_from(["arrive", "step", "finish", "abort"]), st.integers(0, 1000), st.integers(0, 2)),
        min_size=1,
        max_size=120,
    ),
)
def test_block_invariants_under_random_workloads(num_blocks, block_size, budget, max_num_seqs, events):
    scheduler = make_scheduler(num_blocks, block_size, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs)
    manager = scheduler.block_manager
    capacity = num_blocks * block_size
    seqs: dict[int, Sequence] = {}
    next_id = 0
    for kind, value, priority in events:
        if kind == "arrive":
            prompt_len = 1 + value % max(1, capacity // 2)
            seqs[next_id] = make_seq(next_id, prompt_len, priority)
            scheduler.add(seqs[next_id])
            next_id += 1
        elif kind == "step":
            out = run_step(scheduler, seqs)
            assert out.num_batched_tokens <= budget
            assert len(scheduler.running) <= max_num_seqs
            owned = [b for s in out.scheduled for b in s.block_table]
            assert len(owned) == len(set(owned)), "a block is in two tables"
            for seq in list(scheduler.running):  # finish anything that would outgrow the pool
                if seq.num_tokens >= capacity:
                    scheduler.finish(seq)
                    del seqs[seq.seq_id]
        elif seqs:
            victim = list(seqs.values())[value % len(seqs)]
            if kind == "finish" and victim.status is not SequenceStatus.RUNNING:
                continue
            scheduler.finish(victim)
            del seqs[victim.seq_id]
        manager.check_invariants()
    for seq in list(seqs.values()):
        scheduler.finish(seq)
    manager.check_invariants()
    assert manager.num_free_blocks == num_blocks
    assert not scheduler.has_unfinished()
