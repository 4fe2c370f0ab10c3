"""Domain errors: what a caller did wrong, in words a client can act on. The API maps `kind` to a status code."""

from __future__ import annotations

from typing import Literal

ErrorKind = Literal[
    "invalid_request", "not_found", "conflict", "too_large", "unauthorized", "unavailable"
]


class ServiceError(Exception):
    def __init__(self, kind: ErrorKind, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.param = param
        self.code = code
