"""Every sampling option and every input check, through the offline API on the real SmolLM2.

float32, because several tests compare runs whose batches differ: in bf16 a row's logits depend on
its batch mates enough to flip a greedy choice now and then. Seeded sampling keeps every test
deterministic. Requests that can share a batch do, to keep the module fast.
"""

from __future__ import annotations

from collections import Counter

import pytest

from engine import LLM, CompletionOutput, SamplingParams

pytestmark = pytest.mark.slow

FRANCE = "What is the capital of France?"
APPLES = "Repeat the word 'apple' 30 times."
COUNT = "Count from 1 to 20, separated by commas."
HI = "Hi!"
CAFE = "Write the word 'café' and an emoji."
OTHERS = [
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Who wrote Hamlet?",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 7?",
    "Why is the sky blue?",
    "Suggest a name for a pet turtle.",
    "What does a compiler do? Answer briefly.",
]


def greedy(**options: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, **{"max_tokens": 16, **options})


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32")


@pytest.fixture(scope="module")
def eos(llm: LLM) -> int:
    (eos_id,) = llm.engine.eos_token_ids
    return eos_id


def chat_ids(llm: LLM, question: str) -> list[int]:
    text = llm.tokenizer.apply_chat_template([{"role": "user", "content": question}])
    return llm.tokenizer.encode(text, add_special_tokens=False)


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[CompletionOutput]:
    """One generate call; the single completion of each request, in input order."""
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert all(len(o.outputs) == 1 for o in outputs)
    return [o.outputs[0] for o in outputs]


