"""Reasoning output (`jobs.openai_format.reasoning`): the published thinking templates (DeepSeek-R1's distills, which
open the thinking, and Qwen3's, whose model opens it unless `enable_thinking` is false) rendered as transformers
renders them; OpenAI's effort and Anthropic's `thinking` set Qwen3's switch, or are refused where a template cannot
do as asked; the split of the thinking from the answer; constraints that wait for the end of the thinking; and the
real SmolLM2, forced through each template's think markers, answered with its thinking apart and a JSON answer that
validates."""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from engine.structured_output import StructuredOutputParams, compile_grammar, tokenizer_info
from engine.tokenizer import Tokenizer
from jobs.openai_format.reasoning import THINK_END, THINK_START, ReasoningPlan, after_thinking, reasoning_plan, split_reasoning
from jobs.openai_format.records import response_record
from jobs.openai_format.requests import BatchRequest
from jobs.openai_format.validation import BatchLineValidator
from tests.jobs.test_openai_format import SERVED, FakeResult, FakeSample, WordTokenizer, as_json

TEMPLATES = Path(__file__).parent / "chat_templates"
R1_TEMPLATE = (TEMPLATES / "deepseek-r1-distill-qwen-32b.jinja").read_text()
QWEN3_TEMPLATE = (TEMPLATES / "qwen3-0.6b.jinja").read_text()  # thinks unless `enable_thinking` is false
SCHEMA = {
    "type": "object",
    "properties": {"colour": {"type": "string", "maxLength": 12}},
    "required": ["colour"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]


def templated_folder(smollm2_folder: Path, folder: Path, template: str) -> Path:
    """SmolLM2's tokenizer under another published template."""
    folder.mkdir(exist_ok=True)
    shutil.copy(smollm2_folder / "tokenizer.json", folder)
    config = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": template,
              "tokenizer_class": "PreTrainedTokenizerFast"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def chat_line(**body: Any) -> str:
    body = {"messages": MESSAGES, "max_tokens": 64, **body}
    return json.dumps({"custom_id": "think", "method": "POST", "url": "/v1/chat/completions", "body": body})


def responses_line(**body: Any) -> str:
    body = {"instructions": "Be brief.", "input": "Name a colour.", "max_output_tokens": 64, **body}
    return json.dumps({"custom_id": "think", "method": "POST", "url": "/v1/responses", "body": body})


def anthropic_line(**params: Any) -> str:
    params = {"model": "smollm2", "max_tokens": 64, "system": "Be brief.",
              "messages": [{"role": "user", "content": "Name a colour."}], **params}
    return json.dumps({"custom_id": "think", "method": "POST", "url": "/v1/messages", "body": params})


def validated(tokenizer: Tokenizer, text: str) -> BatchRequest:
    request = BatchLineValidator(tokenizer, 2048, models=SERVED).validate(text)
    assert isinstance(request, BatchRequest), request
    return request


@pytest.mark.parametrize("template, kwargs, plan", [
    (R1_TEMPLATE, {}, ReasoningPlan(opened=True)),  # R1's generation prompt opens <think> itself
    (QWEN3_TEMPLATE, {}, ReasoningPlan(opened=False)),  # Qwen3's model opens it
    (QWEN3_TEMPLATE, {"enable_thinking": False}, None),  # switched off: an empty, closed block
    (QWEN3_TEMPLATE, {"enable_thinking": True}, ReasoningPlan(opened=False)),
], ids=["r1", "qwen3", "qwen3-no-thinking", "qwen3-thinking"])
def test_templates_render_as_transformers_does_and_say_whether_the_answer_thinks(
    smollm2_folder: Path, tmp_path: Path, template: str, kwargs: dict[str, Any], plan: ReasoningPlan | None
) -> None:
    import transformers

    folder = templated_folder(smollm2_folder, tmp_path / "templated", template)
    expected = transformers.AutoTokenizer.from_pretrained(folder).apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=False, **kwargs
    )
    tokenizer = Tokenizer.from_folder(folder)
    request = validated(tokenizer, chat_line(**({"chat_template_kwargs": kwargs} if kwargs else {})))
    assert request.prompts == [tokenizer.encode(expected, add_special_tokens=False)]
    assert request.reasoning == plan
    assert reasoning_plan(None, expected) is None and reasoning_plan("{{ messages }}", expected) is None


@pytest.mark.parametrize("thinking", [True, False])
def test_qwen3_renders_an_earlier_turns_thinking_as_transformers_does(
    smollm2_folder: Path, tmp_path: Path, thinking: bool
) -> None:
    import transformers

    conversation = [*MESSAGES, {"role": "assistant", "content": "<think>\nshort\n</think>\n\nRed."},
                    {"role": "user", "content": "Another?"}]
    folder = templated_folder(smollm2_folder, tmp_path / "qwen3", QWEN3_TEMPLATE)
    expected = transformers.AutoTokenizer.from_pretrained(folder).apply_chat_template(
        conversation, add_generation_prompt=True, tokenize=False, enable_thinking=thinking
    )
    assert "short" not in expected  # Qwen3 drops the thinking of turns before the last question
    tokenizer = Tokenizer.from_folder(folder)
    request = validated(tokenizer, chat_line(messages=conversation, reasoning_effort="high" if thinking else "none"))
    assert request.prompts == [tokenizer.encode(expected, add_special_tokens=False)]


