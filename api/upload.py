"""Streaming multipart/form-data: the `file` part goes to S3 as it arrives, in parts; memory stays flat.

Starlette's own form parser spools an upload to a temporary file before a route sees it. Here the request
body is parsed as it streams in, and the file's bytes are handed to an `ObjectStore` multipart upload, so an
upload of any size holds at most about one S3 part in memory and nothing on local disk.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from jobs.errors import ServiceError
from jobs.storage import StreamingUpload

FILE_FIELD = "file"
MAX_FIELD_BYTES = 4096  # text fields (purpose) are short; a large one is a malformed request
FLUSH_BYTES = 1024 * 1024  # file bytes gathered before they are handed to the uploader's thread


@dataclass
class _Part:
    headers: dict[bytes, bytes] = field(default_factory=dict)
    name: str = ""
    filename: str | None = None


@dataclass(frozen=True)
class UploadedForm:
    filename: str
    size: int  # bytes of the file part
    fields: dict[str, str]  # the other (text) fields


class _FormReader:
    """Parser callbacks: text fields are collected, file bytes are queued for the uploader."""

    def __init__(self, max_file_bytes: int) -> None:
        self.max_file_bytes = max_file_bytes
        self.fields: dict[str, str] = {}
        self.pending = bytearray()  # file bytes not yet handed to the uploader
        self.file_bytes = 0
        self.filename: str | None = None
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

    def _on_header_field(self, data: bytes, start: int, end: int) -> None:
        self._header_field += data[start:end]

    def _on_header_value(self, data: bytes, start: int, end: int) -> None:
        self._header_value += data[start:end]

    def _on_header_end(self) -> None:
        self._part.headers[self._header_field.lower()] = self._header_value
        self._header_field, self._header_value = b"", b""

    def _on_headers_finished(self) -> None:
        _, options = parse_options_header(self._part.headers.get(b"content-disposition"))
        self._part.name = options.get(b"name", b"").decode("utf-8", "replace")
        raw_filename = options.get(b"filename")
        self._part.filename = raw_filename.decode("utf-8", "replace") if raw_filename is not None else None
        if self._part.name == FILE_FIELD:
            if self.filename is not None:
                raise ServiceError("invalid_request", "send exactly one 'file' part", param="file")
            self.filename = self._part.filename or "upload.jsonl"
        self._field_value = bytearray()

    def _on_part_data(self, data: bytes, start: int, end: int) -> None:
        if self._part.name == FILE_FIELD:
            self.file_bytes += end - start
            if self.file_bytes > self.max_file_bytes:
                raise ServiceError(
                    "too_large",
                    f"the file is larger than this server's limit of {self.max_file_bytes} bytes",
                    param="file",
                )
            self.pending += data[start:end]
            return
        self._field_value += data[start:end]
        if len(self._field_value) > MAX_FIELD_BYTES:
            raise ServiceError("invalid_request", f"form field {self._part.name!r} is too long", param=self._part.name)

    def _on_part_end(self) -> None:
        if self._part.name != FILE_FIELD:
            self.fields[self._part.name] = self._field_value.decode("utf-8", "replace")


async def receive_form(request: Request, upload: StreamingUpload, max_file_bytes: int) -> UploadedForm:
    """Parse a multipart request, streaming its `file` part into `upload` (which the caller completes or aborts)."""
    content_type, options = parse_options_header(request.headers.get("content-type"))
    boundary = options.get(b"boundary")
    if content_type != b"multipart/form-data" or not boundary:
        raise ServiceError("invalid_request", "send the file as multipart/form-data with a 'file' part", param="file")
    reader = _FormReader(max_file_bytes)
    parser = MultipartParser(boundary, reader.callbacks())  # type: ignore[arg-type]
    async for body_bytes in request.stream():
        parser.write(body_bytes)
        if len(reader.pending) >= FLUSH_BYTES:
            await _flush(reader, upload)
    parser.finalize()
    await _flush(reader, upload)
    if reader.filename is None:
        raise ServiceError("invalid_request", "missing the 'file' part: the file to upload", param="file")
    return UploadedForm(filename=reader.filename, size=reader.file_bytes, fields=reader.fields)


async def _flush(reader: _FormReader, upload: StreamingUpload) -> None:
    if reader.pending:
        data, reader.pending = bytes(reader.pending), bytearray()
        await run_in_threadpool(upload.write, data)
