"""Engine telemetry: counters updated each step, and a snapshot of the KV pool and the queues.

Plain data for whoever exports it (the worker's Prometheus endpoint later). Counters only grow; the
snapshot is computed on demand, off the step's hot path.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field, replace

# Bucket upper bounds in seconds. Batch requests may wait long in the queue before their first token.
STEP_SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
TIME_TO_FIRST_TOKEN_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
TIME_PER_OUTPUT_TOKEN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0)


@dataclass
class Histogram:
    """Observation counts per bucket, Prometheus-style (a value lands in the first bucket whose bound is >= it)."""

    bounds: tuple[float, ...]  # ascending upper bounds; one more bucket past the last catches the rest (+Inf)
    counts: list[int] = field(default_factory=list)  # per bucket, not cumulative
    total: float = 0.0  # sum of the observed values

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def snapshot(self) -> "Histogram":
        return Histogram(self.bounds, list(self.counts), self.total)


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
    last_step_context_tokens: int = 0  # context positions the last step's sequences attend to, summed
    step_time: Histogram = field(default_factory=lambda: Histogram(STEP_SECONDS_BUCKETS))
    # Per request: from add_request to its first sampled token.
    time_to_first_token: Histogram = field(default_factory=lambda: Histogram(TIME_TO_FIRST_TOKEN_BUCKETS))
    # Per finished request: (finish - first token) / (tokens - 1), so preemption stalls count too.
    time_per_output_token: Histogram = field(default_factory=lambda: Histogram(TIME_PER_OUTPUT_TOKEN_BUCKETS))

    def snapshot(self) -> "StepCounters":
        """A copy that later steps do not change (histograms included), for a reader on another thread."""
        return replace(
            self,
            step_time=self.step_time.snapshot(),
            time_to_first_token=self.time_to_first_token.snapshot(),
            time_per_output_token=self.time_per_output_token.snapshot(),
        )


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
    images_encoded: int = 0  # cumulative vision-encoder runs, per image (vision-language models)
    encoder_cache_hits: int = 0  # cumulative images a step found in the encoder-output cache instead

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
