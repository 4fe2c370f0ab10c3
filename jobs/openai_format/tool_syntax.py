"""Tool-call syntaxes: how a chat-template family writes function calls, recognised from the template's text; the
xgrammar structural tag that makes a model write calls that way; and the calls read back from generated text.

- Hermes (Qwen 2.5/3, Hermes 2/3, and conveyor's generic format; `<tool_call>` in the template): a call is
  `<tool_call>` newline `{"name": f, "arguments": {…}}` newline `</tool_call>`; several calls, a newline between.
- Llama 3.1/3.2/3.3 JSON (`<|start_header_id|>` and `"parameters": `): `{"name": f, "parameters": {…}}`, at times
  after `<|python_tag|>`; one call a turn, as the templates refuse more.
- Mistral 7B v0.3, Nemo and templates of their format (`[TOOL_CALLS]` and `[AVAILABLE_TOOLS]`): one JSON array of
  `{"name": f, "arguments": {…}}` objects, `, ` between, after `[TOOL_CALLS]` (v0.3: `[TOOL_CALLS] [`).
- Mistral's newer format (Mistral Small 3.2, Magistral, Devstral: templates holding `[ARGS]`): each call is
  `[TOOL_CALLS]f[ARGS]{…}`, the calls back to back (`MistralArgsSyntax`); the template writes `[CALL_ID]id` before
  `[ARGS]` in the conversation's past calls, which the parser also takes.

Not read: Llama 3.1's built-in tools (`<|python_tag|>brave_search.call(…)`), which are not OpenAI function tools.

The markers (`<|python_tag|>`, `[TOOL_CALLS]`, `[ARGS]`, `[CALL_ID]`) are special tokens, which the output text leaves
out like every special token, so the parser takes them as optional: a call is known by its JSON (a name among the
line's functions, an object of arguments under the family's key; for `[ARGS]`, a name among the line's functions right
before an object), with or without the marker, which a grammar spells out in plain characters (xgrammar's grammars do
not produce special tokens).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from typing import Any

# Not strict: xgrammar's JSON grammar lets raw control characters into strings, so a forced call may hold them; the
# arguments go out re-encoded (escaped) all the same.
_JSON = json.JSONDecoder(strict=False)
_SHORT_ID = re.compile(r"[A-Za-z0-9]{9}")


@dataclass(frozen=True)
class CallSyntax:
    """One family's way of writing calls: each is `call_prefix` + `{"name": <name>, "<arguments_key>": <object>}` +
    `call_suffix`, consecutive calls separated by `separator`, all inside one JSON array opened by `array_begin` where
    the family wraps them (Mistral). In generated text a call (or the array) starts where `opening` matches, right
    before its JSON, and `closing` must follow the JSON."""

    arguments_key: str
    trigger: str  # opens calls in free text (tool_choice auto); a prefix of every call's (or the array's) beginning
    opening: re.Pattern[str]
    closing: re.Pattern[str] | None = None
    call_prefix: str = ""
    call_suffix: str = ""
    separator: str = ""
    array_begin: str | None = None
    parallel: bool = True  # whether one turn may hold several calls
    short_call_ids: bool = False  # the template refuses call ids other than 9 letters or digits

    def call_tag(self, name: str, parameters: dict[str, Any]) -> dict[str, Any]:
        """One call of `name` with arguments valid against `parameters`, as an xgrammar tag."""
        return {
            "type": "tag",
            "begin": f'{self.call_prefix}{{"name": "{name}", "{self.arguments_key}": ',
            # one whitespace at most between tokens: a small model must not loop on newlines inside a call
            "content": {"type": "json_schema", "json_schema": parameters, "max_whitespace_cnt": 1},
            "end": "}" + self.call_suffix,
        }

    def calls(self, tags: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
        """One call or more (one unless `parallel` and the family allows it) among `tags`, and nothing else."""
        several = parallel and self.parallel
        calls = tags[0] if len(tags) == 1 and not several else {
            "type": "tags_with_separator", "tags": tags, "separator": self.separator, "at_least_one": True,
            "stop_after_first": not several,
        }
        if self.array_begin is None:
            return calls
        return {"type": "tag", "begin": self.array_begin, "content": calls, "end": "]"}

    def optional_calls(self, tags: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
        """Free text in which the trigger opens calls, each then constrained (tool_choice auto)."""
        if self.array_begin is not None:  # one array holds the turn's calls: after it, the turn ends
            return {"type": "triggered_tags", "triggers": [self.trigger], "tags": [self.calls(tags, parallel)],
                    "at_least_one": False, "stop_after_first": True}
        return {"type": "triggered_tags", "triggers": [self.trigger], "tags": tags, "at_least_one": False,
                "stop_after_first": not (parallel and self.parallel)}

    def calls_text(self, calls: Sequence[tuple[str, Any]]) -> str:
        """(name, arguments) calls written as this syntax writes them, as a model answering in it would."""
        text = self.separator.join(
            f'{self.call_prefix}{{"name": "{name}", "{self.arguments_key}": {json.dumps(arguments)}}}{self.call_suffix}'
            for name, arguments in calls
        )
        return text if self.array_begin is None else f"{self.array_begin}{text}]"

    def template_call_id(self, call_id: str) -> str:
        """The id the template is given for an OpenAI call id. Mistral's templates raise on ids other than 9 letters
        or digits, so any other id becomes 9 hex digits of its hash: the same id in the assistant's call and in the
        tool's result, and different ids stay apart."""
        if not self.short_call_ids or _SHORT_ID.fullmatch(call_id):
            return call_id
        return hashlib.sha256(call_id.encode()).hexdigest()[:9]

    def parse(self, text: str, names: Collection[str]) -> tuple[str | None, list[tuple[str, dict[str, Any]]]]:
        """(content, [(name, arguments)]) from generated text. Every well-formed call of a function in `names` is
        taken out of the text; what remains, stripped, is the content (None when empty). Anything malformed (JSON
        that does not parse or close, an unknown name, arguments that are not an object, a Mistral array with one
        bad call) is not a call and stays in the content as written."""
        calls: list[tuple[str, dict[str, Any]]] = []
        kept: list[str] = []
        at = 0
        for opening in self.opening.finditer(text):
            if opening.start() < at:  # inside a call already read
                continue
            read = self._read(text, opening.end(), names)
            if read is None:
                continue
            found, end = read
            kept.append(text[at : opening.start()])
            calls.extend(found)
            at = end
        if not calls:
            return text, []
        kept.append(text[at:])
        return "".join(kept).strip() or None, calls

    def _read(self, text: str, start: int, names: Collection[str]) -> tuple[list[tuple[str, dict[str, Any]]], int] | None:
        try:
            value, end = _JSON.raw_decode(text, start)
        except json.JSONDecodeError:
            return None
        objects = value if self.array_begin is not None else [value]
        if not isinstance(objects, list) or not objects:
            return None
        calls = []
        for call in objects:
            if not (isinstance(call, dict) and call.get("name") in names and isinstance(call.get(self.arguments_key), dict)):
                return None
            calls.append((call["name"], call[self.arguments_key]))
        if self.closing is not None:
            closing = self.closing.match(text, end)
            if closing is None:
                return None
            end = closing.end()
        return calls, end


