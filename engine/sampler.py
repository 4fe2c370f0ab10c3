"""Batched next-token sampling: penalties, min_tokens masking, greedy / temperature / top-k / top-p / min-p.

The hot path is a fixed handful of tensor ops over the whole batch; per-row Python work only builds the
small parameter tensors. Random draws come from a counter-based hash of (seed, step, token id) instead of
per-row torch.Generators, so all noise is made in one vectorised pass and a seeded row samples the same
token whatever else shares its batch and wherever it sits in it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.sampling_params import SamplingParams

_MASK32 = 0xFFFFFFFF
# Small enough (< 2**27) that a 32-bit value times it stays far inside int64: the hash never overflows.
_MIX_MULTIPLIER = 0x45D9F3B
# With top-p alone, first try a top-k of this width: the nucleus of a real LM distribution nearly always fits,
# which replaces a full-vocabulary sort by a cheap partial one. When it does not fit we sort everything.
_PREFILTER_WIDTH = 256


@dataclass
class SamplingRow:
    """One sequence that needs a next token this step."""

    params: SamplingParams
    seed: int  # the engine always supplies one (a random one when params.seed is None)
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # generated so far; its length is the step that keys the random draw
    eos_token_ids: Sequence[int]  # masked with stop_token_ids while output is shorter than min_tokens


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor  # [B] float32: each sampled token's log-prob under the raw (unprocessed) logits
    # ([B, K] int64 ids, [B, K] float32 log-probs) of the raw distribution, K = the largest `logprobs` asked
    # for in the batch; None when no row asked for at least one.
    top_logprobs: tuple[torch.Tensor, torch.Tensor] | None


class Sampler:
    """Picks one next token per row. Holds no state: every random draw is keyed by (seed, step, token id)."""

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        raw = logits.float()
        processed = process_logits(raw, rows)
        token_ids = _pick_tokens(processed, rows)
        return _with_logprobs(raw, token_ids, rows)


def process_logits(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Apply penalties, then min_tokens masking, in vLLM's order. Returns float32 logits.

    The input is never modified: when no row needs either step it comes back as is (converted to float32),
    otherwise as a new tensor.
    """
    repetition_rows = [i for i, row in enumerate(rows) if row.params.repetition_penalty != 1.0]
    count_rows = [
        i for i, row in enumerate(rows) if row.params.frequency_penalty != 0.0 or row.params.presence_penalty != 0.0
    ]
    min_tokens_rows = [i for i, row in enumerate(rows) if len(row.output_token_ids) < row.params.min_tokens]
    if not (repetition_rows or count_rows or min_tokens_rows):
        return logits.float()

    logits = logits.to(torch.float32, copy=True)
    if repetition_rows:
        _apply_repetition_penalty(logits, rows, repetition_rows)
    if count_rows:
        _apply_frequency_presence_penalties(logits, rows, count_rows)
    if min_tokens_rows:
        # vLLM masks eos here even with ignore_eos: ignore_eos only stops eos from ending the sequence.
        banned = [[*rows[i].params.stop_token_ids, *rows[i].eos_token_ids] for i in min_tokens_rows]
        row_index, token_index = _coordinates(min_tokens_rows, banned, logits.device)
        logits[row_index, token_index] = -math.inf
    return logits


def _apply_repetition_penalty(logits: torch.Tensor, rows: Sequence[SamplingRow], row_indices: list[int]) -> None:
    """Divide positive / multiply negative logits of every token seen in the prompt or output (in place)."""
    seen = [[*rows[i].prompt_token_ids, *rows[i].output_token_ids] for i in row_indices]
    row_index, token_index = _coordinates(row_indices, seen, logits.device)
    penalty = _row_values(rows, lambda p: p.repetition_penalty, logits.device)[row_index]
    values = logits[row_index, token_index]
    # A token seen twice is written twice with the same value, so duplicates are harmless.
    logits[row_index, token_index] = torch.where(values > 0, values / penalty, values * penalty)


