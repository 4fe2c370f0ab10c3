"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, so SDKs raise their usual exceptions."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from jobs.errors import ErrorKind, ServiceError

STATUS_BY_KIND: dict[ErrorKind, int] = {
    "invalid_request": 400,
    "unauthorized": 401,
    "not_found": 404,
    "conflict": 409,
    "too_large": 413,
}


def error_response(
    status_code: int, message: str, *, param: str | None = None, code: str | None = None
) -> JSONResponse:
    error_type = "server_error" if status_code >= 500 else "invalid_request_error"
    return JSONResponse(
        status_code=status_code,
        content={"error": {"message": message, "type": error_type, "param": param, "code": code}},
    )


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ServiceError)
    async def _service_error(_: Request, error: ServiceError) -> JSONResponse:
        return error_response(STATUS_BY_KIND[error.kind], error.message, param=error.param, code=error.code)

    @app.exception_handler(RequestValidationError)
    async def _invalid_request(_: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0]
        location = [str(part) for part in first["loc"] if part not in ("body", "query", "path")]
        param = ".".join(location) or None
        more = f" (and {len(error.errors()) - 1} more problems)" if len(error.errors()) > 1 else ""
        subject = f"'{param}'" if param else "the request"
        return error_response(400, f"Invalid {subject}: {first['msg']}{more}", param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, error: StarletteHTTPException) -> JSONResponse:
        return error_response(error.status_code, str(error.detail))