def assert_idle(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    engine.block_manager.check_invariants()


# ---- sampling options ----------------------------------------------------------------------


def test_greedy_is_deterministic(llm: LLM) -> None:
    prompt = chat_ids(llm, OTHERS[0])
    alone = run(llm, [prompt], greedy())[0]
    twice = run(llm, [prompt, chat_ids(llm, OTHERS[1]), prompt], greedy())
    assert len(alone.token_ids) > 4
    assert twice[0].token_ids == alone.token_ids
    assert twice[2].token_ids == alone.token_ids
    assert twice[0].text == alone.text


def test_seeded_sampling_ignores_batch_mates_and_position(llm: LLM) -> None:
    seeded = SamplingParams(temperature=0.9, seed=1234, max_tokens=16)
    prompt = chat_ids(llm, FRANCE)
    mates = [chat_ids(llm, q) for q in OTHERS]
    # Batch mates asking for every other kind of processing, so each sampler path runs beside it.
    mate_params = [
        SamplingParams(temperature=1.0, max_tokens=16),
        greedy(),
        SamplingParams(temperature=0.7, top_k=20, seed=1, max_tokens=10),
        SamplingParams(temperature=1.2, top_p=0.8, seed=2, max_tokens=16),
        SamplingParams(temperature=1.0, min_p=0.1, seed=3, max_tokens=3),
        SamplingParams(temperature=0.8, repetition_penalty=1.3, frequency_penalty=0.5, seed=4, max_tokens=16),
        SamplingParams(temperature=1.0, logprobs=5, n=2, seed=5, max_tokens=12),
        SamplingParams(temperature=1.0, stop=["."], min_tokens=2, seed=6, max_tokens=16),
    ]
    alone = run(llm, [prompt], seeded)[0]
    last = llm.generate([*mates, prompt], [*mate_params, seeded], use_tqdm=False)[-1].outputs[0]
    other_seed = SamplingParams(temperature=0.9, seed=99, max_tokens=16)
    outputs = llm.generate([prompt, *mates[::-1], prompt], [seeded, *mate_params[::-1], other_seed], use_tqdm=False)
    first, different = outputs[0].outputs[0], outputs[-1].outputs[0]

    assert last.token_ids == alone.token_ids
    assert first.token_ids == alone.token_ids
    assert first.text == alone.text
    assert different.token_ids != alone.token_ids


def test_filters_that_keep_only_the_top_token_equal_greedy(llm: LLM) -> None:
    prompts = [chat_ids(llm, FRANCE), chat_ids(llm, OTHERS[0])]
    variants = [
        SamplingParams(temperature=1.5, top_k=1, seed=7, max_tokens=16),
        SamplingParams(temperature=1.0, top_p=1e-6, seed=7, max_tokens=16),
        SamplingParams(temperature=1.0, min_p=0.99, seed=7, max_tokens=16),
    ]
    baseline = run(llm, prompts, greedy())
    outputs = run(llm, [p for p in prompts for _ in variants], variants * len(prompts))
    for i, output in enumerate(outputs):
        assert output.token_ids == baseline[i // len(variants)].token_ids, variants[i % len(variants)]


def test_penalties_reduce_repetition(llm: LLM) -> None:
    def most_repeats(output: CompletionOutput) -> int:
        return max(Counter(output.token_ids).values())

    prompt = chat_ids(llm, APPLES)
    none, repetition, presence, frequency = run(
        llm,
        [prompt] * 4,
        [
            greedy(max_tokens=24),
            greedy(max_tokens=24, repetition_penalty=1.3),
            greedy(max_tokens=24, presence_penalty=2.0),
            greedy(max_tokens=24, frequency_penalty=1.0),
        ],
    )
    assert most_repeats(none) >= 10, none.text  # the prompt does make the model repeat itself
    for penalised in (repetition, presence, frequency):
        assert most_repeats(penalised) < most_repeats(none) / 2, penalised.text


def test_stop_strings(llm: LLM) -> None:
    prompt = chat_ids(llm, FRANCE)
    baseline = run(llm, [prompt], greedy())[0].text
    assert baseline == "The capital of France is Paris."
    spanning = "ce is Pa"  # ends " France", covers " is", begins " Paris": only whole once three tokens are out
    cut, kept, first_of_two, absent = run(
        llm,
        [prompt] * 4,
        [
            greedy(stop=[spanning]),
            greedy(stop=[spanning], include_stop_str_in_output=True),
            greedy(stop=["Paris", " of"]),
            greedy(stop=["Berlin"]),
        ],
    )
    assert (cut.text, cut.finish_reason, cut.stop_reason) == ("The capital of Fran", "stop", spanning)
    assert spanning not in cut.text
    assert (kept.text, kept.finish_reason, kept.stop_reason) == ("The capital of France is Pa", "stop", spanning)
    assert (first_of_two.text, first_of_two.stop_reason) == ("The capital", " of")
    assert (absent.text, absent.finish_reason, absent.stop_reason) == (baseline, "stop", None)


def test_stop_strings_do_not_count_before_min_tokens(llm: LLM) -> None:
    prompt = chat_ids(llm, APPLES)
    baseline = run(llm, [prompt], greedy())[0].text
    output = run(llm, [prompt], greedy(stop=["apple"], min_tokens=6))[0]
    # Not cut at the first "apple" (nor garbled by cuts made and then ignored): at the first one after 6 tokens.
    assert output.finish_reason == "stop" and output.stop_reason == "apple"
    assert len(output.token_ids) >= 6
    assert baseline.startswith(output.text) and baseline[len(output.text) :].startswith("apple")
    assert output.text.count("apple") >= 2


def test_stop_token_ids(llm: LLM) -> None:
    prompt = chat_ids(llm, COUNT)
    (newline,) = llm.tokenizer.encode("\n", add_special_tokens=False)
    baseline = run(llm, [prompt], greedy())[0]
    assert baseline.text.startswith("1. 1\n2. 2\n")
    end = baseline.token_ids.index(newline) + 1
    plain, included, with_detokenizer = run(
        llm,
        [prompt] * 3,
        [
            greedy(stop_token_ids=[newline]),
            greedy(stop_token_ids=[newline], include_stop_str_in_output=True),
            greedy(stop_token_ids=[newline], stop=["never printed"]),  # the incremental text path
        ],
    )
    for output in (plain, included, with_detokenizer):
        assert output.token_ids == baseline.token_ids[:end]
        assert (output.finish_reason, output.stop_reason) == ("stop", newline)
    # As in vLLM, the stop token's text is left out unless include_stop_str_in_output.
    assert plain.text == with_detokenizer.text == "1. 1"
    assert included.text == "1. 1\n"


def test_eos_ignore_eos_max_tokens_and_min_tokens(llm: LLM, eos: int) -> None:
    hi, count = chat_ids(llm, HI), chat_ids(llm, COUNT)
    natural = run(llm, [hi], greedy(max_tokens=30))[0]
    assert natural.finish_reason == "stop" and natural.stop_reason is None
    assert natural.token_ids[-1] == eos and eos not in natural.token_ids[:-1]
    length = len(natural.token_ids)

    ignoring, exact, exact_ignoring, at_least = run(
        llm,
        [hi, count, hi, hi],
        [
            greedy(max_tokens=length + 4, ignore_eos=True),
            greedy(max_tokens=3),
            greedy(max_tokens=1, ignore_eos=True),
            greedy(max_tokens=length + 8, min_tokens=length + 3),
        ],
    )
    assert (len(ignoring.token_ids), ignoring.finish_reason) == (length + 4, "length")
    assert ignoring.token_ids[:length] == natural.token_ids
    assert (len(exact.token_ids), exact.finish_reason) == (3, "length")
    assert (len(exact_ignoring.token_ids), exact_ignoring.finish_reason) == (1, "length")
    assert len(at_least.token_ids) >= length + 3
    assert eos not in at_least.token_ids[: length + 3]
    assert at_least.token_ids[: length - 1] == natural.token_ids[:-1]


def test_logprobs(llm: LLM) -> None:
    prompts = [chat_ids(llm, FRANCE), chat_ids(llm, OTHERS[0]), chat_ids(llm, OTHERS[1])]
    sampled, top1_greedy, only_sampled = run(
        llm,
        prompts,
        [
            SamplingParams(temperature=1.0, seed=11, logprobs=5, max_tokens=12),
            greedy(logprobs=3, max_tokens=12),
            SamplingParams(temperature=0.8, seed=12, logprobs=0, max_tokens=12),
        ],
    )
    for output, wanted in ((sampled, 5), (top1_greedy, 3), (only_sampled, 0)):
        assert output.logprobs is not None and len(output.logprobs) == len(output.token_ids)
        total = 0.0
        for token, entry in zip(output.token_ids, output.logprobs):
            assert token in entry
            assert wanted <= len(entry) <= wanted + 1
            assert all(value <= 0.0 for value in entry.values())
            assert sum(2.718281828459045**value for value in entry.values()) <= 1.0 + 1e-4
            top = sorted(entry.values(), reverse=True)[:wanted]
            assert all(value >= other for value in top for other in entry.values() if other not in top)
            total += entry[token]
        assert output.cumulative_logprob == pytest.approx(total, abs=1e-3)
    # Greedy takes the most likely token, so its logprob is the entry's largest.
    assert all(entry[t] == max(entry.values()) for t, entry in zip(top1_greedy.token_ids, top1_greedy.logprobs))
    assert all(len(entry) == 1 for entry in only_sampled.logprobs)
    # Without logprobs asked for, none come back.
    assert run(llm, prompts[:1], greedy(max_tokens=2))[0].logprobs is None


def test_n_samples(llm: LLM) -> None:
    prompt = chat_ids(llm, OTHERS[0])
    sampled, greedy_pair = llm.generate(
        [prompt, prompt],
        [SamplingParams(n=3, temperature=1.0, seed=21, max_tokens=12), greedy(n=2, max_tokens=8)],
        use_tqdm=False,
    )
    assert [c.index for c in sampled.outputs] == [0, 1, 2]
    assert len({c.text for c in sampled.outputs}) == 3
    assert all(len(c.token_ids) > 0 and c.finished for c in sampled.outputs)
    assert [c.index for c in greedy_pair.outputs] == [0, 1]
    assert greedy_pair.outputs[0].token_ids == greedy_pair.outputs[1].token_ids


def test_chat_applies_the_template(llm: LLM) -> None:
    conversation = [{"role": "user", "content": FRANCE}]
    (single,) = llm.chat(conversation, greedy(), use_tqdm=False)
    assert "Paris" in single.outputs[0].text
    assert single.prompt_token_ids == chat_ids(llm, FRANCE)
    both = llm.chat([conversation, [{"role": "user", "content": HI}]], greedy(), use_tqdm=False)
    assert both[0].outputs[0].token_ids == single.outputs[0].token_ids
    assert both[1].prompt_token_ids == chat_ids(llm, HI)


def test_generate_keeps_input_order(llm: LLM) -> None:
    # Short prompts with long outputs first, so requests finish in roughly the reverse of input order.
    prompts: list[str | list[int]] = ["Hi", chat_ids(llm, OTHERS[2]), "Once upon a time, in a land far away,", "A"]
    max_tokens = [14, 9, 5, 1]
    outputs = llm.generate(prompts, [greedy(max_tokens=m, ignore_eos=True) for m in max_tokens], use_tqdm=False)
    assert [o.prompt for o in outputs] == ["Hi", None, "Once upon a time, in a land far away,", "A"]
    assert outputs[1].prompt_token_ids == prompts[1]
    assert outputs[0].prompt_token_ids == llm.tokenizer.encode("Hi")
    assert [len(o.outputs[0].token_ids) for o in outputs] == max_tokens
    assert len({o.request_id for o in outputs}) == len(outputs)


def test_utf8_text_is_never_cut_inside_a_character(llm: LLM) -> None:
    prompt = chat_ids(llm, CAFE)
    # Every cut point, on both text paths (decoded at the end; incremental, which stop strings need).
    lengths = range(1, 11)
    params = [greedy(max_tokens=m) for m in lengths] + [greedy(max_tokens=m, stop=["\u2603"]) for m in lengths]
    params += [SamplingParams(temperature=1.0, seed=seed, max_tokens=12) for seed in range(4)]
    outputs = run(llm, [prompt] * len(params), params)
    for output in outputs:
        assert "\ufffd" not in output.text, output.token_ids
    longest = outputs[len(lengths) - 1].text
    assert any(ord(ch) > 127 for ch in longest), longest  # the prompt does elicit non-ASCII text
    for at_end, incremental in zip(outputs[: len(lengths)], outputs[len(lengths) : 2 * len(lengths)]):
        assert at_end.text == incremental.text
        assert longest.startswith(at_end.text)


# ---- bad inputs ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def short_llm() -> LLM:
    return LLM(max_model_len=64, num_kv_blocks=16)


def test_empty_prompt_is_rejected(llm: LLM) -> None:
    with pytest.raises(ValueError, match="empty"):
        llm.generate("", greedy(), use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], greedy(), use_tqdm=False)
    assert_idle(llm)


def test_token_ids_out_of_vocab_are_rejected(llm: LLM) -> None:
    vocab = llm.engine.model_config.vocab_size
    for bad in ([1, vocab], [-1, 5]):
        with pytest.raises(ValueError, match="out of range"):
            llm.generate([bad], greedy(), use_tqdm=False)
    with pytest.raises(ValueError, match="stop_token_ids must be in"):
        llm.generate([[1, 2]], SamplingParams(temperature=0.0, stop_token_ids=[vocab]), use_tqdm=False)
    assert_idle(llm)


def test_a_bad_prompt_leaves_nothing_behind(llm: LLM) -> None:
    # The first prompt was accepted before the second failed; it must not run along with the next call.
    with pytest.raises(ValueError, match="empty"):
        llm.generate(["Hello", ""], greedy(), use_tqdm=False)
    assert_idle(llm)
    (output,) = llm.generate("Hello", greedy(max_tokens=2), use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 2


def test_prompt_and_output_fit_max_model_len(short_llm: LLM) -> None:
    assert short_llm.max_model_len == 64
    with pytest.raises(ValueError, match="64 tokens"):
        short_llm.generate([[5] * 64], greedy(), use_tqdm=False)
    with pytest.raises(ValueError, match="context"):
        short_llm.generate("word " * 100, greedy(), use_tqdm=False)
    near_full, unbounded = short_llm.generate(
        [[5] * 60, [5] * 63], [greedy(max_tokens=100, ignore_eos=True), greedy(max_tokens=None, ignore_eos=True)],
        use_tqdm=False,
    )
    assert (len(near_full.outputs[0].token_ids), near_full.outputs[0].finish_reason) == (4, "length")
    assert (len(unbounded.outputs[0].token_ids), unbounded.outputs[0].finish_reason) == (1, "length")
    assert_idle(short_llm)


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"n": 0}, "n must"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"frequency_penalty": -3.0}, "frequency_penalty"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ],
)
def test_invalid_sampling_params(options: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**options)


