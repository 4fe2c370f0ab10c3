"""Scheduler and block manager without a model: plain data in, plain data out. KV contents are
simulated by one integer per slot, a function of the sequence's whole prefix, so sharing, swapping and
copy-on-write are checked for what they must preserve: each sequence reads back its own prefix."""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis import event, given, settings
from hypothesis import strategies as st

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceStatus


def make_scheduler(num_blocks: int, block_size: int = 4, num_host_blocks: int = 0, **options) -> Scheduler:
    options = {"enable_prefix_caching": False, "admission_watermark": 0.0, **options}
    config = EngineConfig(block_size=block_size, num_kv_blocks=num_blocks, **options)
    manager = BlockManager(num_blocks, block_size, num_host_blocks, config.enable_prefix_caching)
    return Scheduler(config, manager)


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
    scheduler.update(out, [seqs[item.seq_id] for item in out.scheduled], [], [])
    for item in out.scheduled:
        if item.needs_sample:  # what engine/requests.py does with a sampled token
            seqs[item.seq_id].output_token_ids.append(7)
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
    scheduler = make_scheduler(num_blocks=4, block_size=4, preemption_mode="recompute")
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


def test_swap_preemption_parks_the_whole_table_and_brings_it_back_when_room_returns():
    scheduler = make_scheduler(num_blocks=4, block_size=4, num_host_blocks=8, preemption_mode="swap")
    seqs = {0: make_seq(0, 4), 1: make_seq(1, 4, priority=1), 2: make_seq(2, 4)}
    for seq in seqs.values():
        scheduler.add(seq)
    run_step(scheduler, seqs)
    victim_blocks = list(scheduler.block_manager.block_table(1))
    out = run_step(scheduler, seqs)
    assert out.preempted == (1,) and seqs[1].status is SequenceStatus.SWAPPED
    assert [device for device, _ in out.blocks_to_swap_out] == victim_blocks
    assert seqs[1].num_computed_tokens == 4  # nothing to recompute
    assert scheduler.counters.preemptions == {"swap": 1, "recompute": 0}
    scheduler.finish(seqs[0])
    host_blocks = [host for _, host in out.blocks_to_swap_out]
    out = run_step(scheduler, seqs)
    assert [host for host, _ in out.blocks_to_swap_in] == host_blocks
    assert scheduler.block_manager.block_table(1)[: len(host_blocks)] == [device for _, device in out.blocks_to_swap_in]
    resumed = [s for s in out.scheduled if s.seq_id == 1][0]
    assert (resumed.start_position, resumed.num_new_tokens) == (4, 1)  # the decode, no recompute
    assert scheduler.block_manager.num_free_host_blocks == 8


def test_swap_falls_back_to_recompute_when_the_host_pool_or_the_step_cap_is_short():
    for host_blocks, cap in ((0, 100), (8, 0)):
        scheduler = make_scheduler(4, 4, num_host_blocks=host_blocks, preemption_mode="swap", max_swap_blocks_per_step=cap)
        seqs = {i: make_seq(i, 4) for i in range(3)}
        for seq in seqs.values():
            scheduler.add(seq)
        run_step(scheduler, seqs)
        out = run_step(scheduler, seqs)
        assert out.preempted == (2,) and not out.blocks_to_swap_out
        assert seqs[2].status is SequenceStatus.WAITING and seqs[2].num_computed_tokens == 0
        assert scheduler.counters.preemptions == {"swap": 0, "recompute": 1}


def test_victim_is_the_least_recently_scheduled_among_equals():
    # budget 2: seqs 0 and 1 decode, seq 2 waits a step; when seq 0 needs a block, 2 goes, not 1
    scheduler = make_scheduler(num_blocks=5, block_size=4, num_host_blocks=8, max_num_batched_tokens=12)
    seqs = {i: make_seq(i, 4) for i in range(3)}
    for seq in seqs.values():
        scheduler.add(seq)
    run_step(scheduler, seqs)
    scheduler.config.max_num_batched_tokens = 2
    run_step(scheduler, seqs)  # 0 and 1 get their 5th slot (new blocks), 2 is not scheduled
    assert seqs[2].last_scheduled_step < seqs[1].last_scheduled_step
    scheduler.config.max_num_batched_tokens = 12
    seqs[1].priority = seqs[2].priority = 0
    out = run_step(scheduler, seqs)
    assert out.preempted == (2,)


