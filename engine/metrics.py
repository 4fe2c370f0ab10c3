"""Engine telemetry: counters updated each step, and a snapshot of the KV pool and the queues.

Plain data for whoever exports it (the worker's Prometheus endpoint later). Counters only grow; the
snapshot is computed on demand, off the step's hot path.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass
class StepCounters:
    """Cumulative since the engine started, except the last_* fields."""

    steps: int = 0
    step_seconds: float = 0.0  # wall time spent in step()
    prompt_tokens_computed: int = 0  # prompt positions computed (recomputation after preemption counts again)
    generation_tokens: int = 0  # tokens sampled
    batched_tokens: int = 0  # positions computed: prefill chunks + decodes
    requests_finished: int = 0  # finished or aborted
    last_step_seconds: float = 0.0
    last_step_tokens: int = 0  # tokens computed in the last step: prefill chunks + decodes
    last_step_sequences: int = 0  # the effective batch size of the last step

    def snapshot(self) -> "StepCounters":
        return replace(self)


@dataclass(frozen=True)
class EngineStats:
    counters: StepCounters
    num_running: int
    num_waiting: int
    num_swapped: int
    preemptions: dict[str, int]  # cumulative, by mode: "swap", "recompute"
    block_size: int  # tokens per KV block
    kv_blocks_total: int
    kv_blocks_used: int  # held by at least one sequence
    kv_blocks_cached: int  # held by nobody but kept for the prefix cache (evicted when needed)
    kv_slots_unused: int  # empty slots in the blocks held by running sequences (internal fragmentation)
    host_blocks_total: int  # the swap pool
    host_blocks_used: int
    blocks_swapped_out: int  # cumulative
    blocks_swapped_in: int  # cumulative
    swap_bytes: int  # cumulative bytes moved between the pools, both directions
    swap_seconds: float  # cumulative wall time of those moves
    prefix_cache_queried_tokens: int  # cumulative prompt tokens looked up at admission
    prefix_cache_hit_tokens: int  # of those, found in the cache and not computed

    @property
    def kv_blocks_free(self) -> int:
        """Blocks available to allocate, cached ones included (they are evicted on demand)."""
        return self.kv_blocks_total - self.kv_blocks_used

    @property
    def kv_utilization(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total

    @property
    def kv_fragmentation(self) -> float:
        """Share of the slots in used blocks that hold no token."""
        return self.kv_slots_unused / max(1, self.kv_blocks_used * self.block_size)

    @property
    def swap_bytes_per_second(self) -> float:
        return self.swap_bytes / self.swap_seconds if self.swap_seconds else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hit_tokens / max(1, self.prefix_cache_queried_tokens)

    @property
    def mean_tokens_per_step(self) -> float:
        return self.counters.batched_tokens / max(1, self.counters.steps)

    @property
    def mean_step_seconds(self) -> float:
        return self.counters.step_seconds / max(1, self.counters.steps)
