"""Admission: what one request may ask of the engine, checked before it is queued, and which request a failed
step is blamed on.

A request's cost is known before it runs: its prompt, how many sequences it runs at once (`n`, `best_of` or
`beam_width`), how many tokens each may generate, and so the KV blocks it can ever hold. A request whose cost
the engine could never pay (more sequences than any deployment should run for one request, more blocks than
the whole pool, a prompt that no step could schedule) is refused here with a clear error, so it fails alone
instead of making a step ask for memory that does not exist and taking every other request of that step down
with it.

`max_tokens` policy: a request without one runs until the model's remaining context (OpenAI's default), unless
the operator set `default_max_tokens`; an operator's `max_tokens_limit` caps both and refuses a larger
explicit value, so a small model that loops cannot generate for hours unnoticed.

A step that still fails (out of memory, a kernel error) raises `StepFailed` naming the costliest request of
that step: the engine loop aborts that request with the error and steps on with the others. A step that fails
because the engine itself can never step again (`EngineFailed`: a tensor-parallel rank died) is blamed on no
request: whoever drives the engine gives its requests' work back and replaces the engine.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from engine.sampling_params import SamplingParams


class AdmissionRefused(ValueError):
    """The request costs more than this engine admits; the message says which limit and how to fit it."""


@dataclass(frozen=True)
class AdmissionLimits:
    max_sequences_per_request: int  # n, best_of and beam_width may not exceed it
    max_model_len: int  # tokens per sequence, prompt included
    max_tokens_limit: int | None  # largest max_tokens admitted; None: whatever the context leaves
    default_max_tokens: int | None  # max_tokens of a request without one; None: the context left after the prompt
    num_kv_blocks: int  # the device pool: a request must fit it whole, every sequence at its longest
    block_size: int  # tokens per KV block
    # Blocks one sequence holds at most however long it grows, when every layer is windowed (blocks behind the
    # window are freed); None: a sequence holds its whole length.
    max_blocks_per_sequence: int | None
    max_prefill_tokens: int | None  # tokens one step computes when prompts cannot be chunked; None: chunked

    def resolve_max_tokens(self, prompt_tokens: int, requested: int | None) -> int:
        """The max_tokens a request runs with: the requested one if admitted, else the deployment default, never
        more than the context leaves after the prompt."""
        room = self.max_model_len - prompt_tokens
        if requested is not None:
            if self.max_tokens_limit is not None and requested > self.max_tokens_limit:
                raise AdmissionRefused(
                    f"max_tokens is {requested}; this deployment admits at most {self.max_tokens_limit}"
                )
            return requested
        default = room if self.default_max_tokens is None else min(self.default_max_tokens, room)
        return default if self.max_tokens_limit is None else min(default, self.max_tokens_limit)


def admit(prompt_tokens: int, params: SamplingParams, limits: AdmissionLimits) -> SamplingParams:
    """`params` with max_tokens resolved (see `AdmissionLimits.resolve_max_tokens`), or AdmissionRefused when the
    request could never run here."""
    sequences = params.num_sequences
    if sequences > limits.max_sequences_per_request:
        name = "beam_width" if params.use_beam_search else ("best_of" if params.best_of else "n")
        raise AdmissionRefused(
            f"{name} is {sequences}; this deployment runs at most {limits.max_sequences_per_request} sequences per "
            "request (n, best_of and beam_width)"
        )
    if limits.max_prefill_tokens is not None and prompt_tokens > limits.max_prefill_tokens:
        raise AdmissionRefused(
            f"the prompt has {prompt_tokens} tokens; without chunked prefill one step computes at most "
            f"{limits.max_prefill_tokens}"
        )
    max_tokens = limits.resolve_max_tokens(prompt_tokens, params.max_tokens)
    needed = blocks_needed(prompt_tokens, sequences, max_tokens, limits.block_size)
    if limits.max_blocks_per_sequence is not None:
        needed = min(needed, sequences * limits.max_blocks_per_sequence)
    if needed > limits.num_kv_blocks:
        raise AdmissionRefused(
            f"{sequences} sequence(s) of up to {prompt_tokens} + {max_tokens} tokens can need {needed} KV blocks; "
            f"this engine's cache holds {limits.num_kv_blocks} blocks of {limits.block_size} tokens. "
            "Lower n / best_of / beam_width or set a smaller max_tokens."
        )
    if max_tokens == params.max_tokens:
        return params
    return dataclasses.replace(params, max_tokens=max_tokens)


def blocks_needed(prompt_tokens: int, sequences: int, max_tokens: int, block_size: int) -> int:
    """KV blocks a request holds at its longest: the prompt's full blocks, shared by its sequences, plus each
    sequence's own copy of the prompt's last partial block and its generated tokens."""
    shared = prompt_tokens // block_size
    own = -(-(prompt_tokens % block_size + max_tokens) // block_size)
    return shared + sequences * own


def cost(prompt_tokens: int, params: SamplingParams) -> int:
    """Tokens the request can hold in the cache at once: how a failed step picks whom to blame."""
    return prompt_tokens + params.num_sequences * (params.max_tokens or 0)


class StepFailed(Exception):
    """An engine step raised. `request_id` is the costliest request in it, aborted first so the others continue."""

    def __init__(self, request_id: str, cause: BaseException) -> None:
        super().__init__(f"an engine step failed while running this request ({type(cause).__name__}: {cause}); "
                         "it was aborted so that the requests beside it could continue")
        self.request_id = request_id
        self.cause = cause


class EngineFailed(RuntimeError):
    """The engine can never step again (a tensor-parallel rank died or stopped answering). No request is to blame:
    every request in it is lost with it, and must be given back to be run by another engine, not recorded as failed.
    Defined here, beside `StepFailed`, so that job code can tell the two apart without importing the engine."""
