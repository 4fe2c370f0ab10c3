"""Sampler tests on plain tensors: filters, penalties, masking, seeded batch independence, logprobs."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.sampler import Sampler, SamplingRow, process_logits
from engine.sampling_params import SamplingParams
from conveyor_kernels.cpu_kernels import load_cpu_kernels

sampler = Sampler()


def make_row(
    params: SamplingParams,
    *,
    seed: int = 0,
    step: int = 0,
    prompt: Sequence[int] = (),
    output: Sequence[int] | None = None,
    eos: Sequence[int] = (),
) -> SamplingRow:
    """A row whose step is `step` unless explicit output tokens are given (then it is their count)."""
    return SamplingRow(
        params=params,
        seed=seed,
        prompt_token_ids=list(prompt),
        output_token_ids=list(output) if output is not None else [0] * step,
        eos_token_ids=list(eos),
    )


def draw_many(logits: torch.Tensor, params: SamplingParams, draws: int) -> torch.Tensor:
    """One token per seed 0..draws-1 from the same single-row logits, all in one batch."""
    rows = [make_row(params, seed=seed) for seed in range(draws)]
    return sampler(logits.repeat(draws, 1), rows).token_ids


def logits_for(probs: Sequence[float]) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float32).log()[None, :]


def random_logits(rows: int, vocab_size: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab_size, generator=generator) * 2.0


def assert_matches_distribution(tokens: torch.Tensor, expected: torch.Tensor) -> None:
    """Chi-square goodness of fit with a loose bound (the draws are deterministic, so this cannot flake)."""
    expected = expected / expected.sum()
    counts = torch.bincount(tokens, minlength=expected.numel()).double()
    assert counts[expected == 0].sum() == 0, f"sampled a token with zero probability: {counts}"
    support = expected > 0
    expected_counts = expected[support].double() * tokens.numel()
    chi_square = float(((counts[support] - expected_counts) ** 2 / expected_counts).sum())
    degrees = int(support.sum()) - 1
    # mean df, sd sqrt(2 df): this bound sits past p = 1e-6 for every df used here
    assert chi_square < degrees + 8 * math.sqrt(2 * degrees) + 12, (chi_square, counts, expected_counts)


sampled_params = st.builds(
    SamplingParams,
    temperature=st.floats(0.2, 2.0),
    top_k=st.sampled_from([-1, 0, 1, 3, 10, 40]),
    top_p=st.sampled_from([1.0, 0.95, 0.7, 0.3]),
    min_p=st.sampled_from([0.0, 0.05, 0.3]),
    repetition_penalty=st.sampled_from([1.0, 1.3]),
    frequency_penalty=st.sampled_from([0.0, 0.5]),
    presence_penalty=st.sampled_from([0.0, -0.4]),
    logprobs=st.sampled_from([None, 0, 3]),
)
any_params = st.one_of(sampled_params, st.builds(SamplingParams, temperature=st.just(0.0)))


# --- greedy -------------------------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    batch=st.integers(1, 6),
    vocab_size=st.integers(2, 300),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    seed=st.integers(0, 2**31),
)
def test_greedy_is_argmax_of_raw_logits_first_maximum_on_ties(
    batch: int, vocab_size: int, dtype: torch.dtype, seed: int
) -> None:
    # Integer-valued logits produce plenty of ties; argmax's rule is the first maximum.
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randint(-3, 4, (batch, vocab_size), generator=generator).to(dtype)
    rows = [make_row(SamplingParams(temperature=0.0), seed=seed + i, step=i) for i in range(batch)]
    out = sampler(logits, rows)
    assert out.token_ids.dtype == torch.int64
    assert torch.equal(out.token_ids, logits.float().argmax(dim=-1))
    assert out.top_logprobs is None


@settings(max_examples=40, deadline=None)
@given(
    batch=st.integers(1, 40),
    vocab_size=st.integers(2, 3000),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    ties=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_the_cpu_greedy_kernel_picks_and_scores_as_the_torch_path(
    batch: int, vocab_size: int, dtype: torch.dtype, ties: bool, seed: int
) -> None:
    """All-greedy batches without processing take one C++ pass (`greedy_sample`): same tokens (the first maximum)
    and the same log-probs, to float32 summation error."""
    if load_cpu_kernels() is None:  # checked here, not in a skipif mark: collecting builds no C++ kernels
        pytest.skip("the C++ CPU kernels could not be built here")
    generator = torch.Generator().manual_seed(seed)
    if ties:
        logits = torch.randint(-3, 4, (batch, vocab_size), generator=generator).to(dtype)
    else:
        logits = (torch.randn(batch, vocab_size, generator=generator) * 8).to(dtype)
    rows = [make_row(SamplingParams(temperature=0.0), seed=i) for i in range(batch)]
    ours, theirs = Sampler(cpu_kernels=True)(logits, rows), sampler(logits, rows)
    assert torch.equal(ours.token_ids, theirs.token_ids)
    torch.testing.assert_close(ours.logprobs, theirs.logprobs, atol=2e-5, rtol=0)


def test_greedy_does_not_depend_on_seed_or_step() -> None:
    logits = random_logits(1, 50, seed=1)
    greedy = SamplingParams(temperature=0.0)
    tokens = {int(sampler(logits, [make_row(greedy, seed=seed, step=seed)]).token_ids) for seed in range(20)}
    assert tokens == {int(logits.argmax())}


# --- temperature and the random stream ------------------------------------------------------------------------


def test_temperature_sampling_follows_softmax_of_scaled_logits() -> None:
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, -1.0, 2.0, 0.2, -2.0, 0.7, 0.1]])
    for temperature in (0.5, 1.0, 2.0):
        tokens = draw_many(logits, SamplingParams(temperature=temperature), draws=20_000)
        assert_matches_distribution(tokens, (logits[0] / temperature).softmax(dim=-1))


def test_rare_tokens_are_sampled_at_their_rate_in_a_large_vocabulary() -> None:
    # One likely token and a long flat tail: the tail's tiny per-token shares must survive the CDF.
    vocab_size = 20_000
    logits = torch.zeros(1, vocab_size)
    logits[0, 0] = math.log(vocab_size - 1)  # token 0 holds half the mass
    tokens = draw_many(logits, SamplingParams(temperature=1.0), draws=1_000)
    assert abs(int((tokens == 0).sum()) - 500) < 80
    # ~500 tail draws over 19999 tokens land on ~494 distinct ones
    assert len(set(tokens[tokens != 0].tolist())) > 470


def test_consecutive_steps_are_uncorrelated() -> None:
    vocab_size = 8
    uniform = torch.zeros(1, vocab_size)
    steps = 16_000
    rows = [make_row(SamplingParams(temperature=1.0), seed=1234, step=step) for step in range(steps)]
    tokens = sampler(uniform.repeat(steps, 1), rows).token_ids
    assert_matches_distribution(tokens, torch.ones(vocab_size))
    pairs = tokens[:-1] * vocab_size + tokens[1:]
    assert_matches_distribution(pairs, torch.ones(vocab_size * vocab_size))


def test_neighbouring_seeds_are_uncorrelated() -> None:
    vocab_size = 8
    uniform = torch.zeros(1, vocab_size)
    seeds = 16_000
    rows = [make_row(SamplingParams(temperature=1.0), seed=seed, step=5) for seed in range(seeds)]
    tokens = sampler(uniform.repeat(seeds, 1), rows).token_ids
    pairs = tokens[:-1] * vocab_size + tokens[1:]
    assert_matches_distribution(pairs, torch.ones(vocab_size * vocab_size))


def test_different_steps_and_seeds_give_different_draws() -> None:
    flat = torch.zeros(1, 1_000)
    params = SamplingParams(temperature=1.0)
    by_step = sampler(flat.repeat(200, 1), [make_row(params, seed=7, step=step) for step in range(200)])
    by_seed = sampler(flat.repeat(200, 1), [make_row(params, seed=seed, step=3) for seed in range(200)])
    # 200 uniform draws from 1000 tokens hit about 181 distinct ones
    assert len(set(by_step.token_ids.tolist())) > 160
    assert len(set(by_seed.token_ids.tolist())) > 160


def test_negative_and_wide_seeds_are_accepted() -> None:
    logits = random_logits(1, 30, seed=2)
    params = SamplingParams(temperature=1.0)
    for seed in (-1, 2**64 + 5, 2**200):
        token = int(sampler(logits, [make_row(params, seed=seed)]).token_ids)
        assert 0 <= token < 30


# --- seeded batch independence --------------------------------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(
    params=sampled_params,
    seed=st.integers(-(2**63), 2**64),
    step=st.integers(0, 40),
    mates=st.lists(any_params, max_size=5),
    position=st.integers(0, 5),
    vocab_size=st.sampled_from([120, 700]),  # 700 exceeds the top-p prefilter, so mates can change its path
    sharpness=st.sampled_from([0.5, 3.0]),
    logits_seed=st.integers(0, 2**31),
)
def test_same_seed_and_step_give_the_same_token_whatever_the_batch(
    params: SamplingParams,
    seed: int,
    step: int,
    mates: list[SamplingParams],
    position: int,
    vocab_size: int,
    sharpness: float,
    logits_seed: int,
) -> None:
    logits = random_logits(1 + len(mates), vocab_size, seed=logits_seed) * sharpness
    generator = torch.Generator().manual_seed(logits_seed)
    output = torch.randint(0, vocab_size, (step,), generator=generator).tolist()
    target = make_row(params, seed=seed, prompt=[1, 2, 3], output=output, eos=[0])
    alone = sampler(logits[:1], [target])

    mate_rows = [
        make_row(mate, seed=seed + i + 1, step=i, prompt=[4, 5], eos=[0]) for i, mate in enumerate(mates)
    ]
    position = min(position, len(mates))
    rows = mate_rows[:position] + [target] + mate_rows[position:]
    batch_logits = torch.cat([logits[1:position + 1], logits[:1], logits[position + 1:]])
    together = sampler(batch_logits, rows)

    assert int(together.token_ids[position]) == int(alone.token_ids[0])
    assert torch.allclose(together.logprobs[position], alone.logprobs[0])


def test_reordering_a_batch_permutes_its_tokens() -> None:
    vocab_size = 500
    logits = random_logits(12, vocab_size, seed=3)
    params = [
        SamplingParams(temperature=0.9, top_p=0.8),
        SamplingParams(temperature=1.3, top_k=20),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, min_p=0.1, presence_penalty=0.5),
    ]
    rows = [make_row(params[i % 4], seed=100 + i, step=i, output=list(range(i))) for i in range(12)]
    forward = sampler(logits, rows).token_ids
    order = list(reversed(range(12)))
    backward = sampler(logits[order], [rows[i] for i in order]).token_ids
    assert torch.equal(backward, forward[order])


# --- top-k / top-p / min-p ------------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(vocab_size=st.integers(2, 400), top_k=st.integers(1, 50), logits_seed=st.integers(0, 2**31))
def test_top_k_only_returns_the_k_most_likely_tokens(vocab_size: int, top_k: int, logits_seed: int) -> None:
    logits = random_logits(1, vocab_size, seed=logits_seed)
    tokens = draw_many(logits, SamplingParams(temperature=1.5, top_k=top_k), draws=300)
    allowed = set(logits[0].topk(min(top_k, vocab_size)).indices.tolist())
    assert set(tokens.tolist()) <= allowed


def test_top_k_samples_the_renormalised_top_k_distribution() -> None:
    logits = logits_for([0.3, 0.05, 0.25, 0.1, 0.2, 0.1])
    tokens = draw_many(logits, SamplingParams(temperature=1.0, top_k=3), draws=10_000)
    assert_matches_distribution(tokens, torch.tensor([0.3, 0.0, 0.25, 0.0, 0.2, 0.0]))


def test_top_p_keeps_the_smallest_prefix_reaching_top_p() -> None:
    probs = [0.15, 0.5, 0.05, 0.3]
    # 0.5 < 0.75 <= 0.5 + 0.3: the nucleus is {1, 3}
    tokens = draw_many(logits_for(probs), SamplingParams(temperature=1.0, top_p=0.75), draws=10_000)
    assert_matches_distribution(tokens, torch.tensor([0.0, 0.5, 0.0, 0.3]))
    # the top token alone already reaches 0.4
    tokens = draw_many(logits_for(probs), SamplingParams(temperature=1.0, top_p=0.4), draws=500)
    assert set(tokens.tolist()) == {1}


def test_top_p_applies_to_the_top_k_renormalised_distribution() -> None:
    logits = logits_for([0.4, 0.3, 0.2, 0.1])
    # alone, top_p 0.5 keeps {0, 1}; after top_k 2 token 0 holds 4/7 >= 0.5 and is kept alone
    alone = draw_many(logits, SamplingParams(temperature=1.0, top_p=0.5), draws=2_000)
    assert set(alone.tolist()) == {0, 1}
    after_top_k = draw_many(logits, SamplingParams(temperature=1.0, top_k=2, top_p=0.5), draws=2_000)
    assert set(after_top_k.tolist()) == {0}
    # also when a batch mate without top-k makes the batch track whole-vocabulary mass
    rows = [make_row(SamplingParams(temperature=1.0, top_k=2, top_p=0.5), seed=seed) for seed in range(500)]
    rows.append(make_row(SamplingParams(temperature=1.0, top_p=0.9)))
    mixed = sampler(logits.repeat(len(rows), 1), rows).token_ids[:-1]
    assert set(mixed.tolist()) == {0}


def test_top_p_beyond_the_prefilter_width_falls_back_to_the_full_vocabulary() -> None:
    # A flat distribution over 2000 tokens: the 0.9 nucleus is 1800 tokens, far past the partial top-k.
    flat = torch.zeros(1, 2_000)
    flat[0, :10] = -50.0  # ten tokens that top-p must exclude
    tokens = draw_many(flat, SamplingParams(temperature=1.0, top_p=0.9), draws=4_000)
    assert len(set(tokens.tolist())) > 1_000
    assert int(tokens.min()) >= 10


def test_top_p_measures_mass_over_the_whole_vocabulary_when_the_nucleus_fits_the_prefilter() -> None:
    # Ten head tokens hold 0.6 and 990 tail tokens 0.4: the 0.5 nucleus is the first 9 head tokens (mass
    # 0.496 before the 9th). The partial top-k sees only a slice of the tail, so normalising over it instead
    # would shrink the nucleus to 6.
    head = torch.linspace(0.069, 0.051, 10, dtype=torch.float64)
    probs = torch.cat([head, torch.full((990,), 0.4 / 990, dtype=torch.float64)])
    tokens = draw_many(probs.log().float()[None, :], SamplingParams(temperature=1.0, top_p=0.5), draws=2_000)
    assert set(tokens.tolist()) == set(range(9))


@settings(max_examples=40, deadline=None)
@given(
    vocab_size=st.integers(2, 700),
    top_p=st.floats(0.05, 0.99),
    temperature=st.floats(0.3, 2.0),
    logits_seed=st.integers(0, 2**31),
)
def test_every_top_p_draw_lies_in_the_nucleus(
    vocab_size: int, top_p: float, temperature: float, logits_seed: int
) -> None:
    logits = random_logits(1, vocab_size, seed=logits_seed)
    tokens = draw_many(logits, SamplingParams(temperature=temperature, top_p=top_p), draws=200)
    probs = (logits[0].double() / temperature).softmax(dim=-1)
    sampled_probs = probs[tokens][:, None]
    mass_before = (probs[None, :] * (probs[None, :] > sampled_probs)).sum(dim=-1)
    assert bool((mass_before < top_p + 1e-5).all())


def test_min_p_drops_tokens_below_min_p_times_the_top_probability() -> None:
    logits = logits_for([0.15, 0.5, 0.05, 0.3])
    # threshold 0.2 * 0.5 = 0.1 drops only token 2
    tokens = draw_many(logits, SamplingParams(temperature=1.0, min_p=0.2), draws=10_000)
    assert_matches_distribution(tokens, torch.tensor([0.15, 0.5, 0.0, 0.3]))


@settings(max_examples=40, deadline=None)
@given(
    vocab_size=st.integers(2, 300),
    min_p=st.floats(0.01, 1.0),
    top_k=st.sampled_from([-1, 5]),
    logits_seed=st.integers(0, 2**31),
)
def test_every_min_p_draw_clears_the_threshold(vocab_size: int, min_p: float, top_k: int, logits_seed: int) -> None:
    logits = random_logits(1, vocab_size, seed=logits_seed)
    tokens = draw_many(logits, SamplingParams(temperature=1.0, min_p=min_p, top_k=top_k), draws=200)
    probs = logits[0].double().softmax(dim=-1)
    assert bool((probs[tokens] >= min_p * probs.max() * (1 - 1e-5)).all())


# --- penalties and min_tokens ---------------------------------------------------------------------------------


def reference_process_logits(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """The formulas written out row by row and token by token."""
    out = logits.double().clone()
    for i, row in enumerate(rows):
        for token in set(row.prompt_token_ids) | set(row.output_token_ids):
            value = out[i, token]
            penalty = row.params.repetition_penalty
            out[i, token] = value / penalty if value > 0 else value * penalty
        for token in set(row.output_token_ids):
            count = list(row.output_token_ids).count(token)
            out[i, token] -= row.params.frequency_penalty * count + row.params.presence_penalty
        if len(row.output_token_ids) < row.params.min_tokens:
            for token in [*row.params.stop_token_ids, *row.eos_token_ids]:
                out[i, token] = -math.inf
    return out.float()


def test_penalties_on_a_worked_example() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    row = make_row(params, prompt=[0], output=[1, 1, 2])
    # token 0 (prompt only): 2 / 2; token 1 (twice in output): -2 * 2 - 0.5 * 2 - 0.25;
    # token 2 (once): 1 / 2 - 0.5 - 0.25; token 3 unseen
    expected = torch.tensor([[1.0, -5.25, -0.25, 0.5]])
    assert torch.equal(process_logits(logits, [row]), expected)


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    batch=st.integers(1, 5),
    vocab_size=st.integers(2, 40),
    logits_seed=st.integers(0, 2**31),
)
def test_process_logits_matches_the_formulas(
    data: st.DataObject, batch: int, vocab_size: int, logits_seed: int
) -> None:
    token = st.integers(0, vocab_size - 1)
    rows = []
    for _ in range(batch):
        params = data.draw(
            st.builds(
                SamplingParams,
                repetition_penalty=st.sampled_from([1.0, 0.5, 1.2, 2.0]),
                frequency_penalty=st.sampled_from([0.0, 0.3, -1.0]),
                presence_penalty=st.sampled_from([0.0, 0.7, -2.0]),
                min_tokens=st.integers(0, 4),
                max_tokens=st.just(None),
                stop_token_ids=st.lists(token, max_size=2),
            )
        )
        rows.append(
            make_row(
                params,
                prompt=data.draw(st.lists(token, max_size=8)),
                output=data.draw(st.lists(token, max_size=8)),
                eos=data.draw(st.lists(token, max_size=2)),
            )
        )
    logits = random_logits(batch, vocab_size, seed=logits_seed)
    original = logits.clone()
    processed = process_logits(logits, rows)
    assert torch.equal(logits, original), "process_logits must not modify its input"
    assert torch.allclose(processed, reference_process_logits(logits, rows), atol=1e-5)


def test_presence_and_frequency_ignore_prompt_tokens() -> None:
    logits = torch.zeros(1, 4)
    row = make_row(SamplingParams(presence_penalty=1.0, frequency_penalty=1.0), prompt=[0, 1], output=[2])
    assert process_logits(logits, [row]).tolist() == [[0.0, 0.0, -2.0, 0.0]]


def test_process_logits_without_penalties_or_min_tokens_returns_float32_input() -> None:
    logits = random_logits(2, 10, seed=4).to(torch.bfloat16)
    rows = [make_row(SamplingParams(), output=[1, 2], eos=[0]) for _ in range(2)]
    assert torch.equal(process_logits(logits, rows), logits.float())


def test_min_tokens_masks_eos_and_stop_tokens_until_reached() -> None:
    logits = torch.zeros(1, 6)
    params = SamplingParams(min_tokens=3, stop_token_ids=[4])
    before = process_logits(logits, [make_row(params, step=2, eos=[5])])
    assert before[0].tolist() == [0.0, 0.0, 0.0, 0.0, -math.inf, -math.inf]
    reached = process_logits(logits, [make_row(params, step=3, eos=[5])])
    assert reached[0].tolist() == [0.0] * 6


def test_min_tokens_masks_eos_even_with_ignore_eos() -> None:
    # As in vLLM: ignore_eos means eos does not end the sequence; min_tokens still forbids sampling it early.
    params = SamplingParams(min_tokens=2, ignore_eos=True)
    processed = process_logits(torch.zeros(1, 3), [make_row(params, step=1, eos=[2])])
    assert processed[0].tolist() == [0.0, 0.0, -math.inf]


def test_sampler_never_picks_eos_or_stop_tokens_before_min_tokens() -> None:
    logits = torch.zeros(1, 5)
    logits[0, 0] = 20.0  # eos: overwhelmingly likely
    logits[0, 1] = 19.0  # stop token
    for temperature in (0.0, 1.0):
        params = SamplingParams(temperature=temperature, min_tokens=4, stop_token_ids=[1])
        rows = [make_row(params, seed=seed, step=seed % 4, eos=[0]) for seed in range(200)]
        tokens = sampler(logits.repeat(200, 1), rows).token_ids
        assert not bool(((tokens == 0) | (tokens == 1)).any())
        after = sampler(logits, [make_row(params, step=4, eos=[0])]).token_ids
        assert int(after) == 0


# --- logprobs and mixed batches -------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    params=st.lists(any_params, min_size=1, max_size=6),
    vocab_size=st.integers(25, 200),
    logits_seed=st.integers(0, 2**31),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_logprobs_come_from_the_raw_logits(
    params: list[SamplingParams], vocab_size: int, logits_seed: int, dtype: torch.dtype
) -> None:
    logits = random_logits(len(params), vocab_size, seed=logits_seed).to(dtype)
    rows = [make_row(p, seed=i, prompt=[1, 2], output=[3, 3, 4], eos=[0]) for i, p in enumerate(params)]
    out = sampler(logits, rows)
    raw_logprobs = logits.float().log_softmax(dim=-1)

    assert out.logprobs.dtype == torch.float32
    expected = raw_logprobs.gather(1, out.token_ids[:, None]).squeeze(1)
    assert torch.allclose(out.logprobs, expected, atol=1e-5)

    top_n = max(p.logprobs or 0 for p in params)
    if top_n == 0:
        assert out.top_logprobs is None
        return
    ids, values = out.top_logprobs
    expected_values, expected_ids = raw_logprobs.topk(top_n, dim=-1)
    assert ids.dtype == torch.int64 and values.dtype == torch.float32
    assert ids.shape == values.shape == (len(params), top_n)
    assert torch.allclose(values, expected_values, atol=1e-5)
    # ids may differ only where values tie
    assert torch.allclose(raw_logprobs.gather(1, ids), expected_values, atol=1e-5)


def test_top_logprobs_match_topk_ids() -> None:
    logits = random_logits(3, 100, seed=5)
    rows = [make_row(SamplingParams(temperature=t, logprobs=n)) for t, n in [(0.0, 2), (1.0, 5), (0.7, None)]]
    ids, values = sampler(logits, rows).top_logprobs
    expected_values, expected_ids = logits.log_softmax(dim=-1).topk(5, dim=-1)
    assert torch.equal(ids, expected_ids)
    assert torch.allclose(values, expected_values)


def test_mixed_batch_of_greedy_and_sampled_rows() -> None:
    vocab_size = 300
    logits = random_logits(6, vocab_size, seed=6)
    greedy_penalised = SamplingParams(temperature=0.0, repetition_penalty=1.5)
    sampled = [SamplingParams(temperature=1.0, top_k=30), SamplingParams(temperature=0.8, top_p=0.9, min_p=0.05)]
    rows = [
        make_row(greedy_penalised, prompt=[int(logits[0].argmax())]),
        make_row(sampled[0], seed=11, step=2),
        make_row(SamplingParams(temperature=0.0), seed=12),
        make_row(sampled[1], seed=13, step=7),
        make_row(SamplingParams(temperature=0.0), seed=14),
        make_row(sampled[0], seed=15, step=1),
    ]
    tokens = sampler(logits, rows).token_ids

    for i in (0, 2, 4):
        assert int(tokens[i]) == int(process_logits(logits[i:i + 1], [rows[i]]).argmax())
    assert int(tokens[0]) != int(logits[0].argmax())  # the penalty moved the greedy choice
    for i in (1, 3, 5):
        assert int(tokens[i]) == int(sampler(logits[i:i + 1], [rows[i]]).token_ids[0])
