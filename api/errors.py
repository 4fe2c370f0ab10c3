"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, so SDKs raise their usual exceptions;
on Anthropic's paths (`/v1/messages/...`) in Anthropic's, `{"type": "error", "error": {"type", "message"}}`.

Bad input never answers 500: a value PostgreSQL cannot store (a NUL byte in an id, a number out of range) is the
request's fault and answers 400, like any other invalid parameter. A backing service that is down answers 503,
which the SDKs retry.
"""

from __future__ import annotations

from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from kombu.exceptions import OperationalError as QueueUnreachable
from pydantic import BaseModel
from redis.exceptions import RedisError
from sqlalchemy.exc import DataError
from sqlalchemy.exc import OperationalError as DatabaseUnreachable
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import compile_path

from jobs.errors import ErrorKind, ServiceError

STATUS_BY_KIND: dict[ErrorKind, int] = {
    "invalid_request": 400,
    "unauthorized": 401,
    "not_found": 404,
    "conflict": 409,
    "too_large": 413,
    "unavailable": 503,
}


class ErrorDetail(BaseModel):
    message: str
    type: str  # "invalid_request_error" for 4xx, "server_error" for 5xx
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """The body of every error answer."""

    error: ErrorDetail


def error_response(
    status_code: int,
    message: str,
    *,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    error_type = "server_error" if status_code >= 500 else "invalid_request_error"
    return JSONResponse(
        status_code=status_code,
        content={"error": {"message": message, "type": error_type, "param": param, "code": code}},
        headers=headers,
    )


class AnthropicErrorDetail(BaseModel):
    type: str  # "invalid_request_error", "authentication_error", "not_found_error", "request_too_large", "api_error"
    message: str


class AnthropicErrorResponse(BaseModel):
    """The body of every error answer on Anthropic's paths."""

    type: Literal["error"] = "error"
    error: AnthropicErrorDetail


# Anthropic's error types by status (its API answers 409 nowhere; a conflict is an invalid request there)
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
}
ANTHROPIC_PATHS = "/v1/messages"


def anthropic_error_response(status_code: int, message: str, *, headers: dict[str, str] | None = None) -> JSONResponse:
    error_type = ANTHROPIC_ERROR_TYPES.get(status_code, "api_error")
    return JSONResponse(
        status_code=status_code,
        content={"type": "error", "error": {"type": error_type, "message": message}},
        headers=headers,
    )


def _answer(
    request: Request,
    status_code: int,
    message: str,
    *,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """The error in the shape of the API the path belongs to."""
    if request.url.path.startswith(ANTHROPIC_PATHS):
        return anthropic_error_response(status_code, message, headers=headers)
    return error_response(status_code, message, param=param, code=code, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ServiceError)
    async def _service_error(request: Request, error: ServiceError) -> JSONResponse:
        return _answer(request, STATUS_BY_KIND[error.kind], error.message, param=error.param, code=error.code)

    @app.exception_handler(RequestValidationError)
    async def _invalid_request(request: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0]
        location = [str(part) for part in first["loc"] if part not in ("body", "query", "path", "header")]
        param = ".".join(location) or None
        more = f" (and {len(error.errors()) - 1} more problems)" if len(error.errors()) > 1 else ""
        subject = f"'{param}'" if param else "request"
        return _answer(request, 400, f"Invalid {subject}: {first['msg']}{more}", param=param)

    @app.exception_handler(DataError)
    async def _unstorable_value(request: Request, error: DataError) -> JSONResponse:
        # psycopg refuses such a value before it is sent (a NUL byte), or PostgreSQL does (out of range): either
        # way the value came from the request, and the transaction was rolled back.
        reason = str(error.orig).strip().splitlines()[0] if error.orig is not None else "invalid value"
        return _answer(request, 400, f"The request holds a value that cannot be stored: {reason}")

    @app.exception_handler(QueueUnreachable)
    @app.exception_handler(RedisError)
    async def _queue_unreachable(request: Request, error: Exception) -> JSONResponse:
        message = f"The task queue (Redis) is unreachable; retry later ({error})"
        return _answer(request, 503, message, code="queue_unavailable")

    @app.exception_handler(DatabaseUnreachable)
    async def _database_unreachable(request: Request, error: DatabaseUnreachable) -> JSONResponse:
        return _answer(request, 503, "The database is unreachable; retry later", code="database_unavailable")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        headers = dict(error.headers or {})
        if error.status_code == 405:
            headers["Allow"] = ", ".join(_allowed_methods(request, headers.get("Allow", "")))
        return _answer(request, error.status_code, str(error.detail), headers=headers)


def _allowed_methods(request: Request, named: str) -> list[str]:
    """Every method served at this path. Starlette names only the first matching route's, and GET and POST of one
    path are two routes here, so the OpenAPI document's paths (every route's) are matched as well."""
    methods = {method.strip() for method in named.split(",") if method.strip()}
    for template, operations in request.app.openapi()["paths"].items():
        if compile_path(template)[0].match(request.url.path):
            methods.update(method.upper() for method in operations)
    return sorted(methods)