def test_params_count_must_match_prompts(llm: LLM) -> None:
    with pytest.raises(ValueError, match="2 prompts but 3 sampling params"):
        llm.generate(["a", "b"], [greedy()] * 3, use_tqdm=False)


def test_unknown_engine_option_is_named() -> None:
    with pytest.raises(TypeError, match="max_num_seq'"):
        LLM(max_num_seq=4)  # a typo of max_num_seqs


def test_bad_model_name() -> None:
    with pytest.raises(ValueError, match="cannot load model 'no-such-model'"):
        LLM("no-such-model")



def test_a_request_reports_the_prompt_tokens_its_prefix_cache_supplied(llm: LLM) -> None:
    # A beginning no other test's prompt shares (chat prompts share the template's system turn).
    prompt = llm.tokenizer.encode("Zebra quartz: the history of the Roman Empire, its emperors, its roads, its fall.")
    block = llm.engine.config.block_size
    first, = llm.generate([prompt], greedy(max_tokens=2), use_tqdm=False)
    again, = llm.generate([prompt], greedy(max_tokens=2), use_tqdm=False)
    assert first.num_cached_tokens == 0
    # Every full block but the one holding the last prompt token (which must be computed to sample from).
    assert again.num_cached_tokens == (len(prompt) - 1) // block * block > 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
