"""Beam search step: crafted log-probs for each rule, then a tiny random Llama against HF `generate(num_beams=...)`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import torch

from engine.beam_search import Beam, BeamSearchState, FinishedBeam, NextBeam, beam_search_step, best_hypotheses

EOS = 7


def logprob_rows(rows: Sequence[dict[int, float]], vocab_size: int = 16) -> torch.Tensor:
    """Rows of log-probs with the given tokens set and every other token far below them."""
    table = torch.full((len(rows), vocab_size), -100.0)
    for row, entries in zip(table, rows):
        for token, value in entries.items():
            row[token] = value
    return table


def f32(value: float) -> float:
    return torch.tensor(value, dtype=torch.float32).item()


def f32_sum(cum_logprob: float, logprob: float) -> float:
    """A candidate's cumulative log-prob as the step computes it: a float32 addition."""
    return (torch.tensor(cum_logprob, dtype=torch.float32) + torch.tensor(logprob, dtype=torch.float32)).item()


# --- crafted log-probs ---------------------------------------------------------------------------------------------


def test_first_step_from_the_single_prompt_beam():
    state = BeamSearchState(beam_width=2, eos_token_ids=(EOS,))
    prompt = [Beam((), 0.0)]
    next_beams, done = beam_search_step(state, prompt, logprob_rows([{3: -0.5, 4: -1.0, 5: -2.0}]), False)
    assert not done
    assert next_beams == [NextBeam(0, 3, -0.5), NextBeam(0, 4, -1.0)]
    assert state.finished == []


def test_eos_in_the_top_width_candidates_finishes_a_hypothesis_and_the_next_candidate_lives_on():
    state = BeamSearchState(beam_width=2, length_penalty=1.0, eos_token_ids=(EOS,))
    live = [Beam((3,), -0.5), Beam((4,), -1.0)]
    # Candidates by cumulative log-prob: (0, eos) -0.7, (1, 5) -1.2, (0, 6) -1.5, (1, 2) -3.0
    logprobs = logprob_rows([{EOS: -0.2, 6: -1.0}, {5: -0.2, 2: -2.0}])
    next_beams, done = beam_search_step(state, live, logprobs, False)
    assert not done
    assert next_beams == [NextBeam(1, 5, f32_sum(-1.0, -0.2)), NextBeam(0, 6, f32_sum(-0.5, -1.0))]
    # The score divides by the generated length, eos included and prompt excluded: 2 tokens.
    assert state.finished == [FinishedBeam((3, EOS), f32_sum(-0.5, -0.2), f32(f32_sum(-0.5, -0.2) / 2))]


def test_eos_below_the_top_width_candidates_is_dropped():
    state = BeamSearchState(beam_width=2, eos_token_ids=(EOS,))
    live = [Beam((3,), -0.5), Beam((4,), -1.0)]
    # Candidates: (0, 6) -0.6, (1, 5) -1.1, (0, eos) -1.5, (1, 2) -3.0: eos ranks third of K=4
    logprobs = logprob_rows([{6: -0.1, EOS: -1.0}, {5: -0.1, 2: -2.0}])
    next_beams, done = beam_search_step(state, live, logprobs, False)
    assert not done
    assert next_beams == [NextBeam(0, 6, f32_sum(-0.5, -0.1)), NextBeam(1, 5, f32_sum(-1.0, -0.1))]
    assert state.finished == []


def test_every_eos_token_stops_a_beam_and_widens_the_candidate_pool():
    state = BeamSearchState(beam_width=2, eos_token_ids=(EOS, 8))
    assert state.num_candidates == 6
    live = [Beam((3,), 0.0), Beam((4,), -0.05)]
    # Candidates: (0, eos) -0.1, (0, 5) -0.12, (1, eos) -0.15, (1, 8) -0.16, (1, 6) -0.25: the second live beam
    # is the fifth candidate, which a pool of 2W would not have held.
    logprobs = logprob_rows([{EOS: -0.1, 5: -0.12}, {EOS: -0.1, 8: -0.11, 6: -0.2}])
    next_beams, done = beam_search_step(state, live, logprobs, False)
    assert not done
    assert next_beams == [NextBeam(0, 5, f32_sum(0.0, -0.12)), NextBeam(1, 6, f32_sum(-0.05, -0.2))]
    assert [hyp.output_token_ids for hyp in state.finished] == [(3, EOS)]


