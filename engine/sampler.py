"""Batched next-token sampling: the grammar bitmask, logit_bias, penalties, min_tokens masking, greedy /
temperature / top-k / top-p / min-p.

The hot path is a fixed handful of tensor ops over the whole batch; per-row Python work only builds small
parameter tensors. Each sampled row draws with one uniform number from a counter-based hash of (seed, step)
instead of a per-row torch.Generator, so a seeded row picks the same token whatever else shares its batch and
wherever it sits in it, and the batch needs no per-token noise: the draw is an inverse-CDF lookup.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.sampling_params import SamplingParams
from engine.structured_output import apply_token_bitmask
from engine.transfer import to_device
from conveyor_kernels.cpu_kernels import greedy_sample

_MASK64 = 0xFFFF_FFFF_FFFF_FFFF
_GOLDEN_GAMMA = 0x9E37_79B9_7F4A_7C15  # SplitMix64's stream increment
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
    # [R, vocab] float32 log-softmax of the processed logits of the R beam-search rows, in row order:
    # beam search ranks whole distributions instead of drawing one token. None when no row is a beam.
    beam_logprobs: torch.Tensor | None = None


class Sampler:
    """Picks one next token per row. Holds no state: every random draw is keyed by (seed, step)."""

    def __init__(self, cpu_kernels: bool = False) -> None:
        self.cpu_kernels = cpu_kernels  # the grammar bitmask by conveyor_kernels/cpu_sampling.cpp (the model runs them too)

    def __call__(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow], token_bitmask: torch.Tensor | None = None
    ) -> SamplerOutput:
        """`token_bitmask`: [rows, ceil(vocab / 32)] int32, bit set = token allowed (structured output);
        None when no row is constrained."""
        if self.cpu_kernels and token_bitmask is None and _plain_greedy(logits, rows):
            token_ids, sampled_logprobs = greedy_sample(logits)
            return SamplerOutput(token_ids=token_ids, logprobs=sampled_logprobs, top_logprobs=None)
        raw = logits.float()
        processed = process_logits(raw, rows, token_bitmask, self.cpu_kernels)
        token_ids = _pick_tokens(processed, rows)
        output = _with_logprobs(raw, token_ids, rows)
        beam_rows = [i for i, row in enumerate(rows) if row.params.use_beam_search]
        if beam_rows:
            output.beam_logprobs = processed[to_device(beam_rows, torch.int64, processed.device)].log_softmax(dim=-1)
        return output


def process_logits(
    logits: torch.Tensor,
    rows: Sequence[SamplingRow],
    token_bitmask: torch.Tensor | None = None,
    cpu_kernels: bool = False,
) -> torch.Tensor:
    """Apply the grammar bitmask, logit_bias, penalties, then min_tokens masking. Returns float32 logits.

    The grammar goes first, as in vLLM, so nothing after it can revive a token it bans (-inf stays -inf).
    The input is never modified: when no row needs any step it comes back as is (converted to float32),
    otherwise as a new tensor.
    """
    repetition_rows, count_rows, min_tokens_rows, bias_rows = _processed_rows(rows)
    if not (repetition_rows or count_rows or min_tokens_rows or bias_rows or token_bitmask is not None):
        return logits.float()

    logits = logits.to(torch.float32, copy=True)
    if token_bitmask is not None:
        apply_token_bitmask(logits, token_bitmask, cpu_kernels)
    if bias_rows:
        _apply_logit_bias(logits, rows, bias_rows)
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


def _processed_rows(rows: Sequence[SamplingRow]) -> tuple[list[int], list[int], list[int], list[int]]:
    """The rows each processing step changes: (repetition penalty, frequency/presence, min_tokens, logit_bias)."""
    return (
        [i for i, row in enumerate(rows) if row.params.repetition_penalty != 1.0],
        [i for i, row in enumerate(rows) if row.params.frequency_penalty != 0.0 or row.params.presence_penalty != 0.0],
        [i for i, row in enumerate(rows) if len(row.output_token_ids) < row.params.min_tokens],
        [i for i, row in enumerate(rows) if row.params.logit_bias],
    )


def _plain_greedy(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> bool:
    """Whether every row takes the raw logits' argmax and wants only its log-prob (no top log-probs, no beams):
    then one C++ pass over each row (`greedy_sample`) does all the sampler's work. bf16 or float32 on the CPU."""
    return (
        logits.device.type == "cpu"
        and logits.dtype in (torch.bfloat16, torch.float32)
        and logits.stride(-1) == 1
        and all(row.params.greedy and not row.params.logprobs and not row.params.use_beam_search for row in rows)
        and not any(_processed_rows(rows))
    )


