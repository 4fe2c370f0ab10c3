"""Reasoning output: the `<think>…</think>` text of templates that think (Qwen3, DeepSeek-R1 distills), kept apart
from the answer.

A template thinks when its text holds `</think>`. Whether a prompt's answer starts with thinking is read off the
rendered prompt: one that ends inside an opened `<think>` (DeepSeek-R1's templates open it themselves) starts in the
thinking; one that ends with a closed, empty block (Qwen3 with `enable_thinking: false`, through
`chat_template_kwargs`) does not think at all; otherwise the model may open `<think>` itself (Qwen3's default).
The answer's format splits the generated text (`split_reasoning`): the thinking becomes chat's
`message.reasoning_content` (vLLM's field), a Responses `reasoning` item, an Anthropic `thinking` block, and its
tokens `reasoning_tokens`. An output constraint (structured output, tool calls) applies to the answer after the
thinking, not to the thinking: it is wrapped in a structural tag that lets any text through up to `</think>` first
(`after_thinking`).

A request may also switch the thinking itself (`thinking_variables`): OpenAI's `reasoning_effort` /
`reasoning.effort` ("none" and "minimal" off, "low" to "xhigh" on) and Anthropic's `thinking` ("disabled" off,
"enabled" on) set the template's own switch where it has one (Qwen3's `enable_thinking`); a template without one
does what it does, and a request asking otherwise is refused rather than ignored.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from engine.structured_output import StructuredOutputParams

THINK_START = "<think>"
THINK_END = "</think>"
THINKING_SWITCH = "enable_thinking"  # Qwen3's template variable: false renders an empty, closed thinking block

# OpenAI's values (chat's `reasoning_effort`, responses' `reasoning.effort`); the first two ask for no thinking
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]
_NO_THINKING_EFFORTS = ("none", "minimal")


class TextDecoder(Protocol):
    """The part of the model's tokenizer that counts reasoning tokens."""

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


@dataclass(frozen=True)
class ReasoningPlan:
    """A prompt whose answer may think first."""

    opened: bool  # the prompt ends inside `<think>`: the output starts with the thinking


@dataclass(frozen=True)
class SplitText:
    reasoning: str | None  # None: the output did not think
    answer: str  # what follows the thinking ("" when the output was cut before it ended)
    finished_thinking: bool  # `</think>` was generated


@dataclass(frozen=True)
class ThinkingAsked:
    """A request's own word on whether its answer thinks."""

    on: bool
    said_by: str  # the field and value that asked, for a refusal's message, e.g. "reasoning_effort='none'"


def effort_asks(effort: ReasoningEffort | None, field: str) -> ThinkingAsked | None:
    """OpenAI's effort as on or off: a template's switch has no degrees between."""
    if effort is None:
        return None
    return ThinkingAsked(on=effort not in _NO_THINKING_EFFORTS, said_by=f"{field}={effort!r}")


def thinking_variables(
    chat_template: str | None, template_kwargs: Mapping[str, Any] | None, asked: ThinkingAsked | None
) -> dict[str, Any]:
    """The template's variables with the request's word on thinking set as its switch; ValueError where the template
    cannot do what was asked (it has no switch and does the other thing), or `template_kwargs` already said otherwise."""
    variables = dict(template_kwargs or {})
    if asked is None:
        return variables
    if chat_template is not None and THINKING_SWITCH in chat_template:
        given = variables.get(THINKING_SWITCH)
        if given is not None and given != asked.on:
            raise ValueError(f"{asked.said_by} contradicts chat_template_kwargs {THINKING_SWITCH}={given!r}")
        variables[THINKING_SWITCH] = asked.on
        return variables
    thinks = chat_template is not None and THINK_END in chat_template
    if asked.on and not thinks:
        raise ValueError(f"{asked.said_by} asks for thinking, but this model's chat template does not think")
    if not asked.on and thinks:
        raise ValueError(
            f"{asked.said_by} asks for no thinking, but this model's chat template always thinks and has no "
            f"'{THINKING_SWITCH}' switch to turn it off"
        )
    return variables


def reasoning_plan(chat_template: str | None, prompt_text: str) -> ReasoningPlan | None:
    """None when the template does not think or the prompt switched thinking off."""
    if chat_template is None or THINK_END not in chat_template:
        return None
    tail = prompt_text.rstrip()
    if tail.endswith(THINK_END):
        return None
    return ReasoningPlan(opened=tail.endswith(THINK_START))


def split_reasoning(text: str, plan: ReasoningPlan) -> SplitText:
    body = text
    if not plan.opened:
        stripped = text.lstrip()
        if not stripped.startswith(THINK_START):
            return SplitText(None, text, False)
        body = stripped[len(THINK_START) :]
    reasoning, found, answer = body.partition(THINK_END)
    return SplitText(reasoning.strip(), answer.lstrip(), bool(found))


def reasoning_token_count(token_ids: Sequence[int], split: SplitText, tokenizer: TextDecoder) -> int:
    """Generated tokens up to and including `</think>` (however the model spelt it in tokens): the shortest prefix
    whose text holds it, found by bisection; all of them when the output was cut while thinking."""
    if split.reasoning is None:
        return 0
    if not split.finished_thinking:
        return len(token_ids)
    low, high = 1, len(token_ids)  # the text of token_ids[:high] holds `</think>`
    while low < high:
        middle = (low + high) // 2
        if THINK_END in tokenizer.decode(token_ids[:middle], skip_special_tokens=False):
            high = middle
        else:
            low = middle + 1
    return high


def after_thinking(constraint: StructuredOutputParams, plan: ReasoningPlan) -> StructuredOutputParams:
    """The constraint, applied after the thinking: any text up to `</think>` (opened by the model itself unless the
    prompt opened it), then what the constraint asks for."""
    begin = "" if plan.opened else THINK_START
    thinking = {"type": "tag", "begin": begin, "content": {"type": "any_text"}, "end": THINK_END}
    answer = {"type": "sequence", "elements": [thinking, _format_of(constraint)]}
    return StructuredOutputParams(structural_tag={"type": "structural_tag", "format": answer})


def _format_of(constraint: StructuredOutputParams) -> dict[str, Any]:
    """The constraint as a structural tag's format."""
    if constraint.structural_tag is not None:
        return constraint.structural_tag["format"]
    if constraint.json_schema is not None:
        return {"type": "json_schema", "json_schema": constraint.json_schema}
    if constraint.json_object:
        return {"type": "json_schema", "json_schema": {"type": "object"}}
    if constraint.regex is not None:
        return {"type": "regex", "pattern": constraint.regex}
    if constraint.choice is not None:
        return {"type": "or", "elements": [{"type": "const_string", "value": choice} for choice in constraint.choice]}
    assert constraint.grammar is not None  # exactly one constraint is set
    return {"type": "grammar", "grammar": constraint.grammar}
