"""The OpenAI Batch line format: validation of input lines and the shape of output records. No model needed."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from engine.sampling_params import SamplingParams
from jobs.openai_format.records import error_record, response_record
from jobs.openai_format.requests import CHAT_COMPLETIONS, COMPLETIONS, BatchRequest, Endpoint
from jobs.served_models import ModelNames, process_models
from jobs.openai_format.validation import BatchLineValidator, LineError

EXAMPLE_FILE = Path(__file__).resolve().parents[2] / "examples" / "requests.jsonl"
BOS_ID = 1
VOCAB_SIZE = 1000


class WordTokenizer:
    """One token per whitespace-separated word (id = word length + 10), so token counts are easy to read off."""

    vocab_size = VOCAB_SIZE
    chat_template = None  # no tool format: tools get the generic prompt

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [len(word) + 10 for word in text.split()]
        return [BOS_ID, *ids] if add_special_tokens else ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(f"<{token_id}>" for token_id in token_ids)

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True, **template_kwargs: Any
    ) -> str:
        turns = " ".join(f"[{message['role']}] {message['content']}" for message in messages)
        return turns + (" [assistant]" if add_generation_prompt else "")


class RefusingTemplateTokenizer(WordTokenizer):
    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        raise RuntimeError("Conversation roles must alternate user/assistant")


# What the tests' validators serve: "smollm2" and the bundled embedding model, and OpenAI names by explicit alias.
SERVED = ModelNames(
    process_models(["smollm2", "smollm2-135m-instruct"], "all-minilm-l6-v2"),
    {"gpt-4o-mini": "smollm2", "text-embedding-3-small": "all-minilm-l6-v2"},
)


def validator(max_model_len: int = 64, endpoint: Endpoint | None = None) -> BatchLineValidator:
    return BatchLineValidator(WordTokenizer(), max_model_len, endpoint, models=SERVED)


def chat_line(custom_id: str = "req-1", **body: Any) -> str:
    body.setdefault("messages", [{"role": "user", "content": "hello there"}])  # 4 tokens with the template
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": CHAT_COMPLETIONS, "body": body})


def completion_line(custom_id: str = "req-1", **body: Any) -> str:
    body.setdefault("prompt", "one two three")  # 4 tokens with BOS
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": COMPLETIONS, "body": body})


def raw_line(**fields: Any) -> str:
    return json.dumps(fields)


def accepted(result: BatchRequest | LineError) -> BatchRequest:
    assert isinstance(result, BatchRequest), result
    return result


def rejected(result: BatchRequest | LineError) -> LineError:
    assert isinstance(result, LineError), result
    return result


# ---------------------------------------------------------------------------------------------------------
# Bad lines: every one becomes an error record with a clear message


@pytest.mark.parametrize(
    ("line", "code", "message_part"),
    [
        ("{not json", "invalid_json_line", "not valid JSON"),
        ("[1, 2]", "invalid_json_line", "must be a JSON object, got list"),
        ('"just a string"', "invalid_json_line", "must be a JSON object, got str"),
        (b"\xff\xfe\xfa", "invalid_json_line", "not valid JSON"),
        (raw_line(method="POST", url=COMPLETIONS, body={"prompt": "x"}), "invalid_custom_id", "missing 'custom_id'"),
        (raw_line(custom_id="", method="POST", url=COMPLETIONS, body={}), "invalid_custom_id", "non-empty string"),
        (raw_line(custom_id=7, method="POST", url=COMPLETIONS, body={}), "invalid_custom_id", "non-empty string"),
    ],
)
def test_lines_without_a_readable_custom_id_are_rejected(line: str | bytes, code: str, message_part: str) -> None:
    error = rejected(validator().validate(line))
    assert error.code == code
    assert message_part in error.message
    assert error.custom_id is None


@pytest.mark.parametrize(
    ("line", "code", "message_part"),
    [
        (raw_line(custom_id="a", method="GET", url=COMPLETIONS, body={}), "invalid_method", "method must be 'POST'"),
        (raw_line(custom_id="a", url=COMPLETIONS, body={}), "invalid_method", "got None"),
        (raw_line(custom_id="a", method="POST", url="/v1/moderations", body={}), "invalid_url", "'/v1/moderations'"),
        (raw_line(custom_id="a", method="POST", url=COMPLETIONS), "invalid_body", "missing 'body'"),
        (raw_line(custom_id="a", method="POST", url=COMPLETIONS, body=[1]), "invalid_body", "JSON object, got list"),
        # chat bodies
        (raw_line(custom_id="a", method="POST", url=CHAT_COMPLETIONS, body={}), "invalid_body",
         "missing required parameter 'body.messages'"),
        (chat_line("a", messages=[]), "invalid_parameter", "'body.messages'"),
        (chat_line("a", messages="hello"), "invalid_body", "'body.messages': Input should be a valid list"),
        (chat_line("a", messages=[{"role": "user"}]), "invalid_body",
         "invalid 'body.messages[0]': content is required"),
        (chat_line("a", messages=[{"role": "user", "content": 5}]), "invalid_body", "'body.messages[0].content'"),
        (chat_line("a", messages=[{"role": "tool", "content": "x"}]), "invalid_body", "need tool_call_id"),
        (chat_line("a", messages=[{"role": "robot", "content": "x"}]), "invalid_body", "'body.messages[0].role'"),
        (chat_line("a", messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
         "invalid_body", "content[0].image_url.url: Field required"),
        (chat_line("a", temperature="hot"), "invalid_body", "'body.temperature': Input should be a valid number"),
        (chat_line("a", n=1.5), "invalid_body", "'body.n': Input should be a valid integer"),
        (chat_line("a", max_tokens="10"), "invalid_body", "'body.max_tokens'"),
        (chat_line("a", ignore_eos=1), "invalid_body", "'body.ignore_eos'"),
        (chat_line("a", stop=[1, 2]), "invalid_body", "'body.stop[0]'"),
        (chat_line("a", functions=[{"name": "f"}]), "invalid_body", "unsupported parameter 'body.functions'"),
        (chat_line("a", temperature=-1), "invalid_parameter", "temperature must be >= 0"),
        (chat_line("a", top_p=0), "invalid_parameter", "top_p must be in (0, 1]"),
        (chat_line("a", n=0), "invalid_parameter", "n must be an integer >= 1"),
        (chat_line("a", max_tokens=0), "invalid_parameter", "max_tokens must be an integer >= 1"),
        (chat_line("a", max_completion_tokens=-3), "invalid_parameter", "max_tokens must be an integer >= 1"),
        (chat_line("a", presence_penalty=2.5), "invalid_parameter", "presence_penalty must be in [-2, 2]"),
        (chat_line("a", frequency_penalty=-3), "invalid_parameter", "frequency_penalty must be in [-2, 2]"),
        (chat_line("a", repetition_penalty=0), "invalid_parameter", "repetition_penalty must be > 0"),
        (chat_line("a", min_p=1.5), "invalid_parameter", "min_p must be in [0, 1]"),
        (chat_line("a", top_k=-5), "invalid_parameter", "top_k must be -1"),
        (chat_line("a", max_tokens=4, min_tokens=8), "invalid_parameter", "min_tokens (8) must not exceed max_tokens"),
        (chat_line("a", stop=["a", "b", "c", "d", "e"]), "invalid_parameter", "'body.stop'"),
        (chat_line("a", stop=""), "invalid_parameter", "stop must be non-empty strings"),
        (chat_line("a", stop_token_ids=[-1]), "invalid_parameter", "stop_token_ids must be ints >= 0"),
        (chat_line("a", stop_token_ids=[VOCAB_SIZE]), "invalid_parameter", "outside the vocabulary"),
        (chat_line("a", logprobs=True, top_logprobs=21), "invalid_parameter", "'body.top_logprobs'"),
        (chat_line("a", top_logprobs=2), "invalid_parameter", "top_logprobs requires logprobs to be true"),
        # completion bodies
        (raw_line(custom_id="a", method="POST", url=COMPLETIONS, body={"max_tokens": 3}), "invalid_body",
         "missing required parameter 'body.prompt'"),
        (completion_line("a", prompt=["one", 5]), "invalid_body", "string or a list of token ids"),
        (completion_line("a", prompt=[[1, 2], [3, -4]]), "invalid_body", "string or a list of token ids"),
        (completion_line("a", prompt={"text": "x"}), "invalid_body", "string or a list of token ids"),
        (completion_line("a", prompt=[1, True]), "invalid_body", "string or a list of token ids"),
        (completion_line("a", prompt=[1, -2]), "invalid_body", "string or a list of token ids"),
        (completion_line("a", prompt=[]), "invalid_body", "the prompt is empty"),
        (completion_line("a", prompt=[5, VOCAB_SIZE + 1]), "invalid_parameter", "outside the vocabulary"),
        (completion_line("a", logprobs=6), "invalid_parameter", "'body.logprobs'"),
        (completion_line("a", logprobs=True), "invalid_body", "'body.logprobs'"),
        (completion_line("a", stream=True), "invalid_body", "stream=true is not supported"),
        (chat_line("a", stream=True), "invalid_body", "stream=true is not supported"),
        (chat_line("a", service_tier="fastest"), "invalid_body", "'body.service_tier'"),
        (chat_line("a", metadata={"k": 1}), "invalid_body", "'body.metadata.k'"),
        (completion_line("a", suffix="x"), "invalid_body", "unsupported parameter 'body.suffix'"),
        (completion_line("a", top_p=0), "invalid_parameter", "top_p must be in (0, 1]"),
    ],
)
def test_bad_lines_get_error_records_that_say_what_is_wrong(line: str, code: str, message_part: str) -> None:
    error = rejected(validator().validate(line))
    assert error.code == code
    assert message_part in error.message
    assert error.custom_id == "a"


class NoBosTokenizer(WordTokenizer):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return super().encode(text, add_special_tokens=False)


def test_an_empty_text_prompt_is_rejected_when_it_tokenizes_to_nothing() -> None:
    no_bos = BatchLineValidator(NoBosTokenizer(), 64, models=SERVED)
    error = rejected(no_bos.validate(completion_line("a", prompt="")))
    assert (error.code, error.message) == ("invalid_body", "the prompt is empty")


def test_a_repeated_custom_id_is_rejected_and_the_first_line_keeps_running() -> None:
    lines = validator()
    accepted(lines.validate(chat_line("same")))
    error = rejected(lines.validate(completion_line("same")))
    assert error.code == "duplicate_custom_id"
    assert error.custom_id == "same"
    assert "'same'" in error.message
    accepted(lines.validate(chat_line("other")))


def test_a_custom_id_counts_as_used_even_when_its_line_is_invalid() -> None:
    lines = validator()
    rejected(lines.validate(chat_line("x", temperature=-1)))
    assert rejected(lines.validate(chat_line("x"))).code == "duplicate_custom_id"


def test_lines_must_match_the_batch_endpoint_when_one_is_given() -> None:
    chat_batch = validator(endpoint=CHAT_COMPLETIONS)
    accepted(chat_batch.validate(chat_line("a")))
    error = rejected(chat_batch.validate(completion_line("b")))
    assert error.code == "mismatched_endpoint"
    assert "'/v1/completions'" in error.message and "'/v1/chat/completions'" in error.message


def test_without_a_batch_endpoint_both_endpoints_are_served() -> None:
    lines = validator(endpoint=None)
    assert accepted(lines.validate(chat_line("a"))).url == CHAT_COMPLETIONS
    assert accepted(lines.validate(completion_line("b"))).url == COMPLETIONS


def test_a_chat_template_that_refuses_the_conversation_rejects_only_that_line() -> None:
    lines = BatchLineValidator(RefusingTemplateTokenizer(), 64, models=SERVED)
    error = rejected(lines.validate(chat_line("a")))
    assert error.code == "invalid_body"
    assert "roles must alternate" in error.message


# ---------------------------------------------------------------------------------------------------------
# Context length: the prompt must leave room for one token; explicit max_tokens must fit, defaults are cut


def test_a_prompt_that_fills_the_context_is_rejected() -> None:
    error = rejected(validator(max_model_len=4).validate(completion_line("a", prompt="one two three")))  # 4 tokens
    assert error.code == "context_length_exceeded"
    assert "maximum context length is 4 tokens" in error.message
    assert "prompt has 4 tokens" in error.message


def test_an_explicit_max_tokens_that_does_not_fit_is_rejected_like_openai() -> None:
    error = rejected(validator(max_model_len=10).validate(chat_line("a", max_tokens=7)))  # 4 prompt tokens
    assert error.code == "context_length_exceeded"
    assert "you requested 11 tokens (4 in the prompt, 7 for the completion)" in error.message


def test_an_explicit_max_tokens_that_exactly_fits_is_kept() -> None:
    request = accepted(validator(max_model_len=10).validate(chat_line("a", max_tokens=6)))
    assert request.sampling_params.max_tokens == 6


def test_chat_without_max_tokens_may_use_the_rest_of_the_context() -> None:
    request = accepted(validator(max_model_len=64).validate(chat_line("a")))
    assert [len(prompt) for prompt in request.prompts] == [4]
    assert request.sampling_params.max_tokens == 60


def test_completions_default_to_16_tokens_cut_to_the_remaining_context() -> None:
    assert accepted(validator(max_model_len=64).validate(completion_line("a"))).sampling_params.max_tokens == 16
    assert accepted(validator(max_model_len=10).validate(completion_line("a"))).sampling_params.max_tokens == 6


# ---------------------------------------------------------------------------------------------------------
# Good lines map to the right prompt and SamplingParams


def test_a_chat_line_maps_every_sampling_field() -> None:
    line = chat_line(
        "chat",
        model="gpt-4o-mini",
        user="someone",
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        max_tokens=20,
        temperature=0.7,
        top_p=0.9,
        n=2,
        stop="END",
        seed=11,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        logprobs=True,
        top_logprobs=3,
        top_k=40,
        min_p=0.05,
        repetition_penalty=1.1,
        ignore_eos=True,
        min_tokens=2,
        stop_token_ids=[7, 8],
    )
    request = accepted(validator().validate(line))
    assert request.custom_id == "chat"
    assert request.url == CHAT_COMPLETIONS
    # "[system] be brief [user] hi [assistant]", encoded without BOS: the template wrote the special tokens
    assert request.prompts == [[18, 12, 15, 16, 12, 21]]
    assert request.sampling_params == SamplingParams(
        n=2, temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seed=11, max_tokens=20, min_tokens=2,
        stop=["END"], stop_token_ids=[7, 8], ignore_eos=True, repetition_penalty=1.1,
        presence_penalty=0.5, frequency_penalty=-0.5, logprobs=3,
    )


def test_unset_chat_fields_keep_the_openai_defaults() -> None:
    params = accepted(validator().validate(chat_line("a", max_tokens=5))).sampling_params
    assert params == SamplingParams(max_tokens=5)


def test_chat_logprobs_without_top_logprobs_reports_only_the_sampled_token() -> None:
    assert accepted(validator().validate(chat_line("a", logprobs=True))).sampling_params.logprobs == 0
    assert accepted(validator().validate(chat_line("b", logprobs=False))).sampling_params.logprobs is None


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    request = accepted(validator().validate(chat_line("a", max_tokens=30, max_completion_tokens=5)))
    assert request.sampling_params.max_tokens == 5


def test_text_parts_are_joined_and_the_developer_role_reads_as_system() -> None:
    messages = [
        {"role": "developer", "content": "terse"},
        {"role": "user", "content": [{"type": "text", "text": "a b"}, {"type": "text", "text": "c"}]},
    ]
    request = accepted(validator().validate(chat_line("a", messages=messages)))
    assert request.prompts == [WordTokenizer().encode("[system] terse [user] a b\nc [assistant]", False)]


def test_integers_are_accepted_where_numbers_are_expected() -> None:
    assert accepted(validator().validate(chat_line("a", temperature=0, top_p=1))).sampling_params.greedy


def test_null_parameters_mean_the_default() -> None:
    request = accepted(validator().validate(completion_line("a", temperature=None, max_tokens=None, stop=None)))
    assert request.sampling_params == SamplingParams(max_tokens=16)


def test_a_completion_line_maps_its_prompt_and_fields() -> None:
    line = completion_line("c", prompt="one two", max_tokens=8, temperature=0, logprobs=2, stop=["x", "y"], echo=False)
    request = accepted(validator().validate(line))
    assert request.url == COMPLETIONS
    assert request.prompts == [[BOS_ID, 13, 13]]  # text prompts are encoded with special tokens
    assert request.sampling_params == SamplingParams(temperature=0.0, max_tokens=8, stop=["x", "y"], logprobs=2)


def test_best_of_and_beam_search_fields_reach_the_engine() -> None:
    best = accepted(validator().validate(completion_line("b", prompt="one", n=2, best_of=4)))
    assert (best.sampling_params.n, best.sampling_params.best_of) == (2, 4)
    line = chat_line("s", temperature=0, n=2, use_beam_search=True, beam_width=3, length_penalty=0.5)
    beam = accepted(validator().validate(line)).sampling_params
    assert (beam.use_beam_search, beam.beam_width, beam.length_penalty) == (True, 3, 0.5)
    error = validator().validate(chat_line("t", use_beam_search=True))  # OpenAI's default temperature is 1
    assert isinstance(error, LineError) and error.code == "invalid_parameter" and "temperature" in error.message


@pytest.mark.parametrize("prompt", [[5, 6, 7], [[5, 6, 7]]])
def test_token_id_prompts_are_used_as_they_are(prompt: list[Any]) -> None:
    assert accepted(validator().validate(completion_line("a", prompt=prompt))).prompts == [[5, 6, 7]]


def test_a_one_element_list_of_text_is_a_single_prompt() -> None:
    assert accepted(validator().validate(completion_line("a", prompt=["one two"]))).prompts == [[1, 13, 13]]


def test_a_list_of_prompts_runs_each_with_the_parameters_fitted_to_the_longest() -> None:
    request = accepted(validator(max_model_len=10).validate(completion_line("a", prompt=["one", [5, 6, 7, 8], "a b"])))
    assert request.prompts == [[BOS_ID, 13], [5, 6, 7, 8], [BOS_ID, 11, 11]]
    assert request.sampling_params.max_tokens == 6  # the default 16, cut to what the longest prompt leaves


def test_lines_may_arrive_as_bytes() -> None:
    accepted(validator().validate(chat_line("a").encode("utf-8")))


def test_every_line_of_the_example_job_is_valid() -> None:
    lines = validator(max_model_len=2048)
    results = [lines.validate(line) for line in EXAMPLE_FILE.read_bytes().splitlines() if line.strip()]
    assert [result for result in results if isinstance(result, LineError)] == []
    assert {result.url for result in results if isinstance(result, BatchRequest)} == {CHAT_COMPLETIONS, COMPLETIONS}


# ---------------------------------------------------------------------------------------------------------
# Output records


@dataclass
class FakeSample:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[dict[int, float]] | None = None
    stop_reason: str | int | None = None  # the stop string or token id that ended it


@dataclass
class FakeResult:
    prompt_token_ids: list[int]
    outputs: list[FakeSample] = field(default_factory=list)
    num_cached_tokens: int = 0
    error: str | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None


def as_json(record: Any) -> dict[str, Any]:
    return json.loads(record.model_dump_json())


def test_an_error_record_has_no_response() -> None:
    record = as_json(error_record(LineError("a", "invalid_parameter", "temperature must be >= 0, got -1.0")))
    assert record["id"].startswith("batch_req_")
    assert record == {
        "id": record["id"],
        "custom_id": "a",
        "response": None,
        "error": {"code": "invalid_parameter", "message": "temperature must be >= 0, got -1.0"},
    }


def test_an_error_record_for_an_unreadable_line_has_a_null_custom_id() -> None:
    assert as_json(error_record(LineError(None, "invalid_json_line", "bad")))["custom_id"] is None


def test_a_chat_response_is_shaped_like_openai_chat_completion() -> None:
    request = accepted(validator().validate(chat_line("chat", max_tokens=5)))
    result = FakeResult([1, 2, 3, 4], [FakeSample(0, "Hello!", [30, 31], "stop")])
    record = as_json(response_record(request, [result], model="smollm2", tokenizer=WordTokenizer()))

    assert record["id"].startswith("batch_req_")
    assert record["custom_id"] == "chat"
    assert record["error"] is None
    response = record["response"]
    assert response["status_code"] == 200
    assert response["request_id"].startswith("req_")
    body = response["body"]
    assert body["id"].startswith("chatcmpl-")
    assert isinstance(body["created"], int)
    assert body == {
        "id": body["id"],
        "object": "chat.completion",
        "created": body["created"],
        "model": "smollm2",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello!"},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6, "prompt_tokens_details": {"cached_tokens": 0}},
    }


def test_chat_logprobs_list_exactly_top_logprobs_alternatives_best_first() -> None:
    request = accepted(validator().validate(chat_line("chat", logprobs=True, top_logprobs=2)))
    # The second token was sampled from outside the top 2, so the engine reported it as a third entry.
    logprobs = [{30: -0.1, 40: -2.5, 41: -3.0}, {42: -0.2, 43: -0.9, 31: -4.0}]
    result = FakeResult([1, 2], [FakeSample(0, "ab", [30, 31], "length", logprobs)])
    choice = as_json(response_record(request, [result], model="m", tokenizer=WordTokenizer()))["response"]["body"][
        "choices"
    ][0]
    assert choice["finish_reason"] == "length"
    assert choice["logprobs"] == {
        "content": [
            {
                "token": "<30>", "logprob": -0.1, "bytes": list(b"<30>"),
                "top_logprobs": [
                    {"token": "<30>", "logprob": -0.1, "bytes": list(b"<30>")},
                    {"token": "<40>", "logprob": -2.5, "bytes": list(b"<40>")},
                ],
            },
            {
                "token": "<31>", "logprob": -4.0, "bytes": list(b"<31>"),
                "top_logprobs": [
                    {"token": "<42>", "logprob": -0.2, "bytes": list(b"<42>")},
                    {"token": "<43>", "logprob": -0.9, "bytes": list(b"<43>")},
                ],
            },
        ]
    }


def test_chat_logprobs_true_alone_gives_empty_alternatives() -> None:
    request = accepted(validator().validate(chat_line("chat", logprobs=True)))
    result = FakeResult([1], [FakeSample(0, "a", [30], "stop", [{30: -0.5}])])
    choice = as_json(response_record(request, [result], model="m", tokenizer=WordTokenizer()))["response"]["body"][
        "choices"
    ][0]
    assert choice["logprobs"]["content"] == [{"token": "<30>", "logprob": -0.5, "bytes": list(b"<30>"),
                                              "top_logprobs": []}]


def test_several_samples_become_choices_in_index_order_and_usage_counts_them_all() -> None:
    request = accepted(validator().validate(chat_line("chat", n=2)))
    result = FakeResult([1, 2, 3], [FakeSample(1, "second", [5, 6, 7], "length"), FakeSample(0, "first", [5], "stop")])
    body = as_json(response_record(request, [result], model="m", tokenizer=WordTokenizer()))["response"]["body"]
    assert [(choice["index"], choice["message"]["content"]) for choice in body["choices"]] == [
        (0, "first"),
        (1, "second"),
    ]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7, "prompt_tokens_details": {"cached_tokens": 0}}


def test_a_completion_response_is_shaped_like_openai_text_completion() -> None:
    request = accepted(validator().validate(completion_line("text")))
    result = FakeResult([1, 13], [FakeSample(0, " and more", [20, 21], "length")])
    body = as_json(response_record(request, [result], model="smollm2", tokenizer=WordTokenizer()))["response"]["body"]
    assert body["id"].startswith("cmpl-")
    assert body == {
        "id": body["id"],
        "object": "text_completion",
        "created": body["created"],
        "model": "smollm2",
        "choices": [{"index": 0, "text": " and more", "logprobs": None, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4, "prompt_tokens_details": {"cached_tokens": 0}},
    }


def test_completion_logprobs_use_the_legacy_parallel_lists() -> None:
    request = accepted(validator().validate(completion_line("text", logprobs=1)))
    logprobs = [{100: -0.3, 200: -1.5}, {7: -0.1}]
    result = FakeResult([1], [FakeSample(0, "<100><7>", [100, 7], "stop", logprobs)])
    choice = as_json(response_record(request, [result], model="m", tokenizer=WordTokenizer()))["response"]["body"][
        "choices"
    ][0]
    assert choice["logprobs"] == {
        "tokens": ["<100>", "<7>"],
        "token_logprobs": [-0.3, -0.1],
        "top_logprobs": [{"<100>": -0.3, "<200>": -1.5}, {"<7>": -0.1}],
        "text_offset": [0, 5],
    }


def test_several_prompts_give_choices_in_openai_order_and_usage_sums_them() -> None:
    request = accepted(validator().validate(completion_line("p", prompt=["one", "two three"], n=2, echo=True)))
    first = FakeResult([BOS_ID, 13], [FakeSample(1, " b", [21], "stop"), FakeSample(0, " a", [20], "stop")], 1)
    second = FakeResult([BOS_ID, 13, 15], [FakeSample(0, " c", [22, 23], "length"), FakeSample(1, " d", [24], "stop")])
    body = as_json(response_record(request, [first, second], model="m", tokenizer=WordTokenizer()))["response"]["body"]
    assert [(choice["index"], choice["text"]) for choice in body["choices"]] == [
        (0, "one a"), (1, "one b"), (2, "two three c"), (3, "two three d"),
    ]  # index = prompt_index * n + sample_index
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10,
                             "prompt_tokens_details": {"cached_tokens": 1}}
    aborted = FakeResult([BOS_ID, 13, 15], [FakeSample(0, "", [], "abort"), FakeSample(1, "", [], "abort")])
    record = as_json(response_record(request, [first, aborted], model="m", tokenizer=WordTokenizer()))
    assert record["error"]["code"] == "generation_aborted"  # a line is answered whole or not at all


def test_an_aborted_request_becomes_an_error_record() -> None:
    request = accepted(validator().validate(completion_line("text")))
    result = FakeResult([1], [FakeSample(0, "par", [5], "abort")])
    record = as_json(response_record(request, [result], model="m", tokenizer=WordTokenizer()))
    assert record["custom_id"] == "text"
    assert record["response"] is None
    assert record["error"]["code"] == "generation_aborted"


def test_fields_that_change_nothing_in_a_batch_are_accepted() -> None:
    plain = accepted(validator().validate(chat_line("plain")))
    noted = accepted(
        validator().validate(
            chat_line(
                "noted", stream=False, store=True, metadata={"team": "search"}, service_tier="auto", user="u-1"
            )
        )
    )
    assert (noted.prompts, noted.sampling_params) == (plain.prompts, plain.sampling_params)
    assert accepted(validator().validate(completion_line("c", stream=False))).sampling_params.max_tokens == 16


class NamingTokenizer(WordTokenizer):
    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return " ".join(f"[{message['role']}:{message.get('name', '-')}] {message['content']}" for message in messages)


def test_a_message_name_reaches_the_chat_template() -> None:
    lines = BatchLineValidator(NamingTokenizer(), 64, models=SERVED)
    line = chat_line("named", messages=[{"role": "user", "content": "hi", "name": "ada"}])
    assert accepted(lines.validate(line)).prompts == [WordTokenizer().encode("[user:ada] hi", False)]


def test_echo_puts_the_prompt_before_each_choice() -> None:
    request = accepted(validator().validate(completion_line("e", prompt="one two", echo=True, n=2)))
    result = FakeResult([BOS_ID, 5, 6], [FakeSample(0, " three", [7], "stop"), FakeSample(1, " four", [8], "length")])
    body = as_json(response_record(request, [result], model="m", tokenizer=WordTokenizer()))["response"]["body"]
    assert [choice["text"] for choice in body["choices"]] == ["one two three", "one two four"]
    by_ids = accepted(validator().validate(completion_line("i", prompt=[5, 6], echo=True)))
    assert by_ids.context == ["<5><6>"]  # token-id prompts echo their decoded text


def test_echo_with_logprobs_reports_the_prompt_tokens_first_as_openai_does() -> None:
    request = accepted(validator().validate(completion_line("e", prompt=[5, 6], echo=True, logprobs=1)))
    assert (request.sampling_params.logprobs, request.sampling_params.prompt_logprobs) == (1, 1)
    assert accepted(validator().validate(completion_line("l", logprobs=1))).sampling_params.prompt_logprobs is None
    prompt_logprobs = [None, {6: -2.0, 9: -0.5}]  # the engine's: the prompt token's own, then the top alternatives
    sample = FakeSample(0, "<7>", [7], "stop", [{7: -0.25}])
    result = FakeResult([5, 6], [sample], prompt_logprobs=prompt_logprobs)
    choice = as_json(response_record(request, [result], model="m", tokenizer=WordTokenizer()))["response"]["body"][
        "choices"
    ][0]
    assert choice["text"] == "<5><6><7>"
    assert choice["logprobs"] == {
        "tokens": ["<5>", "<6>", "<7>"],
        "token_logprobs": [None, -2.0, -0.25],
        "top_logprobs": [None, {"<9>": -0.5, "<6>": -2.0}, {"<7>": -0.25}],
        "text_offset": [0, 3, 6],
    }