def test_watermark_prevents_a_preempt_and_restore_of_the_same_sequence():
    """A swapped-out sequence comes back only when its blocks plus the watermark are free, never in
    the step that evicted it, so it is not bounced in and out while memory stays tight."""
    scheduler = make_scheduler(
        num_blocks=10, block_size=4, num_host_blocks=20, admission_watermark=0.2, max_num_batched_tokens=64
    )
    seqs = {i: make_seq(i, 8) for i in range(5)}  # 2 blocks each: the pool is full after admission
    for seq in seqs.values():
        scheduler.add(seq)
    history: dict[int, list[str]] = {i: [] for i in seqs}
    for _ in range(12):
        out = run_step(scheduler, seqs)
        restored = {device for _, device in out.blocks_to_swap_in}
        for seq_id in out.preempted:
            history[seq_id].append("out")
            assert not restored, "something was swapped in during a step that preempted"
        for item in out.scheduled:
            if set(item.block_table) & restored and item.start_position > 0:
                history[item.seq_id].append("in")
        free = scheduler.block_manager.num_free_blocks
        if restored:
            assert free >= 2 or not scheduler.running  # the 0.2 x 10 block reserve held
    assert any("out" in h for h in history.values())
    for events in history.values():  # never out and back in on consecutive steps
        assert "out,in,out,in" not in ",".join(events)


def _prefix_value(seq: Sequence, position: int) -> int:
    return hash(tuple(seq.token_ids_slice(0, position + 1))) & 0x7FFF_FFFF_FFFF