@pytest.mark.parametrize("length_penalty", [1.0, 0.5, 2.0, 0.0, -1.0])
def test_length_penalty_uses_the_generated_length(length_penalty: float):
    state = BeamSearchState(beam_width=2, length_penalty=length_penalty, eos_token_ids=(EOS,))
    live = [Beam((3, 4), -2.0), Beam((3, 5), -9.0)]
    beam_search_step(state, live, logprob_rows([{EOS: -1.0, 6: -2.0}, {6: -1.0}]), False)
    [hypothesis] = state.finished
    assert hypothesis.output_token_ids == (3, 4, EOS)
    assert hypothesis.score == pytest.approx(-3.0 / 3**length_penalty, rel=1e-6)


def test_hypotheses_keep_the_best_width_by_normalised_score():
    state = BeamSearchState(beam_width=2, length_penalty=1.0, eos_token_ids=(EOS,))
    state.finished = [FinishedBeam((EOS,), -1.0, -1.0), FinishedBeam((3, EOS), -5.0, -2.5)]
    live = [Beam((3, 4), -1.5), Beam((3, 5), -2.0)]
    # (0, eos) scores -1.8 / 3 = -0.6: it displaces -2.5 and is now the best hypothesis
    next_beams, done = beam_search_step(state, live, logprob_rows([{EOS: -0.3, 6: -0.4}, {6: -0.1}]), False)
    assert [hyp.score for hyp in state.finished] == [f32(f32_sum(-1.5, -0.3) / 3), -1.0]
    assert best_hypotheses(state, 1) == state.finished[:1]
    # The best live beam scores -1.9 / 3 at its length, which beats the worst hypothesis (-1.0): go on.
    assert not done and next_beams[0] == NextBeam(0, 6, f32_sum(-1.5, -0.4))


@pytest.mark.parametrize(
    ("worst_score", "expect_done"),
    [(-1.0, True), (-1.01, False)],  # the best live beam scores exactly -3.0 / 3 = -1.0
)
def test_done_once_width_hypotheses_exist_and_the_best_live_beam_cannot_beat_the_worst(
    worst_score: float, expect_done: bool
):
    state = BeamSearchState(beam_width=2, length_penalty=1.0, eos_token_ids=(EOS,))
    state.finished = [FinishedBeam((EOS,), -0.5, -0.5), FinishedBeam((3, EOS), 2 * worst_score, worst_score)]
    live = [Beam((3, 4), -2.0), Beam((3, 5), -2.5)]
    next_beams, done = beam_search_step(state, live, logprob_rows([{6: -1.0}, {6: -1.0}]), False)
    assert done is expect_done
    assert (next_beams == []) is expect_done


def test_never_done_early_while_fewer_than_width_hypotheses_exist():
    state = BeamSearchState(beam_width=2, length_penalty=1.0, eos_token_ids=(EOS,))
    state.finished = [FinishedBeam((EOS,), -0.1, -0.1)]
    live = [Beam((3, 4), -50.0), Beam((3, 5), -60.0)]
    _, done = beam_search_step(state, live, logprob_rows([{6: -1.0}, {6: -1.0}]), False)
    assert not done


def test_last_step_finishes_the_top_width_candidates_eos_or_not():
    state = BeamSearchState(beam_width=2, length_penalty=1.0, eos_token_ids=(EOS,))
    state.finished = [FinishedBeam((EOS,), -2.0, -2.0)]
    live = [Beam((3,), -0.5), Beam((4,), -1.0)]
    # Candidates: (0, 6) -0.6, (1, 5) -1.1, (0, eos) -1.5: only the first two count, both without eos.
    logprobs = logprob_rows([{6: -0.1, EOS: -1.0}, {5: -0.1}])
    next_beams, done = beam_search_step(state, live, logprobs, True)
    assert done and next_beams == []
    assert state.finished == [
        FinishedBeam((3, 6), f32_sum(-0.5, -0.1), f32(f32_sum(-0.5, -0.1) / 2)),
        FinishedBeam((4, 5), f32_sum(-1.0, -0.1), f32(f32_sum(-1.0, -0.1) / 2)),
    ]
    assert best_hypotheses(state, 2) == state.finished


