"""One step of beam search, with the semantics of Hugging Face transformers' `_beam_search` (early_stopping=False).

Plain data in, plain data out: the engine runs one forward pass per live beam, hands this module the float32
log-softmax of each beam's last logits, and gets back which (parent, token) pairs live on. Everything that decides
*which* beams survive or finish follows transformers 5.23's `_beam_search` token for token:

- Candidates: the top K = max(2, 1 + #eos) * W of `cum_logprob + logprob` over all live beams and the whole
  vocabulary, taken by one `torch.topk` over the flattened [W * vocab] scores (same shape, same tie order as HF).
  K > W guarantees W candidates that did not stop, so the search never runs short of live beams.
- A candidate stops when its token is an eos token, or when it is the last step (HF's max-length criterion).
- Only stopped candidates among the first W of the K may become hypotheses; stopped ones further down are dropped
  outright (neither kept nor continued).
- A hypothesis scores `cum_logprob / generated_len ** length_penalty`, where generated_len counts the generated
  tokens including the final eos and excluding the prompt. The best W hypotheses are kept.
- The next live beams are the best W candidates that did not stop.
- The request is done at the last step, or once W hypotheses exist and the best live beam, normalised by its
  current generated length, does not beat the worst of them (HF's early_stopping=False heuristic).
- The answer is the best n hypotheses. At the last step every one of the top W candidates stopped, so live
  beams that reached the length limit have competed for the final set like eos-finished ones.

HF's arithmetic is float32 throughout; cumulative log-probs round-trip exactly through Python floats, and the
scoring divisions are done with the same torch ops, so scores match `sequences_scores` bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

# HF's stand-in for "impossible": it initialises all beams but the first with this score and adds it to stopped
# candidates so that they cannot be picked as live beams.
_HF_NEG = -1.0e9


@dataclass(frozen=True)
class Beam:
    """A live beam as the engine holds it."""

    output_token_ids: tuple[int, ...]  # generated so far, prompt excluded
    cum_logprob: float  # a float32 value: the sum of its tokens' log-probs as HF accumulates it


@dataclass(frozen=True)
class NextBeam:
    """A live beam for the next step: the parent beam extended by one token."""

    parent: int  # index into the live beams passed to this step
    token_id: int
    cum_logprob: float


@dataclass(frozen=True)
class FinishedBeam:
    """A hypothesis: a beam that stopped (eos or length limit) while among the top W candidates."""

    output_token_ids: tuple[int, ...]  # includes the final eos token when eos ended it
    cum_logprob: float
    score: float  # HF's `sequences_scores`: cum_logprob / len(output_token_ids) ** length_penalty


@dataclass
class BeamSearchState:
    """Per-request beam search state; the engine owns the live beams, this owns the hypotheses."""

    beam_width: int
    length_penalty: float = 1.0
    eos_token_ids: tuple[int, ...] = ()
    finished: list[FinishedBeam] = field(default_factory=list)  # best first, at most beam_width

    @property
    def num_candidates(self) -> int:
        """K: enough candidates that, even if every beam's eos tokens rank on top, W of them did not stop."""
        return max(2, 1 + len(self.eos_token_ids)) * self.beam_width


@dataclass
class BeamSearch:
    """A request's beam search in the engine: the hypotheses, the next-token log-probs of the live beams computed
    so far this step (a step advances the beams once every live beam has its row), and whether it is done."""

    state: BeamSearchState
    pending: dict[int, torch.Tensor] = field(default_factory=dict)  # seq id -> its next-token log-probs
    done: bool = False  # then `best(n)` is the answer

    def advance(self, seq_ids: Sequence[int], live: Sequence[Beam], is_last_step: bool) -> list[NextBeam]:
        """One step, once every live beam (`live`, the sequences `seq_ids`) has its log-probs in `pending`: the next
        beams, best first; none when the search is done."""
        logprobs = torch.stack([self.pending.pop(seq_id) for seq_id in seq_ids])
        next_beams, self.done = beam_search_step(self.state, live, logprobs, is_last_step)
        return next_beams

    def best(self, n: int) -> list[FinishedBeam]:
        return best_hypotheses(self.state, n)