@settings(max_examples=250, deadline=None)
@given(
    num_blocks=st.integers(min_value=8, max_value=40),
    num_host_blocks=st.integers(min_value=0, max_value=40),
    block_size=st.sampled_from([1, 2, 4, 16]),
    budget=st.integers(min_value=4, max_value=64),
    max_num_seqs=st.integers(min_value=1, max_value=8),
    mode=st.sampled_from(["swap", "recompute"]),
    prefix_caching=st.booleans(),
    reuse_cached_before_fresh=st.booleans(),  # a CPU pool's allocation order
    policy=st.sampled_from(["continuous", "static"]),
    prefix_ordering=st.booleans(),
    lookahead_steps=st.sampled_from([0, 0, 2, 8]),
    victim=st.sampled_from(["recency", "least_work"]),
    events=st.lists(
        st.tuples(
            st.sampled_from(["arrive", "arrive", "step", "step", "step", "step", "finish", "abort", "fork"]),
            st.integers(0, 1000),
            st.integers(0, 2),
        ),
        min_size=30,
        max_size=150,
    ),
)
def test_no_block_leaks_and_every_sequence_reads_its_own_prefix(
    num_blocks, num_host_blocks, block_size, budget, max_num_seqs, mode, prefix_caching, reuse_cached_before_fresh,
    policy, prefix_ordering, lookahead_steps, victim, events,
):
    import torch

    from engine.model_runner import ModelRunner

    scheduler = make_scheduler(
        num_blocks, block_size, num_host_blocks, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
        preemption_mode=mode, enable_prefix_caching=prefix_caching, admission_watermark=0.1,
        scheduling_policy=policy, prefix_aware_ordering=prefix_ordering, prefix_ordering_max_overtakes=3,
        lookahead_admission_steps=lookahead_steps, preemption_victim=victim,
    )
    manager = scheduler.block_manager
    manager.reuse_cached_before_fresh = reuse_cached_before_fresh
    # One int64 per slot stands in for a token's K (and V); the runner moves blocks as it would KV.
    def pool(blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(torch.full((blocks, block_size, 1, 1), -1, dtype=torch.int64),) * 2] if blocks else []
    no_model = SimpleNamespace(kernels="torch")  # nothing runs a forward pass here: only blocks move
    runner = ModelRunner(no_model, pool(num_blocks), pool(num_host_blocks), block_size, torch.device("cpu"), "torch")  # type: ignore[arg-type]
    slots = runner.kv_caches[0][0].view(-1)
    capacity = num_blocks * block_size
    seqs: dict[int, Sequence] = {}
    stats = {"written": 0, "swapped": 0, "copied": 0}
    next_id = 0
    for kind, value, priority in events:
        if kind == "arrive":
            # prompts of 1, 2, 3, ... share their beginnings, so the prefix cache has work to do
            seqs[next_id] = make_seq(next_id, 1 + value % max(1, capacity // 2), priority)
            scheduler.add(seqs[next_id])
            next_id += 1
        elif kind == "step":
            out = scheduler.schedule()
            assert out.num_batched_tokens <= budget
            sources, destinations = [s for s, _ in out.blocks_to_copy], [d for _, d in out.blocks_to_copy]
            # the copy kernel runs the pairs concurrently
            assert len(set(destinations)) == len(destinations) and not set(destinations) & set(sources)
            runner._move_blocks(out)
            for item in out.scheduled:
                seq = seqs[item.seq_id]
                for position in range(item.start_position, item.start_position + item.num_new_tokens):
                    block = item.block_table[position // block_size]
                    others = [s for s in scheduler.running if s is not seq and block in manager.block_table(s.seq_id)]
                    assert not others, "a sequence writes into a block another one holds"
                    slots[block * block_size + position % block_size] = _prefix_value(seq, position)
                    stats["written"] += 1
            stats["swapped"] += len(out.blocks_to_swap_out)
            stats["copied"] += len(out.blocks_to_copy)
            sampled = {i.seq_id: 1 + (i.seq_id * 31 + len(seqs[i.seq_id].output_token_ids)) % 5
                       for i in out.scheduled if i.needs_sample}
            scheduler.update(out, [seqs[i.seq_id] for i in out.scheduled], [], [])
            for seq_id, token in sampled.items():
                seqs[seq_id].output_token_ids.append(token)
            for seq in list(scheduler.running):
                table = manager.block_table(seq.seq_id)
                for position in range(seq.num_computed_tokens):
                    slot = table[position // block_size] * block_size + position % block_size
                    assert slots[slot] == _prefix_value(seq, position), "a sequence lost its KV"
                # would outgrow the pool, or reached max_tokens (what lookahead admission counts on)
                if seq.num_tokens >= capacity or len(seq.output_token_ids) >= seq.params.max_tokens:
                    scheduler.finish(seq)
                    del seqs[seq.seq_id]
        elif kind == "fork":
            parents = [s for s in scheduler.running if s.output_token_ids and s.num_uncomputed_tokens == 1]
            if parents:
                parent = parents[value % len(parents)]
                child = make_seq(next_id, 1)
                child.prompt_token_ids, child.output_token_ids = parent.prompt_token_ids, list(parent.output_token_ids)
                child.output_token_ids[-1] += 1  # a sibling's different sample
                scheduler.fork(parent, child)
                seqs[next_id] = child
                next_id += 1
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
    assert manager.num_free_host_blocks == num_host_blocks
    assert not scheduler.has_unfinished()
    for name, count in stats.items():
        event(f"{name}: {'some' if count else 'none'}")
    event(f"prefix hits: {'some' if scheduler.counters.prefix_cache_hit_tokens else 'none'}")


def test_a_prompt_waits_a_step_for_a_shared_prefix_being_computed_instead_of_computing_it_twice():
    scheduler = make_scheduler(num_blocks=100, block_size=4, enable_prefix_caching=True, max_num_batched_tokens=64)
    document = list(range(1, 21))  # 5 full blocks
    seqs = {i: make_seq(i, 1) for i in range(3)}
    for i, seq in seqs.items():
        seq.prompt_token_ids = document + [100 + i]
        scheduler.add(seq)
    first = run_step(scheduler, seqs)
    assert [(s.seq_id, s.num_new_tokens) for s in first.scheduled] == [(0, 21)]
    second = run_step(scheduler, seqs)
    assert [(s.seq_id, s.start_position, s.num_new_tokens) for s in second.scheduled] == [(0, 21, 1), (1, 20, 1), (2, 20, 1)]
    assert scheduler.counters.prefix_cache_hit_tokens == 40


def test_static_policy_admits_the_next_batch_only_when_the_whole_batch_finished():
    scheduler = make_scheduler(num_blocks=100, max_num_seqs=2, scheduling_policy="static")
    seqs = {i: make_seq(i, 2) for i in range(4)}
    for seq in seqs.values():
        scheduler.add(seq)
    assert [s.seq_id for s in run_step(scheduler, seqs).scheduled] == [0, 1]
    scheduler.finish(seqs.pop(0))  # a seat is free, but the batch is not done
    assert [s.seq_id for s in run_step(scheduler, seqs).scheduled] == [1]
    scheduler.finish(seqs.pop(1))
    assert [s.seq_id for s in run_step(scheduler, seqs).scheduled] == [2, 3]
    continuous = make_scheduler(num_blocks=100, max_num_seqs=2)
    seqs = {i: make_seq(i, 2) for i in range(3)}
    for seq in seqs.values():
        continuous.add(seq)
    run_step(continuous, seqs)
    continuous.finish(seqs.pop(0))
    assert [s.seq_id for s in run_step(continuous, seqs).scheduled] == [1, 2]


def test_static_batch_keeps_forming_while_the_token_budget_is_what_stops_admission():
    scheduler = make_scheduler(num_blocks=100, max_num_seqs=4, max_num_batched_tokens=8, scheduling_policy="static")
    seqs = {i: make_seq(i, 6) for i in range(5)}
    for seq in seqs.values():
        scheduler.add(seq)
    run_step(scheduler, seqs)  # seq 0 whole, seq 1 in part: the budget ran out
    run_step(scheduler, seqs)
    run_step(scheduler, seqs)
    assert sorted(s.seq_id for s in scheduler.running) == [0, 1, 2, 3]  # a full batch of 4, seq 4 waits for it
    assert [s.seq_id for s in scheduler.waiting] == [4]


def document_seq(seq_id: int, document: int, priority: int = 0) -> Sequence:
    """A 20-token prompt: 16 tokens (4 blocks) of its document, then its own question."""
    seq = make_seq(seq_id, 1, priority)
    seq.prompt_token_ids = [1000 * (document + 1) + t for t in range(16)] + [seq_id + 1] * 4
    return seq


def admissions_until_done(scheduler: Scheduler, seqs: dict[int, Sequence]) -> list[int]:
    """Step until every sequence is done, each finishing with its first token; returns the order in
    which prompts were computed."""
    order = []
    while scheduler.has_unfinished():
        out = run_step(scheduler, seqs)
        order += [item.seq_id for item in out.scheduled if item.num_new_tokens > 1]
        for seq in list(scheduler.running):
            if seq.output_token_ids:
                scheduler.finish(seq)
    return order


def test_prefix_aware_ordering_admits_the_questions_of_a_cached_document_first():
    scheduler = make_scheduler(num_blocks=100, max_num_seqs=1, enable_prefix_caching=True)
    # arrival order: documents 0, 1, 1, 0, 2, 0
    seqs = {i: document_seq(i, d) for i, d in enumerate([0, 1, 1, 0, 2, 0])}
    for seq in seqs.values():
        scheduler.add(seq)
    assert admissions_until_done(scheduler, seqs) == [0, 3, 5, 1, 2, 4]
    scheduler.block_manager.check_invariants()


def test_prefix_aware_ordering_keeps_priority_first_and_bounds_overtaking():
    scheduler = make_scheduler(
        num_blocks=100, max_num_seqs=1, enable_prefix_caching=True, prefix_ordering_max_overtakes=2
    )
    seqs = {0: document_seq(0, 0), 1: document_seq(1, 1), 2: document_seq(2, 0), 3: document_seq(3, 0)}
    seqs[4], seqs[5] = document_seq(4, 0), document_seq(5, 2, priority=-1)
    for seq in seqs.values():
        scheduler.add(seq)
    order = admissions_until_done(scheduler, seqs)
    # priority -1 first; then document 0 is cached, but seq 1 (the oldest) is overtaken only twice
    assert order == [5, 0, 2, 3, 1, 4]


def test_prefix_aware_ordering_off_keeps_arrival_order():
    scheduler = make_scheduler(num_blocks=100, max_num_seqs=1, enable_prefix_caching=True, prefix_aware_ordering=False)
    seqs = {i: document_seq(i, d) for i, d in enumerate([0, 1, 0])}
    for seq in seqs.values():
        scheduler.add(seq)
    assert admissions_until_done(scheduler, seqs) == [0, 1, 2]


def length_bounded_seq(seq_id: int, prompt_len: int, max_tokens: int) -> Sequence:
    seq = make_seq(seq_id, prompt_len)
    seq.params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return seq


def test_lookahead_admission_starts_a_prompt_in_the_blocks_free_now_when_the_rest_is_about_to_be_released():
    for lookahead, admitted in ((0, []), (2, [(1, 8)])):
        # seq 0 holds 6 of 8 blocks and finishes within 2 steps; seq 1 needs 4 blocks
        scheduler = make_scheduler(num_blocks=8, block_size=4, lookahead_admission_steps=lookahead)
        seqs = {0: length_bounded_seq(0, 21, max_tokens=2), 1: length_bounded_seq(1, 16, max_tokens=4)}
        scheduler.add(seqs[0])
        run_step(scheduler, seqs)  # prefill of seq 0: its first token
        scheduler.add(seqs[1])
        out = run_step(scheduler, seqs)  # seq 0 decodes its last token; 2 blocks are free, 4 needed
        assert [(s.seq_id, s.num_new_tokens) for s in out.scheduled if s.seq_id == 1] == admitted
        scheduler.finish(seqs[0])
        out = run_step(scheduler, seqs)
        assert [(s.seq_id, s.start_position) for s in out.scheduled] == [(1, 8 if lookahead else 0)]
        scheduler.block_manager.check_invariants()


def test_least_work_victim_preempts_the_sequence_with_the_fewest_computed_tokens():
    for victim_policy, victim in (("recency", 2), ("least_work", 1)):
        # 1 + 1 + 2 blocks fill the pool; seq 0's first decode needs a fifth: seq 1 or seq 2 must go
        scheduler = make_scheduler(num_blocks=4, block_size=4, preemption_mode="recompute", preemption_victim=victim_policy)
        seqs = {0: make_seq(0, 4), 1: make_seq(1, 4), 2: make_seq(2, 8)}
        for seq in seqs.values():
            scheduler.add(seq)
        run_step(scheduler, seqs)
        assert run_step(scheduler, seqs).preempted[0] == victim  # by recency: the newest; else: 4 computed < 8


def test_long_rope_sequence_computes_again_once_it_grows_past_the_threshold():
    """LongRoPE with a threshold of 8 tokens: a 6-token prompt runs on the short table; once its 9th token is
    known it is computed again, whole, on the long table (its short-table blocks stay cached under their own
    names, and are not what the long computation finds); a prompt past the threshold is long from its first chunk."""
    config = EngineConfig(block_size=4, num_kv_blocks=100, admission_watermark=0.0, max_num_batched_tokens=6)
    scheduler = Scheduler(config, BlockManager(100, 4, 0, enable_prefix_caching=True), long_rope_threshold=8)
    seq, long_prompt = make_seq(0, prompt_len=6), make_seq(1, prompt_len=10)
    seqs = {0: seq, 1: long_prompt}
    scheduler.add(seq)
    steps = [run_step(scheduler, seqs) for _ in range(3)]  # the prompt, then tokens 7 and 8 decode on the short table
    assert [(s.start_position, s.num_new_tokens, s.long_rope) for out in steps for s in out.scheduled] == [
        (0, 6, False), (6, 1, False), (7, 1, False)]
    assert seq.num_tokens == 9 and scheduler.counters.long_rope_recomputes == 0
    scheduler.add(long_prompt)
    out = run_step(scheduler, seqs)
    assert [(s.seq_id, s.start_position, s.num_new_tokens, s.long_rope) for s in out.scheduled] == [(0, 0, 6, True)]
    assert scheduler.counters.long_rope_recomputes == 1 and scheduler.counters.prefix_cache_hit_tokens == 0
    out = run_step(scheduler, seqs)  # the rest of its recomputation; the long prompt starts, sharing its first block
    assert [(s.seq_id, s.start_position, s.num_new_tokens, s.long_rope) for s in out.scheduled] == [
        (0, 6, 3, True), (1, 4, 3, True)]
    assert scheduler.counters.prefix_cache_hit_tokens == 4 and scheduler.counters.long_rope_recomputes == 1
    short_twin = make_seq(2, prompt_len=6)  # finds the short-table block the first sequence left cached
    assert len(scheduler.block_manager.cached_prefix(short_twin)) == 1
    scheduler.block_manager.check_invariants()


def test_queued_long_rope_sequences_that_grew_past_the_threshold_take_the_long_table():
    """Beams parked in the host pool or waiting get their next token from their request's step: past LongRoPE's
    threshold a swapped one's host copy is dropped and it computes again on the long table; a waiting one, with
    nothing computed, just starts on it."""
    config = EngineConfig(block_size=4, num_kv_blocks=100, admission_watermark=0.0, enable_prefix_caching=False)
    scheduler = Scheduler(config, BlockManager(100, 4, 10), long_rope_threshold=8)
    seq = make_seq(0, prompt_len=8)
    scheduler.add(seq)
    run_step(scheduler, {0: seq})
    swap_out: list[tuple[int, int]] = []
    scheduler.running.remove(seq)
    scheduler._preempt(seq, swap_out)
    assert seq.status is SequenceStatus.SWAPPED and swap_out
    out = run_step(scheduler, {0: seq})
    assert not out.blocks_to_swap_in and [(s.start_position, s.num_new_tokens, s.long_rope) for s in out.scheduled] == [
        (0, 9, True)]
    assert scheduler.counters.long_rope_recomputes == 1 and scheduler.block_manager.num_free_host_blocks == 10
    waiting = make_seq(1, prompt_len=8)
    scheduler.add(waiting)
    waiting.output_token_ids.append(7)
    out = scheduler.schedule()
    assert [(s.seq_id, s.start_position, s.long_rope) for s in out.scheduled] == [(0, 9, True), (1, 0, True)]
    assert scheduler.counters.long_rope_recomputes == 1
    scheduler.block_manager.check_invariants()
