"""What the engine hands back: plain data, one RequestOutput per request."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

FinishReason = Literal["stop", "length", "abort"]


@dataclass
class CompletionOutput:
    index: int  # which of the request's n samples
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None  # None while still generating
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    logprobs: list[dict[int, float]] | None = None  # per generated token: sampled + top-N token id -> logprob
    cumulative_logprob: float = 0.0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt: str | None = None
    num_cached_tokens: int = 0  # prompt tokens read from the prefix cache instead of computed (OpenAI's cached_tokens)
    error: str | None = None  # why the request could not run (its structured-output constraint did not compile)
    # SamplingParams.prompt_logprobs: per prompt token, token id -> log-prob (its own, then the top alternatives);
    # None for the first token, which nothing predicts
    prompt_logprobs: list[dict[int, float] | None] | None = None