def beam_search_step(
    state: BeamSearchState,
    live_beams: Sequence[Beam],
    logprobs: torch.Tensor,
    is_last_step: bool,
) -> tuple[list[NextBeam], bool]:
    """Advance the search by one token; updates `state.finished` in place.

    `live_beams` is the single prompt beam (no tokens, cum_logprob 0) at the first step and the W beams this
    function returned at every later one. `logprobs` is [len(live_beams), vocab] float32 log_softmax of each beam's
    next-token logits. `is_last_step` says that the token chosen now is the last one allowed (max_new_tokens).

    Returns the next live beams, best first, and whether the request is done; when done the live beams are
    empty and `best_hypotheses` holds the answer.
    """
    width = state.beam_width
    num_live, vocab_size = logprobs.shape
    if num_live != len(live_beams) or num_live == 0:
        raise ValueError(f"{num_live} rows of logprobs for {len(live_beams)} live beams")
    generated_len = len(live_beams[0].output_token_ids) + 1  # all live beams share one length, as in HF
    if num_live != width and not (num_live == 1 and generated_len == 1):
        raise ValueError(f"expected {width} live beams (or the single prompt beam at the first step), got {num_live}")
    if state.num_candidates > vocab_size:
        raise ValueError(f"beam search needs a vocabulary of at least {state.num_candidates} tokens")

    scores = logprobs.float()
    cum = torch.tensor([beam.cum_logprob for beam in live_beams], dtype=torch.float32, device=scores.device)
    accumulated = scores + cum[:, None]
    if num_live < width:
        # HF starts from W copies of the prompt, all but the first scored -1e9. Rebuilding those rows keeps the
        # topk input identical to HF's, so even exact ties between candidates resolve the same way.
        padding = scores[:1].expand(width - num_live, vocab_size) + _HF_NEG
        accumulated = torch.cat([accumulated, padding])
    top_scores, top_indices = torch.topk(accumulated.reshape(1, -1), k=state.num_candidates)

    eos = set(state.eos_token_ids)
    indices = top_indices[0].tolist()
    tokens = [index % vocab_size for index in indices]
    stopped = [is_last_step or token in eos for token in tokens]

    stopped_mask = torch.tensor(stopped, dtype=torch.float32, device=scores.device)
    running_scores = top_scores[0] + stopped_mask * _HF_NEG
    next_positions = torch.topk(running_scores, k=width).indices.tolist()
    cum_scores = top_scores[0].tolist()
    next_beams = [
        NextBeam(parent=indices[pos] // vocab_size, token_id=tokens[pos], cum_logprob=cum_scores[pos])
        for pos in next_positions
    ]

    normalised = (top_scores[0] / (generated_len**state.length_penalty)).tolist()
    new_hypotheses = [
        FinishedBeam(
            output_token_ids=(*live_beams[indices[pos] // vocab_size].output_token_ids, tokens[pos]),
            cum_logprob=cum_scores[pos],
            score=normalised[pos],
        )
        for pos in range(width)
        if stopped[pos]
    ]
    # HF merges [kept hypotheses, new ones in candidate order] with torch.topk, which promises no order among
    # exactly equal scores; a stable sort over that same order is the deterministic reading of it.
    merged = state.finished + new_hypotheses
    state.finished = sorted(merged, key=lambda hypothesis: -hypothesis.score)[:width]

    if is_last_step or not _improvement_possible(state, next_beams[0].cum_logprob, generated_len):
        return [], True
    return next_beams, False


def best_hypotheses(state: BeamSearchState, n: int) -> list[FinishedBeam]:
    """The n best hypotheses, best first: HF's `sequences[:n]` / `sequences_scores[:n]` (n <= beam_width).

    Meaningful once `beam_search_step` reported the request done.
    """
    if not 1 <= n <= state.beam_width:
        raise ValueError(f"n={n} must be between 1 and the beam width {state.beam_width}")
    return state.finished[:n]


def _improvement_possible(state: BeamSearchState, best_live_cum_logprob: float, generated_len: int) -> bool:
    """HF's early_stopping=False heuristic: can the best live beam, scored at its current length, still beat
    the worst kept hypothesis? Until W hypotheses exist the answer is always yes."""
    if len(state.finished) < state.beam_width:
        return True
    best_live = torch.tensor(best_live_cum_logprob, dtype=torch.float32) / (generated_len**state.length_penalty)
    return best_live.item() > state.finished[-1].score