def test_rejects_malformed_input():
    state = BeamSearchState(beam_width=2, eos_token_ids=(EOS,))
    with pytest.raises(ValueError, match="live beams"):
        beam_search_step(state, [Beam((3,), 0.0)], logprob_rows([{3: 0.0}]), False)
    with pytest.raises(ValueError, match="rows of logprobs"):
        beam_search_step(state, [Beam((), 0.0)], logprob_rows([{3: 0.0}, {3: 0.0}]), False)
    with pytest.raises(ValueError, match="vocabulary"):
        beam_search_step(state, [Beam((), 0.0)], torch.zeros(1, 3), False)
    with pytest.raises(ValueError, match="beam width"):
        best_hypotheses(state, 3)


# --- HF transformers as the oracle ---------------------------------------------------------------------------------

WIDTH = 4
VOCAB = 64


@dataclass(frozen=True)
class OracleCase:
    prompt: tuple[int, ...]
    length_penalty: float
    max_new_tokens: int
    eos: int  # picked among tokens this model does generate, so that the eos rules come into play
    num_return_sequences: int
    paths: frozenset[str]  # which paths this case must exercise (see `search_like_an_engine`)


CASES = [
    OracleCase((5, 17, 33), 1.0, 8, 9, 4, frozenset({"eos_hypothesis", "eos_dropped", "length_limit"})),
    OracleCase((5, 17, 33), 0.5, 8, 9, 3, frozenset({"eos_hypothesis", "eos_dropped", "early_stop"})),
    OracleCase((60, 2, 9, 41, 7), 1.0, 12, 0, 4, frozenset({"eos_hypothesis", "eos_dropped", "early_stop"})),
    OracleCase((60, 2, 9, 41, 7), 0.5, 8, 52, 2, frozenset({"eos_hypothesis", "eos_dropped", "length_limit"})),
    OracleCase((5, 17, 33), 2.0, 8, 43, 4, frozenset({"eos_displaced", "eos_dropped", "length_limit"})),
    OracleCase((60, 2, 9, 41, 7), 2.0, 4, 45, 1, frozenset({"eos_displaced", "eos_dropped", "length_limit"})),
]


@pytest.fixture(scope="module")
def tiny_llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    model = transformers.LlamaForCausalLM(config).float().eval()
    torch.manual_seed(0)  # after construction, so the weights do not depend on how transformers initialises
    with torch.no_grad():  # peaked logits: beams far apart, so float rounding cannot reorder them
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, 0.3)
    # Matrices this small gain nothing from threads, and on a shared CPU the thread handoffs cost 5x.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield model
    torch.set_num_threads(threads)


def hf_beam_search(model, case: OracleCase):
    import transformers

    # An explicit config with nothing but beam search settings: no logits processor applies.
    config = transformers.GenerationConfig(
        num_beams=WIDTH, do_sample=False, length_penalty=case.length_penalty, early_stopping=False,
        num_return_sequences=case.num_return_sequences, max_new_tokens=case.max_new_tokens,
        eos_token_id=case.eos, pad_token_id=case.eos, return_dict_in_generate=True, output_scores=True,
    )
    with torch.no_grad():
        return model.generate(torch.tensor([case.prompt]), generation_config=config)


