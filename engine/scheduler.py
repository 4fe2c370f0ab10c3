"""Iteration-level scheduler: decides, every step, which sequences run and how many tokens each.

Running sequences go first (so decodes are never starved by long prompts), then swapped-out and
waiting sequences are admitted, in priority order, into the remaining token budget, seat count and
free KV blocks. A prompt that does not fit the budget is split across steps (chunked prefill), so
prefill chunks and decode tokens share a step; a prompt's cached prefix is not computed at all.

When a running sequence cannot get a block, a victim is preempted: lowest priority first, then the
one scheduled least recently, then the newest. In swap mode its blocks move to the host pool whole
and come back later; when the host pool or this step's swap bandwidth cannot take it, or in recompute
mode, its blocks are freed and it is recomputed from its tokens. Admission keeps a reserve of free
blocks (the watermark) and does not happen in a step that preempted, so a burst or a swapped-out
sequence is not let in only to be thrown out again the next step.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from engine.block_manager import BlockManager, BlockPairs
from engine.config import EngineConfig
from engine.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class ScheduledSequence:
    seq_id: int
    start_position: int  # position of the first new token (= tokens already in the cache)
    token_ids: tuple[int, ...]  # the tokens computed this step
    block_table: tuple[int, ...]  # covers start_position + len(token_ids) tokens
    needs_sample: bool  # this step reaches the sequence's last known token, so it yields a new one

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: tuple[ScheduledSequence, ...]
    preempted: tuple[int, ...] = ()  # seq ids swapped out or sent back to wait this step
    # Block copies the runner performs before the forward pass, in this order:
    blocks_to_swap_out: tuple[tuple[int, int], ...] = ()  # (device block, host block)
    blocks_to_swap_in: tuple[tuple[int, int], ...] = ()  # (host block, device block)
    blocks_to_copy: tuple[tuple[int, int], ...] = ()  # copy-on-write (device block, device block)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not (self.scheduled or self.blocks_to_swap_out)


@dataclass
class SchedulerCounters:
    """Cumulative since the scheduler started."""

    preemptions: dict[str, int] = field(default_factory=lambda: {"swap": 0, "recompute": 0})
    blocks_swapped_out: int = 0
    blocks_swapped_in: int = 0
    prefix_cache_queried_tokens: int = 0  # prompt tokens of admitted sequences, with prefix caching on
    prefix_cache_hit_tokens: int = 0  # of those, tokens found in the cache and not computed


def _schedule_key(seq: Sequence) -> tuple[int, int]:
    return seq.schedule_key


def _victim_key(seq: Sequence) -> tuple[int, int, int]:
    """The largest key is preempted first: lowest priority, least recently scheduled, newest."""
    return (seq.priority, -seq.last_scheduled_step, seq.arrival_order)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        # All queues are kept sorted by Sequence.schedule_key (priority, then arrival).
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self.counters = SchedulerCounters()
        self._watermark_blocks = int(config.admission_watermark * block_manager.num_blocks)
        self._step = 0
        self._blocks_in_flight: set[bytes] = set()  # prefix-cache names of the full blocks this step computes

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=_schedule_key)

    def add_running(self, seq: Sequence) -> None:
        """A sequence forked from a running one: it already holds (shared) blocks."""
        seq.status = SequenceStatus.RUNNING
        bisect.insort(self.running, seq, key=_schedule_key)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def schedule(self) -> SchedulerOutput:
        self._step += 1
        self._blocks_in_flight.clear()
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSequence] = []
        preempted: list[int] = []
        swap_out: BlockPairs = []
        swap_in: BlockPairs = []

        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_new = min(seq.num_uncomputed_tokens, budget)
            if num_new == 0:  # a beam waiting for its siblings' logits
                index += 1
                continue
            if self._make_room(seq, index, num_new, preempted, swap_out):
                scheduled.append(self._schedule_one(seq, num_new))
                budget -= num_new
                index += 1

        # Admitting work right after preempting would only evict it again next step.
        if not preempted:
            while budget > 0 and len(self.running) < self.config.max_num_seqs:
                seq = self._next_to_admit()
                if seq is None:
                    break
                num_new = self._admit(seq, budget, swap_in)
                if num_new == 0:
                    break
                scheduled.append(self._schedule_one(seq, num_new))
                budget -= num_new

        if not scheduled and not preempted and self.running and (self.swapped or self.waiting):
            # Every running sequence is a beam parked until a sibling computes, and that sibling cannot
            # get back in: make room, one parked beam per step, or the request never advances.
            victim = max(self.running, key=_victim_key)
            self.running.remove(victim)
            self._preempt(victim, swap_out)
            preempted.append(victim.seq_id)

        return SchedulerOutput(
            scheduled=tuple(scheduled),
            preempted=tuple(preempted),
            blocks_to_swap_out=tuple(swap_out),
            blocks_to_swap_in=tuple(swap_in),
            blocks_to_copy=tuple(self.block_manager.take_copies()),
        )

    def _make_room(
        self, seq: Sequence, index: int, num_new: int, preempted: list[int], swap_out: BlockPairs
    ) -> bool:
        """Preempt until `seq` can write its next `num_new` tokens. Victims come from the sequences
        not yet scheduled this step (those after `index`); `seq` itself goes last. Returns False if
        `seq` was preempted."""
        manager = self.block_manager
        start = seq.num_computed_tokens
        while not manager.can_allocate(manager.num_blocks_needed(seq.seq_id, start, start + num_new)):
            candidates = self.running[index + 1 :]
            victim = max(candidates, key=_victim_key) if candidates else seq
            self.running.remove(victim)
            self._preempt(victim, swap_out)
            preempted.append(victim.seq_id)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, swap_out: BlockPairs) -> None:
        manager = self.block_manager
        num_blocks = len(manager.block_table(seq.seq_id))
        fits_bandwidth = len(swap_out) + num_blocks <= self.config.max_swap_blocks_per_step
        if self.config.preemption_mode == "swap" and fits_bandwidth and manager.can_swap_out(seq.seq_id):
            swap_out.extend(manager.swap_out(seq.seq_id))
            seq.status = SequenceStatus.SWAPPED
            bisect.insort(self.swapped, seq, key=_schedule_key)
            self.counters.preemptions["swap"] += 1
            self.counters.blocks_swapped_out += num_blocks
            return
        manager.free(seq.seq_id)
        seq.num_computed_tokens = 0
        self.counters.preemptions["recompute"] += 1
        self.add(seq)

    def _next_to_admit(self) -> Sequence | None:
        """The head of the swapped and waiting queues, whichever comes first in schedule order."""
        if self.swapped and (not self.waiting or self.swapped[0].schedule_key <= self.waiting[0].schedule_key):
            return self.swapped[0]
        return self.waiting[0] if self.waiting else None

    def _admit(self, seq: Sequence, budget: int, swap_in: BlockPairs) -> int:
        """Move `seq` into the running batch if it fits, keeping the watermark free. Returns the
        number of tokens to compute for it this step (0: it does not fit, nothing changed)."""
        manager = self.block_manager
        size = manager.block_size
        # With nothing running no burst can preempt anything, and the reserve must not lock out a
        # sequence that needs the whole pool.
        reserve = self._watermark_blocks if self.running else 0
        if seq.status is SequenceStatus.SWAPPED:
            num_host = manager.num_host_blocks_of(seq.seq_id)
            num_new = min(seq.num_uncomputed_tokens, budget)
            stop = seq.num_computed_tokens + num_new
            num_needed = max(num_host, -(-stop // size))
            if len(swap_in) + num_host > self.config.max_swap_blocks_per_step:
                return 0
            if not manager.can_allocate(num_needed, reserve=reserve):
                return 0
            self.swapped.pop(0)
            swap_in.extend(manager.swap_in(seq.seq_id))
            self.counters.blocks_swapped_in += num_host
        else:
            cached = manager.cached_prefix(seq)
            reusable = min((seq.num_tokens - 1) // size, len(seq.block_hashes))  # no hashes: caching is off
            if len(cached) < reusable and seq.block_hashes[len(cached)] in self._blocks_in_flight:
                # Its next block is being computed this step by a sequence with the same prefix: wait
                # one step and find it cached, instead of computing it a second time.
                return 0
            num_cached = len(cached) * size
            num_new = min(seq.num_tokens - num_cached, budget)
            if num_new < seq.num_tokens - num_cached and not self.config.enable_chunked_prefill:
                return 0
            num_needed = manager.num_blocks_needed(seq.seq_id, num_cached, num_cached + num_new, cached)
            if not manager.can_allocate(num_needed, cached, reserve=reserve):
                return 0
            self.waiting.pop(0)
            manager.allocate(seq.seq_id, num_cached, num_cached + num_new, cached)
            seq.num_computed_tokens = num_cached
            if manager.prefix_cache is not None:
                self.counters.prefix_cache_queried_tokens += seq.num_tokens
                self.counters.prefix_cache_hit_tokens += num_cached
        seq.status = SequenceStatus.RUNNING
        bisect.insort(self.running, seq, key=_schedule_key)
        return num_new

    def _schedule_one(self, seq: Sequence, num_new: int) -> ScheduledSequence:
        start = seq.num_computed_tokens
        self.block_manager.allocate(seq.seq_id, start, start + num_new)
        seq.last_scheduled_step = self._step
        size = self.block_manager.block_size
        self._blocks_in_flight.update(seq.block_hashes[start // size : (start + num_new) // size])
        return ScheduledSequence(
            seq_id=seq.seq_id,
            start_position=start,
            token_ids=tuple(seq.token_ids_slice(start, start + num_new)),
            block_table=tuple(self.block_manager.block_table(seq.seq_id)),
            needs_sample=start + num_new == seq.num_tokens,
        )

    def update(self, output: SchedulerOutput, sampled: dict[int, int], seqs: dict[int, Sequence]) -> None:
        """Advance computed counts, offer newly full blocks to the prefix cache, and append the tokens
        sampled for the step's sequences (a sequence missing from `sampled` gets none yet)."""
        for item in output.scheduled:
            seq = seqs[item.seq_id]
            seq.num_computed_tokens += item.num_new_tokens
            self.block_manager.cache_full_blocks(seq)
            if item.seq_id in sampled:
                seq.output_token_ids.append(sampled[item.seq_id])

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and return its blocks (in both pools) now."""
        queue = {
            SequenceStatus.RUNNING: self.running,
            SequenceStatus.WAITING: self.waiting,
            SequenceStatus.SWAPPED: self.swapped,
        }.get(seq.status)
        if queue is not None:
            queue.remove(seq)
        seq.status = SequenceStatus.FINISHED
        self.block_manager.free(seq.seq_id)