def _apply_repetition_penalty(logits: torch.Tensor, rows: Sequence[SamplingRow], row_indices: list[int]) -> None:
    """Divide positive / multiply negative logits of every token seen in the prompt or output (in place)."""
    seen = [[*rows[i].prompt_token_ids, *rows[i].output_token_ids] for i in row_indices]
    row_index, token_index = _coordinates(row_indices, seen, logits.device)
    penalty = _row_values(rows, lambda p: p.repetition_penalty, logits.device)[row_index]
    values = logits[row_index, token_index]
    # A token seen twice is written twice with the same value, so duplicates are harmless.
    logits[row_index, token_index] = torch.where(values > 0, values / penalty, values * penalty)


def _apply_logit_bias(logits: torch.Tensor, rows: Sequence[SamplingRow], row_indices: list[int]) -> None:
    """Add each row's per-token bias to its logits (in place), one scatter for the batch."""
    row_index, token_index = _coordinates(row_indices, [list(rows[i].params.logit_bias) for i in row_indices], logits.device)
    biases = [bias for i in row_indices for bias in rows[i].params.logit_bias.values()]
    logits[row_index, token_index] += to_device(biases, torch.float32, logits.device)


def _apply_frequency_presence_penalties(
    logits: torch.Tensor, rows: Sequence[SamplingRow], row_indices: list[int]
) -> None:
    """OpenAI's formula over output tokens only: logit -= frequency * count + presence * (count > 0).

    Each (row, token) occurrence finds its count by binary search in the sorted occurrences, so every
    shape is known on the host (torch.unique's is not: on a GPU it makes the host wait)."""
    outputs = [rows[i].output_token_ids for i in row_indices]
    row_index, token_index = _coordinates(row_indices, outputs, logits.device)
    keys = row_index * logits.shape[-1] + token_index
    ordered = keys.sort().values
    counts = torch.searchsorted(ordered, keys, right=True) - torch.searchsorted(ordered, keys)
    frequency = _row_values(rows, lambda p: p.frequency_penalty, logits.device)[row_index]
    presence = _row_values(rows, lambda p: p.presence_penalty, logits.device)[row_index]
    # A token seen twice is written twice with the same value, so duplicates are harmless.
    logits[row_index, token_index] = logits[row_index, token_index] - (frequency * counts + presence)


