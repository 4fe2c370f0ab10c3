"""A request's output constraint: OpenAI's `response_format` and vLLM's `guided_*` extras → the engine's
`StructuredOutputParams`, with every JSON schema checked before it reaches a worker.

A schema must be valid JSON Schema (checked against its meta-schema by `jsonschema`: otherwise
`invalid_json_schema`, with the reason) and use only keywords the grammar library enforces. A keyword it
would ignore (`uniqueItems`, `not`, `if`/`then`/`else`, `allOf`, `oneOf`, `contains`, `propertyNames`,
`dependentRequired`, an unknown `format`, …) is refused for that line (`unsupported_json_schema`, naming the
keyword and where it is), never silently dropped: a constrained output must validate against the schema the
client sent.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.structured_output import StructuredOutputParams

ConstraintErrorCode = Literal["invalid_json_schema", "unsupported_json_schema", "invalid_parameter"]

# Keywords xgrammar (0.2.8) turns into grammar rules, checked one by one (tests/jobs/test_structured_output.py).
_ENFORCED = {
    "type", "enum", "const",
    "properties", "required", "additionalProperties", "patternProperties", "minProperties", "maxProperties",
    "items", "prefixItems", "minItems", "maxItems",
    "anyOf", "$ref", "$defs", "definitions",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
    "minLength", "maxLength", "pattern", "format",
}
# Annotations: they say nothing about which values are valid.
_ANNOTATIONS = {
    "$schema", "$id", "$comment", "title", "description", "default", "examples", "deprecated", "readOnly",
    "writeOnly", "$anchor",
}
_FORMATS = {"date", "time", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "uri", "uuid"}
# Keywords whose value is a schema, a list of schemas or a map of name → schema.
_SCHEMA_VALUED = {"items", "additionalProperties"}
_SCHEMA_LISTS = {"anyOf", "prefixItems"}
_SCHEMA_MAPS = {"properties", "patternProperties", "$defs", "definitions"}


class ConstraintRejected(ValueError):
    """Why a line's constraint cannot run; the caller turns it into that line's error record."""

    def __init__(self, code: ConstraintErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class JsonSchemaFormat(_Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the output is constrained either way; strict only asks for what is always done
    description: str | None = None


class ResponseFormat(_Strict):
    """OpenAI's `response_format`: text (no constraint), any JSON object, or a named JSON schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


def check_json_schema(schema: object, where: str) -> dict[str, Any]:
    """`schema` as a dict, if it is valid JSON Schema using only enforced keywords."""
    import jsonschema

    if not isinstance(schema, dict):
        raise ConstraintRejected("invalid_json_schema", f"{where} must be a JSON object, got {type(schema).__name__}")
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as invalid:
        path = "".join(f"[{part!r}]" for part in invalid.path)
        raise ConstraintRejected("invalid_json_schema", f"{where}{path} is not valid JSON Schema: {invalid.message}") from None
    for path, keyword, value in _keywords(schema, where):
        if keyword in _ANNOTATIONS or (keyword in ("unevaluatedProperties", "unevaluatedItems") and value is False):
            continue  # unevaluated*: false is what strict decoding does anyway
        if keyword not in _ENFORCED:
            raise ConstraintRejected(
                "unsupported_json_schema",
                f"{path} uses '{keyword}', which constrained decoding cannot enforce; supported keywords: "
                f"{', '.join(sorted(_ENFORCED))}",
            )
        if keyword == "format" and value not in _FORMATS:
            raise ConstraintRejected(
                "unsupported_json_schema", f"{path} has format {value!r}; supported formats: {', '.join(sorted(_FORMATS))}"
            )
    return schema


def _keywords(schema: object, path: str) -> Iterator[tuple[str, str, object]]:
    """(where, keyword, value) of every keyword of `schema` and of the schemas nested in it."""
    if not isinstance(schema, dict):
        return  # true / false schemas carry no keywords
    for keyword, value in schema.items():
        yield path, keyword, value
        if keyword in _SCHEMA_VALUED:
            yield from _keywords(value, f"{path}.{keyword}")
        elif keyword in _SCHEMA_LISTS and isinstance(value, list):
            for index, item in enumerate(value):
                yield from _keywords(item, f"{path}.{keyword}[{index}]")
        elif keyword in _SCHEMA_MAPS and isinstance(value, dict):
            for name, item in value.items():
                yield from _keywords(item, f"{path}.{keyword}.{name}")


def constraint_from_request(
    response_format: ResponseFormat | None,
    guided_json: object = None,
    guided_regex: str | None = None,
    guided_choice: list[str] | None = None,
    guided_grammar: str | None = None,
) -> StructuredOutputParams | None:
    """The one constraint a request asks for, or None. Asking for two is refused (which would win is a guess)."""
    given = {
        name: value
        for name, value in (
            ("response_format", response_format if response_format and response_format.type != "text" else None),
            ("guided_json", guided_json),
            ("guided_regex", guided_regex),
            ("guided_choice", guided_choice),
            ("guided_grammar", guided_grammar),
        )
        if value is not None
    }
    if len(given) > 1:
        raise ConstraintRejected("invalid_parameter", f"give at most one output constraint, got {sorted(given)}")
    try:
        if response_format is not None and "response_format" in given:
            if response_format.type == "json_object":
                if response_format.json_schema is not None:
                    raise ConstraintRejected("invalid_parameter", "response_format.json_schema needs type 'json_schema'")
                return StructuredOutputParams(json_object=True)
            if response_format.json_schema is None or response_format.json_schema.schema_ is None:
                raise ConstraintRejected("invalid_parameter", "response_format type 'json_schema' needs json_schema.schema")
            schema = check_json_schema(response_format.json_schema.schema_, "response_format.json_schema.schema")
            return StructuredOutputParams(json_schema=schema)
        if guided_json is not None:
            if isinstance(guided_json, str):
                try:
                    guided_json = json.loads(guided_json)
                except json.JSONDecodeError as error:
                    raise ConstraintRejected("invalid_json_schema", f"guided_json is not JSON: {error}") from None
            return StructuredOutputParams(json_schema=check_json_schema(guided_json, "guided_json"))
        if guided_regex is not None:
            return StructuredOutputParams(regex=guided_regex)
        if guided_choice is not None:
            return StructuredOutputParams(choice=tuple(guided_choice))
        if guided_grammar is not None:
            return StructuredOutputParams(grammar=guided_grammar)
    except ConstraintRejected:
        raise
    except ValueError as invalid:
        raise ConstraintRejected("invalid_parameter", str(invalid)) from None
    return None