def search_like_an_engine(case: OracleCase, step_logprobs) -> tuple[list[FinishedBeam], int, set[str]]:
    """Drive beam_search_step as the engine does; `step_logprobs(step, live_beams)` gives each step's rows.

    Returns the answer, the number of steps, and which paths were exercised: an eos candidate ranked below
    the top W ("eos_dropped"), an eos hypothesis shorter than the limit kept to the end ("eos_hypothesis") or
    kept for a while and displaced ("eos_displaced"), a stop before the limit ("early_stop"), and a hypothesis
    that is a live beam which reached the limit ("length_limit").
    """
    state = BeamSearchState(WIDTH, case.length_penalty, (case.eos,))
    live = [Beam((), 0.0)]
    paths: set[str] = set()
    early_eos_hypotheses: set[tuple[int, ...]] = set()
    for step in range(case.max_new_tokens):
        logprobs = step_logprobs(step, live)
        is_last_step = step == case.max_new_tokens - 1
        if not is_last_step and case.eos in _candidate_tokens(live, logprobs)[WIDTH:]:
            paths.add("eos_dropped")
        next_beams, done = beam_search_step(state, live, logprobs, is_last_step)
        early_eos_hypotheses |= {
            hyp.output_token_ids for hyp in state.finished if len(hyp.output_token_ids) < case.max_new_tokens
        }
        if done:
            break
        live = [Beam((*live[nb.parent].output_token_ids, nb.token_id), nb.cum_logprob) for nb in next_beams]
    final = best_hypotheses(state, WIDTH)
    if step < case.max_new_tokens - 1:
        paths.add("early_stop")
    if any(len(hyp.output_token_ids) == case.max_new_tokens for hyp in final):
        paths.add("length_limit")
    if any(hyp.output_token_ids in early_eos_hypotheses for hyp in final):
        paths.add("eos_hypothesis")
    if early_eos_hypotheses - {hyp.output_token_ids for hyp in final}:
        paths.add("eos_displaced")
    return final[: case.num_return_sequences], step + 1, paths


def _candidate_tokens(live: list[Beam], logprobs: torch.Tensor) -> list[int]:
    """The tokens of the top 2W candidates, recomputed here only to see where eos ranks."""
    scores = logprobs + torch.tensor([beam.cum_logprob for beam in live])[:, None]
    return (torch.topk(scores.reshape(-1), 2 * WIDTH).indices % VOCAB).tolist()


def assert_same_sequences(out, case: OracleCase, answer: list[FinishedBeam]) -> None:
    """HF pads shorter sequences with pad_token_id (here the eos token) up to the longest one."""
    generated = out.sequences[:, len(case.prompt):].tolist()
    assert len(generated) == len(answer) == case.num_return_sequences
    for hf_tokens, hypothesis in zip(generated, answer):
        length = len(hypothesis.output_token_ids)
        assert tuple(hf_tokens[:length]) == hypothesis.output_token_ids
        assert all(token == case.eos for token in hf_tokens[length:])


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"lp{c.length_penalty}-eos{c.eos}-n{c.num_return_sequences}")
def test_matches_hf_generate_with_one_forward_per_live_beam(tiny_llama, case: OracleCase):
    def forward_each_beam(step: int, live: list[Beam]) -> torch.Tensor:
        tokens = torch.tensor([[*case.prompt, *beam.output_token_ids] for beam in live])
        with torch.no_grad():
            logits = tiny_llama(tokens).logits[:, -1, :].float()
        return torch.log_softmax(logits, dim=-1)

    out = hf_beam_search(tiny_llama, case)
    answer, steps, paths = search_like_an_engine(case, forward_each_beam)
    assert_same_sequences(out, case, answer)
    assert steps == len(out.scores)
    # Our uncached forward differs from HF's cached batched one in the last bits of the logits.
    for hf_score, hypothesis in zip(out.sequences_scores.tolist(), answer):
        assert hypothesis.score == pytest.approx(hf_score, rel=1e-5)
    assert case.paths <= paths, f"case no longer exercises {set(case.paths - paths)}"


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"lp{c.length_penalty}-eos{c.eos}-n{c.num_return_sequences}")
def test_matches_hf_generate_bit_for_bit_on_hf_log_probs(tiny_llama, case: OracleCase):
    """Replaying HF's own per-step log-probs (`scores`) isolates the search arithmetic: scores must be equal."""
    out = hf_beam_search(tiny_llama, case)

    def hf_rows(step: int, live: list[Beam]) -> torch.Tensor:
        # HF's rows follow its running beams, which are ours if the search agrees; at the first step all W rows
        # are the prompt's.
        return out.scores[step][: len(live)]

    answer, steps, _ = search_like_an_engine(case, hf_rows)
    assert_same_sequences(out, case, answer)
    assert steps == len(out.scores)
    assert [hyp.score for hyp in answer] == out.sequences_scores.tolist()
