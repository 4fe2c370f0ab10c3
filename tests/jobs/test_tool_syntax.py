"""Tool-call syntaxes without a model: the family each published chat template is read as, calls parsed from sample
outputs (single, parallel, malformed), and every constraint accepting exactly what the parser reads back (xgrammar
on a character vocabulary)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.structured_output import compile_grammar
from jobs.openai_format.tool_calls import NamedToolChoice, Tool, plan_tool_calls, template_messages
from jobs.openai_format.tool_syntax import HERMES, LLAMA3_JSON, MISTRAL, MISTRAL_ARGS, MISTRAL_V3, detect_call_syntax
from tests.jobs.test_structured_lines import WEATHER_TOOL

TEMPLATES = Path(__file__).parent / "chat_templates"
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET", "PST"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [Tool.model_validate(WEATHER_TOOL), Tool.model_validate(TIME_TOOL)]
NAMES = ("get_weather", "get_time")
PARIS = ("get_weather", {"city": "Paris", "unit": "C"})
CET = ("get_time", {"zone": "CET"})
SYNTAXES = {
    "hermes": HERMES, "llama3_json": LLAMA3_JSON, "mistral": MISTRAL, "mistral_v3": MISTRAL_V3, "mistral_args": MISTRAL_ARGS,
}


@pytest.mark.parametrize(
    "template, syntax",
    [
        ("llama-3.2-3b-instruct.jinja", LLAMA3_JSON),
        ("llama-3.3-70b-instruct.jinja", LLAMA3_JSON),
        ("mistral-nemo-instruct-2407.jinja", MISTRAL),
        ("mistral-7b-instruct-v0.3.jinja", MISTRAL_V3),
        ("mistral-small-3.2-24b-instruct-2506.jinja", MISTRAL_ARGS),
    ],
)
def test_each_published_template_is_read_as_its_family(template, syntax):
    assert detect_call_syntax((TEMPLATES / template).read_text()) is syntax


def test_templates_without_a_family_get_the_generic_format():
    from tests.jobs.test_tool_calls import QWEN_TEMPLATE

    assert detect_call_syntax(QWEN_TEMPLATE) is HERMES
    assert detect_call_syntax(None) is None
    chatml = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    assert detect_call_syntax(chatml) is None
    # a Llama 3 template without tools (Llama 3.0's) has no call syntax
    assert detect_call_syntax("<|start_header_id|>{{ message['role'] }}<|end_header_id|>") is None


@pytest.mark.parametrize(
    "syntax, text, content, calls",
    [
        # one call, with or without the special-token marker (left out of the decoded text, or spelled out)
        ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}', None, [PARIS]),
        ("llama3_json", '<|python_tag|>{"name": "get_time", "parameters": {"zone": "CET"}}', None, [CET]),
        ("mistral", '[{"name": "get_time", "arguments": {"zone": "CET"}}]', None, [CET]),
        ("mistral", '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "CET"}}]', None, [CET]),
        ("mistral_v3", ' [{"name": "get_time", "arguments": {"zone": "CET"}, "id": "a1B2c3D4e"}]', None, [CET]),
        # Mistral's [ARGS] format: markers spelled out, left out (special tokens), and a past call's [CALL_ID]
        ("mistral_args", '[TOOL_CALLS]get_time[ARGS]{"zone": "CET"}', None, [CET]),
        ("mistral_args", 'get_weather{"city": "Paris", "unit": "C"}get_time{"zone": "CET"}', None, [PARIS, CET]),
        ("mistral_args", '[TOOL_CALLS]get_time[CALL_ID]a1B2c3D4e[ARGS]{"zone": "CET"}', None, [CET]),
        ("mistral_args", 'Checking. [TOOL_CALLS]get_time[ARGS]{"zone": "CET"}', "Checking.", [CET]),
        ("mistral_args", 'forget_time{"zone": "CET"}', 'forget_time{"zone": "CET"}', []),  # not a name on its own
        ("mistral_args", '[TOOL_CALLS]get_time[ARGS]"CET"', '[TOOL_CALLS]get_time[ARGS]"CET"', []),
        ("mistral_args", '[TOOL_CALLS]get_date[ARGS]{}', '[TOOL_CALLS]get_date[ARGS]{}', []),
        # the grammar lets raw control characters into JSON strings (a random model wrote this one)
        ("mistral", '[{"name": "get_time", "arguments": {"zone":"\x1e"\n}}]', None, [("get_time", {"zone": "\x1e"})]),
        # text around a call is the content
        ("llama3_json", 'Let me check. {"name": "get_time", "parameters": {"zone": "CET"}}', "Let me check.", [CET]),
        ("hermes", 'Checking.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>',
         "Checking.", [CET]),
        # parallel calls: Mistral's array, Hermes' blocks
        ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}, '
                    '{"name": "get_time", "arguments": {"zone": "CET"}}]', None, [PARIS, CET]),
        ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>\n'
                   '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>', None, [PARIS, CET]),
        # malformed: not a call, so the text stays the content, whole (finish_reason stop, or length when cut)
        ("llama3_json", '{"name": "get_time", "parameters": {"zone": "CE', '{"name": "get_time", "parameters": {"zone": "CE', []),
        ("llama3_json", '{"name": "get_date", "parameters": {}}', '{"name": "get_date", "parameters": {}}', []),
        ("llama3_json", '{"name": "get_time", "arguments": {"zone": "CET"}}',
         '{"name": "get_time", "arguments": {"zone": "CET"}}', []),  # Hermes' key, not Llama's
        ("llama3_json", '{"name": "get_time", "parameters": "zone=CET"}', '{"name": "get_time", "parameters": "zone=CET"}', []),
        ("mistral", '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "CET"}}, {"name": "nope", "arguments": {}}]',
         '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "CET"}}, {"name": "nope", "arguments": {}}]', []),
        ("mistral", '[TOOL_CALLS][]', '[TOOL_CALLS][]', []),
        ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}', '<tool_call>\n{"name": "get_time", '
                   '"arguments": {"zone": "CET"}}', []),  # never closed
        ("mistral", "It is sunny in Paris.", "It is sunny in Paris.", []),
        # one malformed block beside a good one: the good one is the call, the bad one stays in the content
        ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>\n<tool_call>\n{oops}\n'
                   '</tool_call>', "<tool_call>\n{oops}\n</tool_call>", [CET]),
    ],
)
def test_calls_are_read_from_generated_text(syntax, text, content, calls):
    assert SYNTAXES[syntax].parse(text, NAMES) == (content, calls)


VOCABULARY = [chr(code) for code in range(32, 127)] + ["\n", "[TOOL_CALLS]", "</s>"]
STOP = len(VOCABULARY) - 1


@pytest.fixture(scope="module")
def compiler():
    import xgrammar

    return xgrammar.GrammarCompiler(xgrammar.TokenizerInfo(VOCABULARY, stop_token_ids=[STOP]))


def accepts(compiler, constraint, text: str) -> bool:
    import xgrammar

    matcher = xgrammar.GrammarMatcher(compile_grammar(compiler, constraint))
    return matcher.accept_string(text) and matcher.accept_token(STOP)


@pytest.mark.parametrize("name", SYNTAXES)
def test_every_constraint_accepts_what_the_parser_reads(compiler, name):
    syntax = SYNTAXES[name]
    calls = [PARIS, CET] if syntax.parallel else [CET]
    text = syntax.calls_text(calls)
    assert syntax.parse(text, NAMES) == (None, calls)
    for choice in ("required", "auto"):
        plan, constraint = plan_tool_calls(TOOLS, choice, None, syntax)
        assert plan is not None and plan.syntax is syntax and accepts(compiler, constraint, text)
    # the arguments are held to the function's schema
    assert not accepts(compiler, plan_tool_calls(TOOLS, "required", None, syntax)[1],
                       syntax.calls_text([("get_time", {"zone": "Mars"})]))
    # one call at most without parallel calls, exactly the named one with a named function
    _, single = plan_tool_calls(TOOLS, "required", False, syntax)
    assert accepts(compiler, single, syntax.calls_text([CET]))
    assert not accepts(compiler, single, syntax.calls_text([CET, CET]))
    get_time = NamedToolChoice.model_validate({"type": "function", "function": {"name": "get_time"}})
    _, named = plan_tool_calls(TOOLS, get_time, None, syntax)
    assert accepts(compiler, named, syntax.calls_text([CET]))
    assert not accepts(compiler, named, syntax.calls_text([PARIS]))
    # auto: free text is an answer too
    assert accepts(compiler, plan_tool_calls(TOOLS, "auto", None, syntax)[1], "It is sunny.")


def test_llama_carries_one_call_a_turn():
    plan, constraint = plan_tool_calls(TOOLS, "required", True, LLAMA3_JSON)
    assert plan is not None and not plan.parallel
    assert constraint.structural_tag["format"]["stop_after_first"]


def test_mistral_templates_get_call_ids_they_accept():
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "tool_calls": [
            {"id": "call_Xy7", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "a1B2c3D4e", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}},
        ]},
        {"role": "tool", "tool_call_id": "call_Xy7", "content": "21"},
        {"role": "tool", "tool_call_id": "a1B2c3D4e", "content": "14:05"},
    ]
    rendered = template_messages(messages, MISTRAL)
    first, second = (call["id"] for call in rendered[1]["tool_calls"])
    assert len(first) == 9 and first.isalnum() and second == "a1B2c3D4e"  # an id the template accepts is kept
    assert [rendered[2]["tool_call_id"], rendered[3]["tool_call_id"]] == [first, second]
    assert rendered[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    # other families keep OpenAI's ids
    assert template_messages(messages, LLAMA3_JSON)[2]["tool_call_id"] == "call_Xy7"