def _apply_frequency_presence_penalties(
    logits: torch.Tensor, rows: Sequence[SamplingRow], row_indices: list[int]
) -> None:
    """OpenAI's formula over output tokens only: logit -= frequency * count + presence * (count > 0)."""
    outputs = [rows[i].output_token_ids for i in row_indices]
    row_index, token_index = _coordinates(row_indices, outputs, logits.device)
    vocab_size = logits.shape[-1]
    keys, counts = torch.unique(row_index * vocab_size + token_index, return_counts=True)
    row_index, token_index = keys // vocab_size, keys % vocab_size
    frequency = _row_values(rows, lambda p: p.frequency_penalty, logits.device)[row_index]
    presence = _row_values(rows, lambda p: p.presence_penalty, logits.device)[row_index]
    logits[row_index, token_index] -= frequency * counts + presence


def _coordinates(
    row_indices: list[int], token_lists: Sequence[Sequence[int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flatten per-row token lists into (row, token) index tensors for one scatter / gather."""
    lengths = torch.tensor([len(tokens) for tokens in token_lists], dtype=torch.int64)
    row_index = torch.repeat_interleave(torch.tensor(row_indices, dtype=torch.int64), lengths)
    token_index = torch.tensor(list(itertools.chain.from_iterable(token_lists)), dtype=torch.int64)
    return row_index.to(device), token_index.to(device)


def _row_values(
    rows: Sequence[SamplingRow], value: Callable[[SamplingParams], float], device: torch.device
) -> torch.Tensor:
    return torch.tensor([value(row.params) for row in rows], dtype=torch.float32, device=device)


def _pick_tokens(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    sampled_rows = [i for i, row in enumerate(rows) if not row.params.greedy]
    if not sampled_rows:
        return logits.argmax(dim=-1)
    if len(sampled_rows) == len(rows):
        return _sample(logits, rows)
    # argmax over the whole batch is cheaper than gathering the greedy rows out first.
    token_ids = logits.argmax(dim=-1)
    index = torch.tensor(sampled_rows, dtype=torch.int64, device=logits.device)
    token_ids[index] = _sample(logits[index], [rows[i] for i in sampled_rows])
    return token_ids


def _sample(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p, then one exponential-race draw per row."""
    vocab_size = logits.shape[-1]
    device = logits.device
    scaled = logits / _row_values(rows, lambda p: p.temperature, device)[:, None]
    top_k = [row.params.top_k if 0 < row.params.top_k < vocab_size else vocab_size for row in rows]
    top_p = [row.params.top_p for row in rows]
    log_min_p = _row_values(rows, lambda p: math.log(p.min_p) if p.min_p > 0 else -math.inf, device)[:, None]

    if all(k == vocab_size for k in top_k) and all(p == 1.0 for p in top_p):
        probs = scaled.softmax(dim=-1)
        below_min_p = scaled < scaled.amax(dim=-1, keepdim=True) + log_min_p
        probs.masked_fill_(below_min_p, 0.0)
        noise = _exponential_noise(_row_states(rows, device), None, vocab_size)
        return (probs / noise).argmax(dim=-1)

    candidate_logits, candidate_ids, probs = _top_k_top_p(scaled, top_k, top_p)
    below_min_p = candidate_logits < candidate_logits[:, :1] + log_min_p
    probs.masked_fill_(below_min_p, 0.0)
    # Every filter keeps a prefix of the descending candidates, so columns past the longest kept prefix are
    # all zero and need no noise.
    width = int((probs > 0).sum(dim=-1).max())
    probs, candidate_ids = probs[:, :width], candidate_ids[:, :width]
    noise = _exponential_noise(_row_states(rows, device), candidate_ids, vocab_size)
    choice = (probs / noise).argmax(dim=-1, keepdim=True)
    return candidate_ids.gather(1, choice).squeeze(1)


def _top_k_top_p(
    scaled: torch.Tensor, top_k: list[int], top_p: list[float]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Candidates in descending order as (logits, token ids, probs), probs zeroed outside top-k and top-p.

    As in vLLM, top-p sees the distribution renormalised over the top-k set. Top-p keeps the smallest
    prefix whose mass reaches top_p: a candidate is dropped once the mass before it is already >= top_p.
    """
    vocab_size = scaled.shape[-1]
    device = scaled.device
    k_tensor = torch.tensor(top_k, dtype=torch.int64, device=device)
    p_tensor = torch.tensor(top_p, dtype=torch.float32, device=device)
    has_top_k = k_tensor < vocab_size
    # Rows without top-k normalise over the whole vocabulary, so a partial candidate list still gives exact probs.
    full_log_norm = None if all(k < vocab_size for k in top_k) else scaled.logsumexp(dim=-1)
    row_widths = [k if k < vocab_size else _PREFILTER_WIDTH if p < 1.0 else vocab_size for k, p in zip(top_k, top_p)]
    width = min(vocab_size, max(row_widths))

    candidate_logits, candidate_ids, probs = _descending_candidates(scaled, width, k_tensor, has_top_k, full_log_norm)
    cumulative = probs.cumsum(dim=-1)
    nucleus_cut_off = ~has_top_k & (cumulative[:, -1] < p_tensor)
    if width < vocab_size and bool(nucleus_cut_off.any()):
        candidate_logits, candidate_ids, probs = _descending_candidates(
            scaled, vocab_size, k_tensor, has_top_k, full_log_norm
        )
        cumulative = probs.cumsum(dim=-1)
    probs.masked_fill_(cumulative - probs >= p_tensor[:, None], 0.0)
    return candidate_logits, candidate_ids, probs


def _descending_candidates(
    scaled: torch.Tensor,
    width: int,
    top_k: torch.Tensor,
    has_top_k: torch.Tensor,
    full_log_norm: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The `width` most likely tokens as (logits, ids, probs), logits past each row's top-k set to -inf."""
    if width < scaled.shape[-1]:
        candidate_logits, candidate_ids = scaled.topk(width, dim=-1)
    else:
        candidate_logits, candidate_ids = scaled.sort(dim=-1, descending=True)
    columns = torch.arange(width, device=scaled.device)
    candidate_logits = candidate_logits.masked_fill(columns >= top_k[:, None], -math.inf)
    log_norm = candidate_logits.logsumexp(dim=-1)
    if full_log_norm is not None:
        log_norm = torch.where(has_top_k, log_norm, full_log_norm)
    return candidate_logits, candidate_ids, (candidate_logits - log_norm[:, None]).exp()


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """32-bit integer hash (two multiply-xorshift rounds) on int64 values in [0, 2**32); returns a new tensor."""
    x = x ^ (x >> 16)
    x.mul_(_MIX_MULTIPLIER).bitwise_and_(_MASK32)
    x.bitwise_xor_(x >> 16)
    x.mul_(_MIX_MULTIPLIER).bitwise_and_(_MASK32)
    return x.bitwise_xor_(x >> 16)


def _row_states(rows: Sequence[SamplingRow], device: torch.device) -> torch.Tensor:
    """One 32-bit state per row from (seed, step); the step is the number of tokens generated so far."""
    seeds = [row.seed & 0xFFFF_FFFF_FFFF_FFFF for row in rows]  # Python ints may be negative or wider
    low = torch.tensor([seed & _MASK32 for seed in seeds], dtype=torch.int64, device=device)
    high = torch.tensor([seed >> 32 for seed in seeds], dtype=torch.int64, device=device)
    step = torch.tensor([len(row.output_token_ids) & _MASK32 for row in rows], dtype=torch.int64, device=device)
    return _mix32(_mix32(_mix32(low) ^ high) ^ step)


def _exponential_noise(states: torch.Tensor, token_ids: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """Exp(1) draws keyed by (row state, token id), shape [rows, tokens]; token_ids None means the whole vocab.

    argmax(probs / Exp) is an exact sample from probs (the exponential race, i.e. Gumbel-max).
    """
    token_keys = _mix32(torch.arange(vocab_size, dtype=torch.int64, device=states.device))
    keys = token_keys[None, :] if token_ids is None else token_keys[token_ids]
    bits = _mix32(keys ^ states[:, None])
    # 23 bits make (k + 0.5) / 2**23 exact in float32, so u is never rounded to 0 or 1 (Exp never 0 or inf).
    uniform = ((bits >> 9).float() + 0.5) * 2.0**-23
    return uniform.log_().neg_()


def _with_logprobs(raw: torch.Tensor, token_ids: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
    log_norm = raw.logsumexp(dim=-1)
    sampled_logprobs = raw.gather(1, token_ids[:, None]).squeeze(1) - log_norm
    top_n = max((row.params.logprobs or 0) for row in rows)
    top_logprobs = None
    if top_n > 0:
        values, ids = raw.topk(top_n, dim=-1)
        top_logprobs = (ids, values - log_norm[:, None])
    return SamplerOutput(token_ids=token_ids, logprobs=sampled_logprobs, top_logprobs=top_logprobs)