HERMES = CallSyntax(
    arguments_key="arguments",
    trigger="<tool_call>",
    opening=re.compile(r"<tool_call>\s*"),
    closing=re.compile(r"\s*</tool_call>"),
    call_prefix="<tool_call>\n",
    call_suffix="\n</tool_call>",
    separator="\n",
)
LLAMA3_JSON = CallSyntax(
    arguments_key="parameters",
    trigger='{"name": ',
    opening=re.compile(r'(?:<\|python_tag\|>\s*)?(?=\{\s*"name")'),
    parallel=False,
)
MISTRAL = CallSyntax(
    arguments_key="arguments",
    trigger="[TOOL_CALLS]",
    opening=re.compile(r'(?:\[TOOL_CALLS\]\s*)?(?=\[\s*\{\s*"name")'),
    separator=", ",
    array_begin="[TOOL_CALLS][",
    short_call_ids=True,
)
MISTRAL_V3 = replace(MISTRAL, array_begin="[TOOL_CALLS] [")  # Mistral 7B v0.3's templates: a space before the array


@dataclass(frozen=True)
class MistralArgsSyntax(CallSyntax):
    """Mistral's `[TOOL_CALLS]f[ARGS]{…}`: the name outside the JSON, which holds the arguments alone."""

    def call_tag(self, name: str, parameters: dict[str, Any]) -> dict[str, Any]:
        return {
            "type": "tag",
            "begin": f"{self.call_prefix}{name}[ARGS]",
            "content": {"type": "json_schema", "json_schema": parameters, "max_whitespace_cnt": 1},
            "end": "",
        }

    def calls_text(self, calls: Sequence[tuple[str, Any]]) -> str:
        return "".join(f"{self.call_prefix}{name}[ARGS]{json.dumps(arguments)}" for name, arguments in calls)

    def _read(self, text: str, start: int, names: Collection[str]) -> tuple[list[tuple[str, dict[str, Any]]], int] | None:
        named = _NAMED_ARGS.match(text, start)
        if named is None or named.group(1) not in names:
            return None
        try:
            arguments, end = _JSON.raw_decode(text, named.end())
        except json.JSONDecodeError:
            return None
        return ([(named.group(1), arguments)], end) if isinstance(arguments, dict) else None


# A function name (OpenAI's alphabet), the past call's id the template writes, the marker; the arguments follow.
_NAMED_ARGS = re.compile(r"([A-Za-z0-9_-]+)(?:\[CALL_ID\][A-Za-z0-9]*)?(?:\[ARGS\])?")

MISTRAL_ARGS = MistralArgsSyntax(
    arguments_key="",  # none: the JSON is the arguments
    trigger="[TOOL_CALLS]",
    # A call starts at a word (the function's name) followed by its JSON, after the marker or not.
    opening=re.compile(r"(?:\[TOOL_CALLS\])?(?<![A-Za-z0-9_-])(?=[A-Za-z0-9_-]+(?:\[CALL_ID\][A-Za-z0-9]*)?(?:\[ARGS\])?\{)"),
    call_prefix="[TOOL_CALLS]",
    short_call_ids=True,
)


def detect_call_syntax(chat_template: str | None) -> CallSyntax | None:
    """The call syntax the model's chat template writes tools and calls in; None when it has none of the families
    read here (the generic format then)."""
    if chat_template is None or "tools" not in chat_template:
        return None
    if HERMES.trigger in chat_template:
        return HERMES
    if "[TOOL_CALLS]" in chat_template and "[AVAILABLE_TOOLS]" in chat_template:
        if "[ARGS]" in chat_template:
            return MISTRAL_ARGS
        return MISTRAL_V3 if "[TOOL_CALLS] [" in chat_template else MISTRAL
    if "<|start_header_id|>" in chat_template and '"parameters": ' in chat_template:
        return LLAMA3_JSON
    return None