def test_chat_template_kwargs_cannot_replace_what_conveyor_passes() -> None:
    refused = BatchLineValidator(WordTokenizer(), 64, models=SERVED).validate(chat_line(chat_template_kwargs={"messages": []}))
    assert not isinstance(refused, BatchRequest) and "set by conveyor itself" in refused.message


@pytest.mark.parametrize("template, line, switch", [
    (QWEN3_TEMPLATE, chat_line(reasoning_effort="none"), False),
    (QWEN3_TEMPLATE, chat_line(reasoning_effort="minimal"), False),
    (QWEN3_TEMPLATE, chat_line(reasoning_effort="low"), True),
    (QWEN3_TEMPLATE, chat_line(reasoning_effort="xhigh", chat_template_kwargs={"enable_thinking": True}), True),
    (QWEN3_TEMPLATE, responses_line(reasoning={"effort": "none"}), False),
    (QWEN3_TEMPLATE, responses_line(reasoning={"effort": "medium"}), True),
    (QWEN3_TEMPLATE, anthropic_line(thinking={"type": "disabled"}), False),
    (QWEN3_TEMPLATE, anthropic_line(thinking={"type": "enabled", "budget_tokens": 64}), True),  # cannot bind
    (R1_TEMPLATE, chat_line(reasoning_effort="high"), None),  # R1 always thinks: asking it to is honoured as is
    (R1_TEMPLATE, anthropic_line(thinking={"type": "enabled"}), None),
], ids=["none", "minimal", "low", "xhigh-agreeing", "responses-none", "responses-medium", "anthropic-disabled",
        "anthropic-enabled", "r1-high", "r1-anthropic-enabled"])
def test_effort_and_anthropics_thinking_set_the_templates_switch(
    smollm2_folder: Path, tmp_path: Path, template: str, line: str, switch: bool | None
) -> None:
    import transformers

    folder = templated_folder(smollm2_folder, tmp_path / "templated", template)
    variables = {} if switch is None else {"enable_thinking": switch}
    expected = transformers.AutoTokenizer.from_pretrained(folder).apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=False, **variables
    )
    tokenizer = Tokenizer.from_folder(folder)
    request = validated(tokenizer, line)
    assert request.prompts == [tokenizer.encode(expected, add_special_tokens=False)]
    assert (request.reasoning is not None) == (switch is not False)
    if request.url == "/v1/responses":  # the response object repeats the request's reasoning, as OpenAI's does
        sample = FakeSample(0, "Red.", [15], "stop")
        body = as_json(response_record(request, [FakeResult([1], [sample])], model="m", tokenizer=SampleWords()))
        assert body["response"]["body"]["reasoning"] == json.loads(line)["body"]["reasoning"]


@pytest.mark.parametrize("template, line, words", [
    (R1_TEMPLATE, chat_line(reasoning_effort="none"),
     "reasoning_effort='none' asks for no thinking, but this model's chat template always thinks"),
    (R1_TEMPLATE, responses_line(reasoning={"effort": "minimal"}), "reasoning.effort='minimal' asks for no thinking"),
    (R1_TEMPLATE, anthropic_line(thinking={"type": "disabled"}), "thinking.type='disabled' asks for no thinking"),
    (QWEN3_TEMPLATE, chat_line(reasoning_effort="high", chat_template_kwargs={"enable_thinking": False}),
     "reasoning_effort='high' contradicts chat_template_kwargs enable_thinking=False"),
    (QWEN3_TEMPLATE, anthropic_line(thinking={"type": "enabled", "budget_tokens": 16}),
     "thinking.budget_tokens=16 is not supported below max_tokens (64)"),
], ids=["r1-none", "r1-minimal", "r1-disabled", "contradiction", "budget"])
def test_thinking_a_template_cannot_do_as_asked_fails_its_line(
    smollm2_folder: Path, tmp_path: Path, template: str, line: str, words: str
) -> None:
    tokenizer = Tokenizer.from_folder(templated_folder(smollm2_folder, tmp_path / "templated", template))
    refused = BatchLineValidator(tokenizer, 2048, models=SERVED).validate(line)
    assert not isinstance(refused, BatchRequest) and words in refused.message, refused


