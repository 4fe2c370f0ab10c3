"""A sequence: one sample of one request, the unit the scheduler and block manager work with."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from engine.multimodal.inputs import PlacedImage
from engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted with its KV parked in the host pool
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    sample_index: int  # which of the request's n samples this is
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # drives sampling; the same seed gives the same tokens whatever the batch mates
    priority: int = 0  # lower value = scheduled first (vLLM's convention)
    arrival_order: int = 0  # FCFS tie-break; kept across preemption so a victim keeps its place
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int | None = None  # prompt tokens the prefix cache held when first admitted; None: not yet
    status: SequenceStatus = SequenceStatus.WAITING
    last_scheduled_step: int = -1  # preemption prefers victims that waited longest for a step
    block_hashes: list[bytes] = field(default_factory=list)  # prefix-cache names of its full blocks
    # LongRoPE (Phi-3): its K/V are rotated with the long factors (it has more tokens than the model's threshold),
    # set by the scheduler whenever its computation starts; False for every other model
    long_rope: bool = False
    images: tuple[PlacedImage, ...] = ()  # the request's prompt images, placed among its prompt tokens

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def needs_prompt_logits(self) -> bool:
        """Its prompt's log-probs are asked for and the prompt is not computed yet: every prompt position's
        logits are needed, so nothing of it may come from the prefix cache."""
        return self.params.prompt_logprobs is not None and not self.output_token_ids

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def token_ids_slice(self, start: int, stop: int) -> list[int]:
        prompt_len = len(self.prompt_token_ids)
        if stop <= prompt_len:
            return self.prompt_token_ids[start:stop]
        if start >= prompt_len:
            return self.output_token_ids[start - prompt_len : stop - prompt_len]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - prompt_len]
