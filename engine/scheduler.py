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

Admission order (`prefix_aware_ordering`, on by default): priority first; within a priority, the
waiting prompts with the longest cached prefix go first (SGLang's longest-prefix-match), then arrival
order. One document's questions are therefore admitted while the document is still in the cache,
instead of in arrival order after it was evicted. A prompt whose next prefix block another sequence
computes this step is passed over for one step (it will find it cached), and the oldest waiting
request of the top priority is overtaken at most `prefix_ordering_max_overtakes` times before it
goes first, so nothing starves.

`scheduling_policy = "static"` is the baseline continuous batching is measured against: a batch is
admitted only once the previous one has wholly finished (its seats stay empty as members finish).
With `lookahead_admission_steps`, a prompt whose chunk does not fit the free blocks computes the
part that fits, when decoding sequences that reach max_tokens within that many steps will release
the rest; a prompt part-way through such a prefill waits for them rather than preempting anyone.

LongRoPE (Phi-3's 128k models) rotates a sequence with its short factors while it has at most
`long_rope_threshold` tokens and with its long factors, at every position, beyond: transformers' own
generation recomputes the whole sequence once, when it grows past the threshold, and so does this scheduler.
Cached K/V cannot be re-rotated instead: every layer above the first was computed from attention outputs of
the short rotation. A sequence's table is fixed when its computation starts (`Sequence.long_rope`, sent to
the runner with each scheduled chunk, so a prompt longer than the threshold is long from its first chunk);
a running or swapped sequence whose cache no longer matches its length is sent back to wait and recomputed
(`SchedulerCounters.long_rope_recomputes`), at most once in its life.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.adapter_slots import AdapterSlots
from engine.block_manager import BlockManager, BlockPairs
from engine.config import EngineConfig
from engine.multimodal.inputs import PlacedImage, images_within
from engine.multimodal.positions import position_shift
from engine.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class ScheduledSequence:
    seq_id: int
    start_position: int  # position of the first new token (= tokens already in the cache)
    token_ids: tuple[int, ...]  # the tokens computed this step
    block_table: tuple[int, ...]  # covers start_position + len(token_ids) tokens
    needs_sample: bool  # this step reaches the sequence's last known token, so it yields a new one
    long_rope: bool = False  # rotate with LongRoPE's long factors (Sequence.long_rope)
    # Prompt log-probs (SamplingParams.prompt_logprobs): the prompt tokens this step's logits predict, one per
    # computed position up to the prompt's last but one; empty when not asked for. With how many alternatives each.
    prompt_logprob_targets: tuple[int, ...] = ()
    prompt_top_logprobs: int = 0
    adapter_slot: int = -1  # the device slot of its LoRA adapter (SamplingParams.adapter); -1: the base model
    images: tuple[PlacedImage, ...] = ()  # the prompt images whose placeholders this chunk computes
    # How many positions earlier than its index the chunk's first token sits: the prompt's images before it with
    # grid positions (M-RoPE) took fewer positions than placeholders (engine/multimodal/positions.py); 0 otherwise.
    position_shift: int = 0

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
    adapter_loads: tuple[tuple[int, str], ...] = ()  # (slot, adapter name): LoRA weights to copy in before the step
    num_batched_tokens: int = 0  # tokens computed this step: the scheduled chunks' lengths summed

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
    long_rope_recomputes: int = 0  # sequences recomputed on growing past LongRoPE's threshold


def _whole_images(seq: Sequence, num_new: int, start: int | None = None) -> int:
    """How many of `num_new` tokens from `start` (its computed count) `seq` may compute in one chunk: a chunk never
    ends inside an image whose placeholders attend to each other (PlacedImage.bidirectional), where a later chunk
    would find the image's first rows computed without seeing its last. It stops before such an image, or computes
    nothing this step when it starts inside one it cannot finish (LLMEngine refuses an image longer than a step)."""
    start = seq.num_computed_tokens if start is None else start
    stop = start + num_new
    for image in seq.images:
        if image.bidirectional and image.offset < stop < image.stop:
            return max(0, image.offset - start)
    return num_new


def _schedule_key(seq: Sequence) -> tuple[int, int]:
    """Sort key of every queue: smaller runs earlier (priority, then arrival); the largest is the first victim."""
    return (seq.priority, seq.arrival_order)


def _priority(seq: Sequence) -> int:
    return seq.priority


def _victim_by_recency(seq: Sequence) -> tuple[int, int, int]:
    """The largest key is preempted first: lowest priority, least recently scheduled, newest."""
    return (seq.priority, -seq.last_scheduled_step, seq.arrival_order)


def _victim_by_least_work(seq: Sequence) -> tuple[int, int, int]:
    """The largest key is preempted first: lowest priority, fewest computed tokens, newest."""
    return (seq.priority, -seq.num_computed_tokens, seq.arrival_order)


_VICTIM_KEYS: dict[str, Callable[[Sequence], tuple[int, int, int]]] = {
    "recency": _victim_by_recency,
    "least_work": _victim_by_least_work,
}


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, long_rope_threshold: int | None = None) -> None:
        """`long_rope_threshold`: the model's `ModelConfig.long_rope_threshold` (LongRoPE); None for other models."""
        self.config = config
        self.block_manager = block_manager
        self.long_rope_threshold = long_rope_threshold
        # All queues are kept sorted by _schedule_key (priority, then arrival).
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self.counters = SchedulerCounters()
        self._watermark_blocks = int(config.admission_watermark * block_manager.num_blocks)
        self._step = 0
        self._blocks_in_flight: set[bytes] = set()  # prefix-cache names of the full blocks this step computes
        self._victim_key = _VICTIM_KEYS[config.preemption_victim]
        self._batch_open = True  # static policy: the current batch still takes members
        self._head: Sequence | None = None  # the oldest waiting request of the top priority
        self._head_overtakes = 0  # requests admitted before it since it became the head
        self.adapter_slots = AdapterSlots(config.max_loras)
        self._adapter_loads: list[tuple[int, str]] = []  # this step's

    def add(self, seq: Sequence) -> None:
        """Queue a sequence with nothing computed (new, or to recompute)."""
        seq.status = SequenceStatus.WAITING
        self._take_rope_table(seq)
        bisect.insort(self.waiting, seq, key=_schedule_key)

    def _wants_long_rope(self, seq: Sequence) -> bool:
        return self.long_rope_threshold is not None and seq.num_tokens > self.long_rope_threshold

    def _take_rope_table(self, seq: Sequence) -> None:
        """A sequence with nothing computed takes the rotary table its length asks for (LongRoPE)."""
        long_rope = self._wants_long_rope(seq)
        if long_rope != seq.long_rope:  # its prefix-cache names were those of the other table
            seq.long_rope, seq.block_hashes = long_rope, []

    def _recompute(self, seq: Sequence) -> None:
        """Drop the sequence's K/V (in both pools) and queue it to compute again from its tokens."""
        self.block_manager.free(seq.seq_id)
        seq.num_computed_tokens = 0
        self.add(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def schedule(self) -> SchedulerOutput:
        self._step += 1
        self._blocks_in_flight.clear()
        self._adapter_loads = []
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSequence] = []
        preempted: list[int] = []
        swap_out: BlockPairs = []
        swap_in: BlockPairs = []
        releasable = self._blocks_released_soon()
        static = self.config.scheduling_policy == "static"
        if static and not self.running and not self.swapped:
            self._batch_open = True

        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            if seq.long_rope != self._wants_long_rope(seq):  # grew past LongRoPE's threshold: admitted again below
                self.running.remove(seq)
                self._recompute(seq)
                self.counters.long_rope_recomputes += 1
                continue
            num_new = _whole_images(seq, min(seq.num_uncomputed_tokens, budget))
            if num_new == 0:  # a beam waiting for its siblings' logits, or an image that needs more budget
                index += 1
                continue
            num_new = _whole_images(seq, self._make_room(seq, index, num_new, releasable, preempted, swap_out))
            if num_new:
                scheduled.append(self._schedule_one(seq, num_new))
                budget -= num_new
            if seq.status is SequenceStatus.RUNNING:
                index += 1

        # Admitting work right after preempting would only evict it again next step.
        if not preempted and self._batch_open:
            budget, passed_over = self._admit_queued(budget, scheduled, swap_in, releasable)
            # A static batch closes once admission stopped for want of seats, memory or requests (not
            # budget, nor a prompt passed over for a prefix block computed this step: they join next step).
            if static and budget > 0 and not passed_over:
                self._batch_open = False

        if not scheduled and not preempted and self.running and (self.swapped or self.waiting):
            # Every running sequence is a beam parked until a sibling computes, and that sibling cannot
            # get back in: make room, one parked beam per step, or the request never advances.
            victim = max(self.running, key=self._victim_key)
            self.running.remove(victim)
            self._preempt(victim, swap_out)
            preempted.append(victim.seq_id)

        return SchedulerOutput(
            scheduled=tuple(scheduled),
            preempted=tuple(preempted),
            blocks_to_swap_out=tuple(swap_out),
            blocks_to_swap_in=tuple(swap_in),
            blocks_to_copy=tuple(self.block_manager.take_copies()),
            adapter_loads=tuple(self._adapter_loads),
            num_batched_tokens=sum(item.num_new_tokens for item in scheduled),
        )

    def _make_room(
        self, seq: Sequence, index: int, num_new: int, releasable: int, preempted: list[int], swap_out: BlockPairs
    ) -> int:
        """How many of its next `num_new` tokens `seq` computes this step, preempting until they fit.
        Victims come from the sequences not yet scheduled this step (those after `index`); `seq`
        itself goes last. With blocks about to be released (lookahead), a prompt computes only what
        fits, possibly nothing this step, instead of preempting. Returns 0 if `seq` was preempted."""
        manager = self.block_manager
        start = seq.num_computed_tokens

        def fits() -> bool:
            return manager.can_allocate(manager.num_blocks_needed(seq.seq_id, start, start + num_new))

        if releasable and num_new > 1 and not fits():
            return min(num_new, manager.num_writable_tokens(seq.seq_id, start))
        while not fits():
            candidates = self.running[index + 1 :]
            victim = max(candidates, key=self._victim_key) if candidates else seq
            self.running.remove(victim)
            self._preempt(victim, swap_out)
            preempted.append(victim.seq_id)
            if victim is seq:
                return 0
        return num_new

    def _blocks_released_soon(self) -> int:
        """Blocks that decoding sequences hand back within `lookahead_admission_steps` steps because
        they reach max_tokens by then (they may stop sooner, never later); 0 when lookahead is off."""
        horizon = self.config.lookahead_admission_steps
        if not horizon:
            return 0
        return sum(
            self.block_manager.num_exclusive_blocks(seq.seq_id)
            for seq in self.running
            if seq.params.max_tokens is not None
            and seq.output_token_ids
            and seq.num_uncomputed_tokens == 1
            and seq.params.max_tokens - len(seq.output_token_ids) <= horizon
        )

    def _preempt(self, seq: Sequence, swap_out: BlockPairs) -> None:
        manager = self.block_manager
        num_blocks = manager.num_held_blocks(seq.seq_id)
        fits_bandwidth = len(swap_out) + num_blocks <= self.config.max_swap_blocks_per_step
        if self.config.preemption_mode == "swap" and fits_bandwidth and manager.can_swap_out(seq.seq_id):
            swap_out.extend(manager.swap_out(seq.seq_id))
            seq.status = SequenceStatus.SWAPPED
            bisect.insort(self.swapped, seq, key=_schedule_key)
            self.counters.preemptions["swap"] += 1
            self.counters.blocks_swapped_out += num_blocks
            return
        self._recompute(seq)
        self.counters.preemptions["recompute"] += 1

    def _admit_queued(
        self, budget: int, scheduled: list[ScheduledSequence], swap_in: BlockPairs, releasable: int
    ) -> tuple[int, bool]:
        """Admit swapped and waiting sequences, in admission order, until seats, budget or memory run
        out. Returns the budget left and whether a prompt was passed over for a prefix block this
        step computes."""
        passed_over = False
        adapters = self._running_adapters()
        for seq in self._admission_order():
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            adapter = seq.params.adapter
            if adapter is not None and adapter not in adapters and len(adapters) >= self.adapter_slots.num_slots:
                continue  # every slot holds an adapter with running sequences: it waits for one to go idle
            if seq.num_uncomputed_tokens == 0:
                # A beam parked in the host pool until its siblings compute: swapping it in would
                # only take the blocks they need (and be swapped out again). It returns once its
                # request advances and it has a token to compute.
                continue
            num_new = self._admit(seq, budget, swap_in, releasable)
            if num_new is None:
                passed_over = True
                continue
            if num_new == 0:  # head-of-line: a later, smaller request does not jump a large one for memory
                break
            if self._head is not None and seq is not self._head and seq.priority == self._head.priority:
                self._head_overtakes += 1
            if adapter is not None:
                adapters.add(adapter)
            scheduled.append(self._schedule_one(seq, num_new))
            budget -= num_new
        return budget, passed_over

    def _running_adapters(self) -> set[str]:
        """The LoRA adapters of the running sequences: resident, and not to be evicted."""
        return {seq.params.adapter for seq in self.running if seq.params.adapter is not None}

    def _admission_order(self) -> list[Sequence]:
        """Swapped and waiting sequences in the order admission tries them: priority first; then
        arrival, or, with prefix-aware ordering, the longest cached prefix first (swapped ones, which
        hold their KV, ahead of waiting ones of the same priority)."""
        if not (self.config.prefix_aware_ordering and self.block_manager.prefix_cache is not None and self.waiting):
            return list(heapq.merge(self.swapped, self.waiting, key=_schedule_key))
        head = self.waiting[0]
        if head is not self._head:
            self._head, self._head_overtakes = head, 0
        head_first = self._head_overtakes >= self.config.prefix_ordering_max_overtakes
        cached_prefix = self._usable_prefix

        def rank(seq: Sequence) -> tuple[int, bool, int, int]:
            return (seq.priority, not (head_first and seq is head), -len(cached_prefix(seq)), seq.arrival_order)

        window = self.config.prefix_ordering_window
        waiting = sorted(self.waiting[:window], key=rank) + self.waiting[window:]
        return list(heapq.merge(self.swapped, waiting, key=_priority))

    def _admit(self, seq: Sequence, budget: int, swap_in: BlockPairs, releasable: int) -> int | None:
        """Move `seq` into the running batch if it fits, keeping the watermark free. Returns the
        number of tokens to compute for it this step: 0 if it does not fit, None if its next prefix
        block is being computed this step (nothing changed in either case)."""
        manager = self.block_manager
        size = manager.block_size
        # With nothing running no burst can preempt anything, and the reserve must not lock out a
        # sequence that needs the whole pool.
        reserve = self._watermark_blocks if self.running else 0
        if seq.long_rope != self._wants_long_rope(seq):  # a queued beam its request's step grew past LongRoPE's threshold
            if seq.status is SequenceStatus.SWAPPED:  # its host copy is of the short table: it computes again, below
                self.swapped.remove(seq)
                self._recompute(seq)
                self.counters.long_rope_recomputes += 1
            else:
                self._take_rope_table(seq)
        if seq.status is SequenceStatus.SWAPPED:
            num_host = manager.num_host_blocks_of(seq.seq_id)
            num_new = _whole_images(seq, min(seq.num_uncomputed_tokens, budget))
            if num_new == 0:
                return 0
            stop = seq.num_computed_tokens + num_new
            num_needed = manager.num_blocks_to_swap_in(seq.seq_id, stop)
            if len(swap_in) + num_host > self.config.max_swap_blocks_per_step:
                return 0
            if not manager.can_allocate(num_needed, reserve=reserve):
                return 0
            self.swapped.remove(seq)
            swap_in.extend(manager.swap_in(seq.seq_id))
            self.counters.blocks_swapped_in += num_host
        else:
            cached = self._usable_prefix(seq)
            reusable = min((seq.num_tokens - 1) // size, len(seq.block_hashes))  # no hashes: caching is off
            if len(cached) < reusable and seq.block_hashes[len(cached)] in self._blocks_in_flight:
                # Another sequence with the same prefix computes its next block this step: next step
                # it finds it cached, instead of computing it a second time.
                return None
            num_cached = len(cached) * size
            num_new = _whole_images(seq, min(seq.num_tokens - num_cached, budget), num_cached)
            if num_new == 0 or (num_new < seq.num_tokens - num_cached and not self.config.enable_chunked_prefill):
                return 0
            num_needed = manager.num_blocks_needed(seq.seq_id, num_cached, num_cached + num_new, cached)
            if not manager.can_allocate(num_needed, cached, reserve=reserve):
                # Lookahead: start the prompt in the blocks free now when the rest is about to be released.
                writable = manager.num_writable_tokens(seq.seq_id, num_cached, cached, reserve)
                lookahead = self.config.enable_chunked_prefill and writable > 0 and releasable > 0
                if not (lookahead and num_needed <= writable // size + releasable):
                    return 0
                num_new = _whole_images(seq, min(num_new, writable), num_cached)
                if num_new == 0:
                    return 0
            self.waiting.remove(seq)
            manager.allocate(seq.seq_id, num_cached, num_cached + num_new, cached)
            seq.num_computed_tokens = num_cached
            if seq.num_cached_tokens is None:  # a recomputed victim's own blocks are not a cache hit of the request
                seq.num_cached_tokens = num_cached
            if manager.prefix_cache is not None:
                self.counters.prefix_cache_queried_tokens += seq.num_tokens
                self.counters.prefix_cache_hit_tokens += num_cached
        seq.status = SequenceStatus.RUNNING
        bisect.insort(self.running, seq, key=_schedule_key)
        return num_new

    def _usable_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks `seq` may start from: none when it needs its prompt's logits (prompt_logprobs).
        Computing its prompt whole is simpler than keeping log-probs beside the cached blocks, and costs only
        the requests that ask for them."""
        return [] if seq.needs_prompt_logits else self.block_manager.cached_prefix(seq)

    def _schedule_one(self, seq: Sequence, num_new: int) -> ScheduledSequence:
        start = seq.num_computed_tokens
        stop = start + num_new
        self.block_manager.allocate(seq.seq_id, start, stop)
        seq.last_scheduled_step = self._step
        size = self.block_manager.block_size
        self._blocks_in_flight.update(seq.block_hashes[start // size : stop // size])
        # Position p's logits predict token p + 1: this chunk scores the prompt tokens after each of its positions.
        targets = tuple(seq.prompt_token_ids[start + 1 : stop + 1]) if seq.needs_prompt_logits else ()
        adapter_slot = -1
        if seq.params.adapter is not None:
            adapter_slot, load = self.adapter_slots.slot_for(seq.params.adapter, self._running_adapters)
            if load:
                self._adapter_loads.append((adapter_slot, seq.params.adapter))
        return ScheduledSequence(
            seq_id=seq.seq_id,
            start_position=start,
            token_ids=tuple(seq.token_ids_slice(start, stop)),
            block_table=tuple(self.block_manager.block_table(seq.seq_id)),
            needs_sample=stop == seq.num_tokens,
            long_rope=seq.long_rope,
            prompt_logprob_targets=targets,
            prompt_top_logprobs=(seq.params.prompt_logprobs or 0) if targets else 0,
            adapter_slot=adapter_slot,
            images=images_within(seq.images, start, stop) if seq.images else (),
            position_shift=position_shift(seq.images, start) if seq.images else 0,
        )

    def update(self, output: SchedulerOutput, seqs: list[Sequence], forks: list[tuple[Sequence, Sequence]],
               finished: list[Sequence]) -> None:
        """A step's consequences, told once by engine/requests.py (which appends the tokens and decides forks and
        finishes): the scheduled `seqs` (in `output.scheduled`'s order) advance their computed counts, each (parent,
        child) of `forks` joins its parent, the `finished` leave their queues; then one block-manager call does the
        blocks (a parent among the finished, its first token a stop, is forked before it is freed)."""
        for item, seq in zip(output.scheduled, seqs):
            seq.num_computed_tokens += item.num_new_tokens
        sharing = [(parent, child) for parent, child in forks if self._queue_fork(parent, child)]
        for seq in finished:
            self._dequeue(seq)
        self.block_manager.update(seqs, sharing, finished)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Queue `child`, a new sample whose tokens are parent's computed ones plus one more (see `_queue_fork`)."""
        if self._queue_fork(parent, child):
            self.block_manager.fork(parent, child)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and return its blocks (in both pools) now."""
        self._dequeue(seq)
        self.block_manager.free(seq.seq_id)

    def _queue_fork(self, parent: Sequence, child: Sequence) -> bool:
        """Queue a forked `child`. Beside a running parent it runs at once on parent's blocks (True: the caller has
        the block manager share them); a parent parked in the host pool or preempted (a beam) leaves the child to
        compute, from the prefix cache (False)."""
        if parent.status is not SequenceStatus.RUNNING:
            self.add(child)
            return False
        child.num_computed_tokens = parent.num_computed_tokens
        child.last_scheduled_step, child.status = parent.last_scheduled_step, SequenceStatus.RUNNING
        bisect.insort(self.running, child, key=_schedule_key)
        return True

    def _dequeue(self, seq: Sequence) -> None:
        queue = {
            SequenceStatus.RUNNING: self.running,
            SequenceStatus.WAITING: self.waiting,
            SequenceStatus.SWAPPED: self.swapped,
        }.get(seq.status)
        if queue is not None:
            queue.remove(seq)
        seq.status = SequenceStatus.FINISHED
