"""A request's state in the engine, as plain data: the request, its samples, the step's batch. Written only by
engine/requests.py, which owns it; each feature's part is a small type (`Sample` per sequence, `BeamSearch`,
`PromptLogprobsRecord`, the grammar's future)."""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from engine.beam_search import BeamSearch
from engine.detokenizer import IncrementalDetokenizer
from engine.multimodal.inputs import PlacedImage
from engine.outputs import FinishReason
from engine.prompt_logprobs import PromptLogprobsRecord
from engine.sampler import SamplingRow
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

# The sampler's top alternatives of a step: (token ids, log-probs), each [row][rank]
TopLogprobs = tuple[list[list[int]], list[list[float]]]


@dataclass
class Sample:
    """One sequence of a request and what it produced so far."""

    seq: Sequence
    detokenizer: IncrementalDetokenizer | None  # only when text is needed before the end
    logprobs: list[dict[int, float]] | None
    matcher: Any = None  # xgrammar.GrammarMatcher: the parse state of a structured-output sample
    cumulative_logprob: float = 0.0
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool
    priority: int
    arrival_order: int
    base_seed: int  # sample i draws with base_seed + i
    samples: list[Sample] = field(default_factory=list)  # with beam search: the live beams, best first
    beams: BeamSearch | None = None
    grammar: Future[Any] | None = None  # structured output: its compiled grammar, maybe still compiling
    prompt_logprobs: PromptLogprobsRecord | None = None
    error: str | None = None  # why the request could not run (its constraint did not compile)
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    images: tuple[PlacedImage, ...] = ()  # its prompt images, placed among prompt_token_ids (every sample's)
    # Samples still to fork from the first when its prompt reaches its first token (n or best_of, less one);
    # 0 with beam search, whose beams fork as the search goes
    siblings_to_fork: int = 0


@dataclass(frozen=True)
class StepBatch:
    """A scheduled step as the requests see it: the sequences that sample, in schedule order, and the rows the
    sampler draws for them."""

    samples: list[Sample]
    requests: list[Request]  # each sample's
    fanout: list[int]  # rows per sample, consecutive: a prompt reaching its first token samples once per sample
    rows: list[SamplingRow]
    prompt_tokens: int  # prompt positions the step computes (a recomputed prompt counts again)

    @property
    def matchers(self) -> list[Any]:
        """Per row, its grammar matcher (None when unconstrained)."""
        return [sample.matcher for sample, count in zip(self.samples, self.fanout) for _ in range(count)]
