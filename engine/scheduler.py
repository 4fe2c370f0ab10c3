"""Iteration-level scheduler: decides, every step, which sequences run and how many tokens each.

Running sequences go first (so decodes are never starved by long prompts), then waiting sequences
are admitted into the remaining token budget, seat count and free KV blocks. A prompt that does
not fit the budget is split across steps (chunked prefill), so prefill chunks and decode tokens share
a step. When a running sequence cannot get a block, the lowest-priority, newest running sequence is
preempted by recompute: its blocks are freed and it re-queues with its original place in line.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from engine.block_manager import BlockManager
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
    preempted: tuple[int, ...]  # seq ids sent back to the waiting queue this step

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        # Both queues are kept sorted by Sequence.schedule_key (priority, then arrival).
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=lambda s: s.schedule_key)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSequence] = []
        preempted: list[int] = []

        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_new = min(seq.num_uncomputed_tokens, budget)
            if not self._make_room(seq, seq.num_computed_tokens + num_new, preempted):
                break  # seq itself was preempted; everything after it already was too
            scheduled.append(self._schedule_one(seq, num_new))
            budget -= num_new
            index += 1

        # Admitting new work right after preempting would only evict it again next step.
        if not preempted:
            while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
                seq = self.waiting[0]
                num_new = min(seq.num_uncomputed_tokens, budget)
                if num_new < seq.num_uncomputed_tokens and not self.config.enable_chunked_prefill:
                    break
                if not self.block_manager.can_grow(seq.seq_id, seq.num_computed_tokens + num_new):
                    break
                self.waiting.pop(0)
                seq.status = SequenceStatus.RUNNING
                bisect.insort(self.running, seq, key=lambda s: s.schedule_key)
                scheduled.append(self._schedule_one(seq, num_new))
                budget -= num_new

        return SchedulerOutput(scheduled=tuple(scheduled), preempted=tuple(preempted))

    def _make_room(self, seq: Sequence, num_tokens: int, preempted: list[int]) -> bool:
        """Free blocks by preempting from the back of the running queue until `seq` can hold
        `num_tokens`. Returns False if `seq` itself had to go."""
        while not self.block_manager.can_grow(seq.seq_id, num_tokens):
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim.seq_id)
            if victim is seq:
                return False
        return True

    def _schedule_one(self, seq: Sequence, num_new: int) -> ScheduledSequence:
        start = seq.num_computed_tokens
        self.block_manager.grow(seq.seq_id, start + num_new)
        return ScheduledSequence(
            seq_id=seq.seq_id,
            start_position=start,
            token_ids=tuple(seq.token_ids_slice(start, start + num_new)),
            block_table=tuple(self.block_manager.block_table(seq.seq_id)),
            needs_sample=start + num_new == seq.num_tokens,
        )

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq.seq_id)
        seq.num_computed_tokens = 0
        self.num_preemptions += 1
        self.add(seq)

    def update(self, output: SchedulerOutput, sampled: dict[int, int], seqs: dict[int, Sequence]) -> None:
        """Advance computed counts and append the tokens sampled for the step's sequences."""
        for item in output.scheduled:
            seq = seqs[item.seq_id]
            seq.num_computed_tokens += item.num_new_tokens
            if item.needs_sample:
                seq.output_token_ids.append(sampled[item.seq_id])

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and return its blocks to the pool now."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        self.block_manager.free(seq.seq_id)