def _coordinates(
    row_indices: list[int], token_lists: Sequence[Sequence[int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flatten per-row token lists into (row, token) index tensors for one scatter / gather, built on
    the host and sent through the pinned path."""
    rows = list(itertools.chain.from_iterable([row] * len(tokens) for row, tokens in zip(row_indices, token_lists)))
    tokens = list(itertools.chain.from_iterable(token_lists))
    return to_device(rows, torch.int64, device), to_device(tokens, torch.int64, device)


def _row_values(
    rows: Sequence[SamplingRow], value: Callable[[SamplingParams], float], device: torch.device
) -> torch.Tensor:
    return to_device([value(row.params) for row in rows], torch.float32, device)


def _pick_tokens(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    sampled_rows = [i for i, row in enumerate(rows) if not row.params.greedy]
    if not sampled_rows:
        return _argmax(logits)
    if len(sampled_rows) == len(rows):
        return _sample(logits, rows)
    # argmax over the whole batch is cheaper than gathering the greedy rows out first.
    token_ids = _argmax(logits)
    index = to_device(sampled_rows, torch.int64, logits.device)
    token_ids[index] = _sample(logits[index], [rows[i] for i in sampled_rows])
    return token_ids


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    # max(dim).indices matches argmax (first maximum wins) but is several times faster on CPU.
    return logits.max(dim=-1).indices


def _sample(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p, then one inverse-CDF draw per row.

    Works on weights exp(logit - max logit): probabilities up to a per-row factor, which neither the filters
    nor the draw need removed, and min-p becomes a plain `weight < min_p`.
    """
    vocab_size = logits.shape[-1]
    device = logits.device
    scaled = logits / _row_values(rows, lambda p: p.temperature, device)[:, None]
    top_k = [row.params.top_k if 0 < row.params.top_k < vocab_size else vocab_size for row in rows]
    top_p = [row.params.top_p for row in rows]
    min_p = _row_values(rows, lambda p: p.min_p, device)[:, None]
    uniform = to_device([_uniform(row.seed, len(row.output_token_ids)) for row in rows], torch.float32, device)

    if all(k == vocab_size for k in top_k) and all(p == 1.0 for p in top_p):
        weights = (scaled - scaled.amax(dim=-1, keepdim=True)).exp_()
    else:
        candidate_ids, candidate_weights = _top_k_top_p(scaled, top_k, top_p)
        # The draw walks the vocabulary in token-id order whatever path a row took, so the token a given
        # uniform picks cannot depend on which filters its batch mates asked for.
        weights = torch.zeros_like(scaled).scatter_(1, candidate_ids, candidate_weights)
    weights.masked_fill_(weights < min_p, 0.0)
    return _inverse_cdf(weights, uniform)


def _inverse_cdf(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Column of each row where its CDF first exceeds uniform * total weight.

    A zero-weight column never wins: the CDF does not rise there. float32 is enough: each CDF entry is within
    a few ulps (~1e-7 of the row's mass; CPU cumsum even accumulates in double), far below any share that
    matters when sampling.
    """
    cdf = weights.cumsum(dim=-1)
    total = cdf[:, -1:]
    # Capping just below the total keeps the lookup inside the row even if uniform * total rounds up to it.
    target = torch.minimum(uniform[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1)


def _top_k_top_p(scaled: torch.Tensor, top_k: list[int], top_p: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidate token ids in descending order and their weights, zeroed outside top-k and top-p.

    As in vLLM, top-p sees the distribution renormalised over the top-k set. Top-p keeps the smallest
    prefix whose mass reaches top_p: a candidate is dropped once the mass before it is already >= top_p.
    """
    vocab_size = scaled.shape[-1]
    device = scaled.device
    k_tensor = to_device(top_k, torch.int64, device)
    has_top_k = k_tensor < vocab_size
    p_tensor = to_device([p if p < 1.0 else math.inf for p in top_p], torch.float32, device)
    # Rows without top-k measure top-p against the whole vocabulary's weight, so a partial candidate list
    # still gives exact top-p, and the result does not depend on how many candidates the batch fetched.
    vocab_mass = None
    if not all(k < vocab_size for k in top_k):
        vocab_mass = (scaled.logsumexp(dim=-1) - scaled.amax(dim=-1)).exp()
    # Candidates each row needs: its top-k; for top-p alone, the prefilter (checked below); else everything.
    row_widths = [
        k if k < vocab_size else _PREFILTER_WIDTH if p < 1.0 else vocab_size for k, p in zip(top_k, top_p)
    ]
    width = min(vocab_size, max(row_widths))

    if width < vocab_size and any(k == vocab_size and p < 1.0 for k, p in zip(top_k, top_p)) and not _may_wait_on(device):
        width = vocab_size  # whether the prefilter holds the nucleus is known only on the device
    candidate_ids, weights, cumulative = _weighted_candidates(scaled, width, k_tensor)
    if vocab_mass is not None and width < vocab_size:
        nucleus_cut_off = ~has_top_k & (cumulative[:, -1] < p_tensor * vocab_mass)
        if bool(nucleus_cut_off.any()):
            candidate_ids, weights, cumulative = _weighted_candidates(scaled, vocab_size, k_tensor)
    # Zeros past the top-k leave the running sum unchanged, so the last column holds the top-k set's weight.
    mass = cumulative[:, -1] if vocab_mass is None else torch.where(has_top_k, cumulative[:, -1], vocab_mass)
    weights.masked_fill_(cumulative - weights >= (p_tensor * mass)[:, None], 0.0)
    return candidate_ids, weights


def _may_wait_on(device: torch.device) -> bool:
    """Whether a step may branch on values it computed. On the CPU reading one costs nothing; on a
    GPU it makes the host wait for every kernel queued before it, so the device path takes the
    branch-free route (for top-p alone: the full sort, as vLLM does, instead of a prefilter whose
    sufficiency only the device knows)."""
    return device.type == "cpu"


def _weighted_candidates(
    scaled: torch.Tensor, width: int, top_k: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The `width` most likely tokens as (ids, weights exp(logit - max) zeroed past each row's top-k, their
    running sum)."""
    if width < scaled.shape[-1]:
        candidate_logits, candidate_ids = scaled.topk(width, dim=-1)
    else:
        candidate_logits, candidate_ids = scaled.sort(dim=-1, descending=True)
    weights = (candidate_logits - candidate_logits[:, :1]).exp_()
    weights.masked_fill_(torch.arange(width, device=scaled.device) >= top_k[:, None], 0.0)
    return candidate_ids, weights, weights.cumsum(dim=-1)


def _mix64(x: int) -> int:
    """SplitMix64's output function: a 64-bit bijection with full avalanche."""
    x = ((x ^ (x >> 30)) * 0xBF58_476D_1CE4_E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D0_49BB_1331_11EB) & _MASK64
    return x ^ (x >> 31)


def _uniform(seed: int, step: int) -> float:
    """Draw `step` of a SplitMix64 stream that starts at the mixed seed, as a float in (0, 1).

    Counter-based, so the draw depends on (seed, step) alone. 23 bits make (k + 0.5) / 2**23 exact in float32,
    so the value is never rounded to 0 or 1.
    """
    state = (_mix64(seed & _MASK64) + (step + 1) * _GOLDEN_GAMMA) & _MASK64
    return ((_mix64(state) >> 41) + 0.5) * 2.0**-23


def _with_logprobs(raw: torch.Tensor, token_ids: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
    log_norm = raw.logsumexp(dim=-1)
    sampled_logprobs = raw.gather(1, token_ids[:, None]).squeeze(1) - log_norm
    top_n = max((row.params.logprobs or 0 for row in rows), default=0)
    top_logprobs = None
    if top_n > 0:
        values, ids = raw.topk(top_n, dim=-1)
        top_logprobs = (ids, values - log_norm[:, None])
    return SamplerOutput(token_ids=token_ids, logprobs=sampled_logprobs, top_logprobs=top_logprobs)