@pytest.mark.parametrize("text, plan, split", [
    ("plan it</think>\n\nRed.", ReasoningPlan(opened=True), ("plan it", "Red.", True)),
    ("<think>\nplan it\n</think>\n\nRed.", ReasoningPlan(opened=False), ("plan it", "Red.", True)),
    ("Red.", ReasoningPlan(opened=False), (None, "Red.", False)),  # Qwen3 may answer without thinking
    ("still thinking when cut", ReasoningPlan(opened=True), ("still thinking when cut", "", False)),
])
def test_the_thinking_is_split_from_the_answer(text: str, plan: ReasoningPlan, split: tuple[Any, ...]) -> None:
    parts = split_reasoning(text, plan)
    assert (parts.reasoning, parts.answer, parts.finished_thinking) == split


def test_a_constraint_waits_for_the_end_of_the_thinking(smollm2_folder: Path) -> None:
    import xgrammar

    tokenizer = Tokenizer.from_folder(smollm2_folder)
    compiler = xgrammar.GrammarCompiler(tokenizer_info(tokenizer, tokenizer.vocab_size, [tokenizer.eos_token_id]))
    for plan, thinking in ((ReasoningPlan(opened=True), "any text at all</think>"), (ReasoningPlan(opened=False), "<think>hm</think>")):
        grammar = compile_grammar(compiler, after_thinking(StructuredOutputParams(json_schema=SCHEMA), plan))
        assert xgrammar.GrammarMatcher(grammar).accept_string(thinking + '{"colour": "red"}')
        assert not xgrammar.GrammarMatcher(grammar).accept_string(thinking + '{"shape": "round"}')
    for constraint in (StructuredOutputParams(regex="[0-9]+"), StructuredOutputParams(choice=("yes", "no"))):
        grammar = compile_grammar(compiler, after_thinking(constraint, ReasoningPlan(opened=True)))
        assert not xgrammar.GrammarMatcher(grammar).accept_string("x</think>maybe")


class SampleWords(WordTokenizer):
    """Decodes the sample's ids to its words."""

    WORDS = {14: "plan", 12: " it", 18: "</think>", 15: "Red."}

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.WORDS[token_id] for token_id in token_ids)


def test_answers_carry_the_thinking_apart_and_count_its_tokens() -> None:
    request = dataclasses.replace(validated(WordTokenizer(), chat_line()), reasoning=ReasoningPlan(opened=True))
    sample = FakeSample(0, "plan it</think>Red.", [14, 12, 18, 15], "stop")
    body = as_json(response_record(request, [FakeResult([1, 2], [sample])], model="m", tokenizer=SampleWords()))
    message = body["response"]["body"]["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("plan it", "Red.")
    assert body["response"]["body"]["usage"]["completion_tokens_details"] == {"reasoning_tokens": 3}
    plain = as_json(response_record(validated(WordTokenizer(), chat_line()), [FakeResult([1], [sample])], model="m", tokenizer=WordTokenizer()))
    assert "reasoning_content" not in plain["response"]["body"]["choices"][0]["message"]
    assert "completion_tokens_details" not in plain["response"]["body"]["usage"]  # as before, for models that do not think


@pytest.mark.slow
def test_smollm2_forced_through_the_think_markers_comes_back_split_with_a_valid_answer(
    smollm2_folder: Path, tmp_path: Path
) -> None:
    from engine.llm import LLM

    llm = LLM(str(smollm2_folder), dtype="float32", device="cpu")  # one load for both templates: it is the slow part
    schema_format = {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA, "strict": True}}
    for name, template, plan in (("r1", R1_TEMPLATE, ReasoningPlan(opened=True)), ("qwen3", QWEN3_TEMPLATE, ReasoningPlan(opened=False))):
        tokenizer = Tokenizer.from_folder(templated_folder(smollm2_folder, tmp_path / name, template))
        request = validated(tokenizer, chat_line(response_format=schema_format, temperature=0, reasoning_effort="high"))
        assert request.reasoning == plan, name
        assert request.sampling_params.structured_output == after_thinking(StructuredOutputParams(json_schema=SCHEMA), plan)
        # SmolLM2 never learnt to think: a few words of thinking are forced through the template's markers (Qwen3's
        # model opens the block itself, R1's prompt opened it), then the schema's JSON
        forced_thinking = {"type": "tag", "begin": "" if plan.opened else THINK_START,
                           "content": {"type": "regex", "pattern": "[a-z]{2,8}( [a-z]{2,8}){0,3}"}, "end": THINK_END}
        forced = StructuredOutputParams(structural_tag={"type": "structural_tag", "format": {"type": "sequence", "elements": [
            forced_thinking, {"type": "json_schema", "json_schema": SCHEMA}]}})
        params = dataclasses.replace(request.sampling_params, structured_output=forced)
        result = llm.generate(request.prompts, [params], use_tqdm=False)[0]
        body = as_json(response_record(request, [result], model="smollm2", tokenizer=tokenizer))["response"]["body"]
        message = body["choices"][0]["message"]
        assert message["reasoning_content"] and "think>" not in message["reasoning_content"], (name, message)
        jsonschema.validate(json.loads(message["content"]), SCHEMA)
        assert 0 < body["usage"]["completion_tokens_details"]["reasoning_tokens"] < body["usage"]["completion_tokens"]
