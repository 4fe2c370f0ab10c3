"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, so SDKs raise their usual exceptions.

Bad input never answers 500: a value PostgreSQL cannot store (a NUL byte in an id, a number out of range) is the
request's fault and answers 400, like any other invalid parameter. A backing service that is down answers 503,
which the SDKs retry.
"""

from __future__ import annotations

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


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ServiceError)
    async def _service_error(_: Request, error: ServiceError) -> JSONResponse:
        return error_response(STATUS_BY_KIND[error.kind], error.message, param=error.param, code=error.code)

    @app.exception_handler(RequestValidationError)
    async def _invalid_request(_: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0]
        location = [str(part) for part in first["loc"] if part not in ("body", "query", "path", "header")]
        param = ".".join(location) or None
        more = f" (and {len(error.errors()) - 1} more problems)" if len(error.errors()) > 1 else ""
        subject = f"'{param}'" if param else "request"
        return error_response(400, f"Invalid {subject}: {first['msg']}{more}", param=param)

    @app.exception_handler(DataError)
    async def _unstorable_value(_: Request, error: DataError) -> JSONResponse:
        # psycopg refuses such a value before it is sent (a NUL byte), or PostgreSQL does (out of range): either
        # way the value came from the request, and the transaction was rolled back.
        reason = str(error.orig).strip().splitlines()[0] if error.orig is not None else "invalid value"
        return error_response(400, f"The request holds a value that cannot be stored: {reason}")

    @app.exception_handler(QueueUnreachable)
    @app.exception_handler(RedisError)
    async def _queue_unreachable(_: Request, error: Exception) -> JSONResponse:
        return error_response(503, f"The task queue (Redis) is unreachable; retry later ({error})", code="queue_unavailable")

    @app.exception_handler(DatabaseUnreachable)
    async def _database_unreachable(_: Request, error: DatabaseUnreachable) -> JSONResponse:
        return error_response(503, "The database is unreachable; retry later", code="database_unavailable")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        headers = dict(error.headers or {})
        if error.status_code == 405:
            headers["Allow"] = ", ".join(_allowed_methods(request, headers.get("Allow", "")))
        return error_response(error.status_code, str(error.detail), headers=headers)


def _allowed_methods(request: Request, named: str) -> list[str]:
    """Every method served at this path. Starlette names only the first matching route's, and GET and POST of one
    path are two routes here, so the OpenAPI document's paths (every route's) are matched as well."""
    methods = {method.strip() for method in named.split(",") if method.strip()}
    for template, operations in request.app.openapi()["paths"].items():
        if compile_path(template)[0].match(request.url.path):
            methods.update(method.upper() for method in operations)
    return sorted(methods)
