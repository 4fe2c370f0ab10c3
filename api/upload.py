"""Streaming multipart/form-data: the `file` part goes to S3 as it arrives, in parts; memory stays flat.

Starlette's own form parser spools an upload to a temporary file before a route sees it. Here the request
body is parsed as it streams in, and the file's bytes are handed to an `ObjectStore` multipart upload, so an
upload of any size holds at most about one S3 part in memory and nothing on local disk.

Everything else a client sends is bounded too: the form has exactly the parts `FORM_FIELDS` names, each once (an
unknown field is refused, not ignored), and `FormLimits` bounds a text field's bytes and one part's headers. A
body that is not valid multipart, or goes past a bound, answers 400 before the API holds more than the bound.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Protocol

from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from jobs import files
from jobs.errors import ServiceError

FILE_FIELD = "file"
FORM_FIELDS = (FILE_FIELD, *files.UPLOAD_FIELDS)
FLUSH_BYTES = 1024 * 1024  # file bytes gathered before they are handed to the uploader's thread


@dataclass(frozen=True)
class FormLimits:
    max_file_bytes: int  # the file part
    max_field_bytes: int  # one text field's value (purpose is a few bytes)
    max_header_bytes: int  # one part's headers, names and values together


class FileSink(Protocol):
    """Where the file part's bytes go: an S3 multipart upload, or nowhere when only their digest is wanted."""

    def write(self, data: bytes) -> None: ...


@dataclass
class _Part:
    headers: dict[bytes, bytes] = field(default_factory=dict)
    name: str = ""
    filename: str | None = None


@dataclass(frozen=True)
class UploadedForm:
    filename: str
    size: int  # bytes of the file part
    sha256: str  # hex digest of the file part
    fields: dict[str, str]  # the other (text) fields


class _FormReader:
    """Parser callbacks: text fields are collected, file bytes are queued for the uploader."""

    def __init__(self, limits: FormLimits) -> None:
        self.limits = limits
        self.fields: dict[str, str] = {}
        self.pending = bytearray()  # file bytes not yet handed to the uploader
        self.file_bytes = 0
        self.digest = hashlib.sha256()
        self.filename: str | None = None
        self._seen: set[str] = set()
        self._header_bytes = 0
        self._part = _Part()
        self._header_field = b""
        self._header_value = b""
        self._field_value = bytearray()

    def callbacks(self) -> dict[str, object]:
        return {
            "on_part_begin": self._on_part_begin,
            "on_header_field": self._on_header_field,
            "on_header_value": self._on_header_value,
            "on_header_end": self._on_header_end,
            "on_headers_finished": self._on_headers_finished,
            "on_part_data": self._on_part_data,
            "on_part_end": self._on_part_end,
        }

    def _on_part_begin(self) -> None:
        self._part = _Part()
        self._header_bytes = 0

    def _on_header_field(self, data: bytes, start: int, end: int) -> None:
        self._count_header_bytes(end - start)
        self._header_field += data[start:end]

    def _on_header_value(self, data: bytes, start: int, end: int) -> None:
        self._count_header_bytes(end - start)
        self._header_value += data[start:end]

    def _count_header_bytes(self, count: int) -> None:
        self._header_bytes += count
        if self._header_bytes > self.limits.max_header_bytes:
            raise ServiceError(
                "invalid_request", f"a form part's headers are longer than {self.limits.max_header_bytes} bytes"
            )

    def _on_header_end(self) -> None:
        self._part.headers[self._header_field.lower()] = self._header_value
        self._header_field, self._header_value = b"", b""

    def _on_headers_finished(self) -> None:
        _, options = parse_options_header(self._part.headers.get(b"content-disposition"))
        self._part.name = options.get(b"name", b"").decode("utf-8", "replace")
        raw_filename = options.get(b"filename")
        self._part.filename = raw_filename.decode("utf-8", "replace") if raw_filename is not None else None
        name = self._part.name
        if name not in FORM_FIELDS:
            raise ServiceError(
                "invalid_request", f"unknown form field {name!r}; the form takes {list(FORM_FIELDS)}", param=name
            )
        if name in self._seen:
            raise ServiceError("invalid_request", f"send the form field {name!r} once", param=name)
        self._seen.add(name)
        if name == FILE_FIELD:
            self.filename = self._part.filename or "upload.jsonl"
        self._field_value = bytearray()

    def _on_part_data(self, data: bytes, start: int, end: int) -> None:
        if self._part.name == FILE_FIELD:
            self.file_bytes += end - start
            if self.file_bytes > self.limits.max_file_bytes:
                raise ServiceError(
                    "too_large",
                    f"the file is larger than this server's limit of {self.limits.max_file_bytes} bytes",
                    param="file",
                )
            self.digest.update(data[start:end])
            self.pending += data[start:end]
            return
        self._field_value += data[start:end]
        if len(self._field_value) > self.limits.max_field_bytes:
            raise ServiceError(
                "invalid_request",
                f"form field {self._part.name!r} is longer than {self.limits.max_field_bytes} bytes",
                param=self._part.name,
            )

    def _on_part_end(self) -> None:
        if self._part.name != FILE_FIELD:
            self.fields[self._part.name] = self._field_value.decode("utf-8", "replace")


async def receive_form(request: Request, upload: FileSink, limits: FormLimits) -> UploadedForm:
    """Parse a multipart request, streaming its `file` part into `upload` (which the caller completes or aborts)."""
    content_type, options = parse_options_header(request.headers.get("content-type"))
    boundary = options.get(b"boundary")
    if content_type != b"multipart/form-data" or not boundary:
        raise ServiceError("invalid_request", "send the file as multipart/form-data with a 'file' part", param="file")
    reader = _FormReader(limits)
    try:
        parser = MultipartParser(boundary, reader.callbacks())  # type: ignore[arg-type]
        async for body_bytes in request.stream():
            parser.write(body_bytes)
            if len(reader.pending) >= FLUSH_BYTES:
                await _flush(reader, upload)
        parser.finalize()
    except (MultipartParseError, ValueError) as malformed:  # ValueError: a boundary the parser cannot use
        raise ServiceError("invalid_request", f"the body is not valid multipart/form-data: {malformed}") from None
    await _flush(reader, upload)
    if reader.filename is None:
        raise ServiceError("invalid_request", "missing the 'file' part: the file to upload", param="file")
    return UploadedForm(
        filename=reader.filename, size=reader.file_bytes, sha256=reader.digest.hexdigest(), fields=reader.fields
    )


async def _flush(reader: _FormReader, upload: FileSink) -> None:
    if reader.pending:
        data, reader.pending = bytes(reader.pending), bytearray()
        await run_in_threadpool(upload.write, data)
