"""Prompt log-probs (`SamplingParams.prompt_logprobs`): how likely the model found each prompt token given the ones
before it, read off the prefill's hidden states.

A prefill computes hidden states for every prompt position but samples only from the last; a sequence that asks
for its prompt's log-probs also gets the logits of the others (the scheduler names the tokens they predict, and
keeps such a prompt out of the prefix cache so every position is computed). The logits go through the output
projection a bounded number of rows at a time, so a long prompt's [tokens, vocab] float32 never exists whole.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from engine.scheduler import ScheduledSequence
from engine.transfer import to_device

# Positions whose logits exist at once: with a 150k vocabulary, 256 rows of float32 logits are 150 MiB.
ROWS_PER_PROJECTION = 256


@dataclass
class PromptLogprobs:
    """One step's prompt-token log-probs of one sequence, in float32 of the raw logits."""

    first_position: int  # the prompt position of the first token scored
    token_logprobs: list[float]  # each scored token's own log-prob
    top: list[dict[int, float]]  # each position's top alternatives: token id -> log-prob


@dataclass
class PromptLogprobsRecord:
    """A request's prompt log-probs so far: per prompt position, token id -> log-prob (its own token, then the top
    alternatives); the first position has None (nothing predicts it). Grows as the prefill's chunks compute."""

    positions: list[dict[int, float] | None] = field(default_factory=lambda: [None])

    def record(self, prompt_token_ids: Sequence[int], scored: PromptLogprobs) -> None:
        """Append a chunk's prompt log-probs. A prompt recomputed after preemption scores its positions again:
        those already recorded are kept."""
        recorded = self.positions
        assert scored.first_position <= len(recorded), "prompt log-probs skipped a position"
        for offset in range(len(recorded) - scored.first_position, len(scored.token_logprobs)):
            position = scored.first_position + offset
            recorded.append({prompt_token_ids[position]: scored.token_logprobs[offset], **scored.top[offset]})


def score_prompts(
    compute_logits: Callable[[torch.Tensor], torch.Tensor | None],
    hidden: torch.Tensor,
    scheduled: Sequence[ScheduledSequence],
    query_start_loc: Sequence[int],
) -> dict[int, PromptLogprobs]:
    """Seq id -> its prompt log-probs of this step, for the scheduled sequences that name prompt tokens to score.
    `compute_logits` (the model's: hidden [N, hidden] -> logits [N, vocab]) is a collective under tensor
    parallelism: every rank calls it as often, with the same rows, and only the first gets logits (and a result);
    the others get an empty dict."""
    rows: list[int] = []
    targets: list[int] = []
    for item, start in zip(scheduled, query_start_loc):
        rows.extend(range(start, start + len(item.prompt_logprob_targets)))
        targets.extend(item.prompt_logprob_targets)
    if not rows:
        return {}
    top_k = max(item.prompt_top_logprobs for item in scheduled)
    chosen_parts, top_value_parts, top_id_parts = [], [], []
    for begin in range(0, len(rows), ROWS_PER_PROJECTION):
        index = to_device(rows[begin : begin + ROWS_PER_PROJECTION], torch.int64, hidden.device)
        logits = compute_logits(hidden[index])
        if logits is None:  # a tensor-parallel rank other than the first
            continue
        logprobs = logits.float().log_softmax(dim=-1)
        target = to_device(targets[begin : begin + ROWS_PER_PROJECTION], torch.int64, logprobs.device)
        chosen_parts.append(logprobs.gather(1, target[:, None])[:, 0])
        if top_k:
            values, ids = logprobs.topk(top_k, dim=-1)
            top_value_parts.append(values)
            top_id_parts.append(ids)
    if not chosen_parts:
        return {}
    chosen = torch.cat(chosen_parts).tolist()
    top_values = torch.cat(top_value_parts).tolist() if top_k else [[]] * len(rows)
    top_ids = torch.cat(top_id_parts).tolist() if top_k else [[]] * len(rows)
    scored: dict[int, PromptLogprobs] = {}
    offset = 0
    for item in scheduled:
        count = len(item.prompt_logprob_targets)
        if not count:
            continue
        wanted = item.prompt_top_logprobs
        span = range(offset, offset + count)
        scored[item.seq_id] = PromptLogprobs(
            first_position=item.start_position + 1,
            token_logprobs=[chosen[row] for row in span],
            top=[dict(zip(top_ids[row][:wanted], top_values[row][:wanted])) for row in span],
        )
        offset += count
    return scored
