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
    preemptions_recompute: int
    block_size: int  # tokens per KV block
    kv_blocks_total: int
    kv_blocks_used: int
    kv_slots_unused: int  # empty slots in the blocks held by running sequences (internal fragmentation)

    @property
    def kv_utilization(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total

    @property
    def kv_fragmentation(self) -> float:
        """Share of the slots in used blocks that hold no token."""
        return self.kv_slots_unused / max(1, self.kv_blocks_used * self.block_size)
