"""The OpenAPI document states what the API really answers: its error statuses with OpenAI's error body (Anthropic's
on Anthropic's paths), no 422
for invalid input (answered 400, as OpenAI does), /metrics as Prometheus text and file contents as bytes.

FastAPI documents a route's success and a 422 it never sends; the error statuses follow from what every route
shares (auth, validation, the database and queue behind it) and from its shape (a path id can be unknown, a write
can conflict), so they are added here once rather than on each route.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from api.errors import ANTHROPIC_PATHS, AnthropicErrorResponse, ErrorResponse
from jobs.idempotency import HEADER as IDEMPOTENCY_HEADER

ERROR_DESCRIPTIONS = {
    400: "Invalid request: a parameter or the body is malformed or out of range",
    401: "Missing or incorrect API key",
    404: "An object the request names (in its path, body or page cursor) does not exist in the caller's project",
    409: f"The object's state does not allow this, or the {IDEMPOTENCY_HEADER} was used with a different request",
    413: "The upload (or a Message Batch's requests) is larger than the server's limit",
    503: "A backing service (database, task queue) is unreachable; retry later",
}
WRITE_METHODS = ("post", "put", "patch", "delete")


def install_openapi(app: FastAPI) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            error_schema = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(error_schema.pop("$defs", {}))
            components["ErrorResponse"] = error_schema
            anthropic_schema = AnthropicErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(anthropic_schema.pop("$defs", {}))
            components["AnthropicErrorResponse"] = anthropic_schema
            components.pop("HTTPValidationError", None)
            components.pop("ValidationError", None)
            # Every /v1 route needs `Authorization: Bearer <key>` (api.auth); the operations routes need none.
            schema["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
            for path, operations in schema["paths"].items():
                for method, operation in operations.items():
                    _document_errors(path, method, operation)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _document_errors(path: str, method: str, operation: dict[str, Any]) -> None:
    responses = operation["responses"]
    responses.pop("422", None)
    if not path.startswith("/v1/"):
        return
    operation["security"] = [{"bearer": []}]
    statuses = {400, 401, 503}
    parameters = {parameter.get("name") for parameter in operation.get("parameters", [])}
    cursors = {"after", "after_id", "before_id"}
    if "{" in path or parameters & cursors or "requestBody" in operation:  # each can name an object by its id
        statuses.add(404)
    if method in WRITE_METHODS:
        statuses.add(409)
    if path in ("/v1/files", "/v1/messages/batches") and method == "post":
        statuses.add(413)
    error_body = "AnthropicErrorResponse" if path.startswith(ANTHROPIC_PATHS) else "ErrorResponse"
    for status in sorted(statuses):
        responses[str(status)] = {
            "description": ERROR_DESCRIPTIONS[status],
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{error_body}"}}},
        }
