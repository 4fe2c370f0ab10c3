"""Documents for RAG preprocessing: one JSONL line describing a document, and a file's bytes as plain text.

A document line is `{"id", "text" | "uri", "metadata"}`: the text inline, or an `s3://bucket/key` URI that
is parsed and validated here and fetched by the caller, who then passes the object's name and bytes to
`extract_text`. Every problem becomes a `DocumentError` whose message says what is wrong in words a client
can act on, so that a caller can report it against the line or file and go on with the others.

Formats are chosen by the file's extension: `.txt` and `.md` are UTF-8 text (Markdown kept as written: the
splitter starts chunks at its headings), `.html`/`.htm` is reduced to its main text by trafilatura, written
as Markdown so that its headings survive, and `.pdf` is read page by page by pypdf.
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

from jobs.json_lines import UnreadableLine, load_json_line

_LINE_FIELDS = ("id", "text", "uri", "metadata")
# Lenient about case and underscores: older S3 regions and self-hosted S3 servers accept such bucket names.
_BUCKET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{1,61}[A-Za-z0-9]")
_MAX_KEY_BYTES = 1024  # S3's limit


class DocumentError(Exception):
    """A document line or file that cannot be read; str(error) says why."""


@dataclass(frozen=True)
class S3Uri:
    bucket: str
    key: str

    @classmethod
    def parse(cls, uri: str) -> S3Uri:
        # Not urllib.parse: "?" and "#" are ordinary characters of an S3 key, not a query or a fragment.
        if not uri.startswith("s3://"):
            raise DocumentError(f"uri must be an s3:// URI, got {uri!r}")
        bucket, slash, key = uri.removeprefix("s3://").partition("/")
        if not _BUCKET_NAME.fullmatch(bucket):
            raise DocumentError(
                f"uri {uri!r}: {bucket!r} is not a bucket name (3 to 63 letters, digits, '.', '-', '_')"
            )
        if not slash or not key:
            raise DocumentError(f"uri {uri!r} names a bucket but no object; expected s3://{bucket}/<key>")
        if key.endswith("/"):
            raise DocumentError(f"uri {uri!r} names a folder, not an object")
        if len(key.encode("utf-8")) > _MAX_KEY_BYTES:
            raise DocumentError(f"uri {uri!r}: the key is longer than S3's {_MAX_KEY_BYTES} bytes")
        return cls(bucket=bucket, key=key)

    @property
    def filename(self) -> str:
        """The key's last segment, whose extension `extract_text` goes by."""
        return PurePosixPath(self.key).name

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.key}"


@dataclass(frozen=True)
class SourceDocument:
    id: str
    text: str | None  # exactly one of text and uri is set
    uri: S3Uri | None
    metadata: dict[str, Any] = field(default_factory=dict)


def parse_document_line(line: str | bytes) -> SourceDocument:
    """One JSONL line → a SourceDocument, or a DocumentError saying what is wrong with the line."""
    try:
        record = load_json_line(line)
    except UnreadableLine as unreadable:
        raise DocumentError(str(unreadable)) from None
    except UnicodeDecodeError as error:
        raise DocumentError(f"the line is not UTF-8 (invalid byte at offset {error.start})") from None
    except json.JSONDecodeError as error:
        raise DocumentError(f"the line is not valid JSON: {error.msg} at column {error.colno}") from None
    if not isinstance(record, dict):
        raise DocumentError(f"the line must be a JSON object, got {_json_type(record)}")
    unknown = sorted(set(record) - set(_LINE_FIELDS))
    if unknown:  # a misspelt "txt" or "url" would otherwise leave a document without content
        raise DocumentError(f"unknown fields {unknown}; a document line has {list(_LINE_FIELDS)}")

    document_id = record.get("id")
    if document_id is None:
        raise DocumentError("id is missing")
    if not isinstance(document_id, str):
        raise DocumentError(f"id must be a string, got {_json_type(document_id)}")
    if not document_id.strip():
        raise DocumentError("id must not be empty")
    text, uri = record.get("text"), record.get("uri")
    if (text is None) == (uri is None):
        raise DocumentError(f"document {document_id!r}: give exactly one of text and uri")
    if text is not None and not isinstance(text, str):
        raise DocumentError(f"document {document_id!r}: text must be a string, got {_json_type(text)}")
    if uri is not None and not isinstance(uri, str):
        raise DocumentError(f"document {document_id!r}: uri must be a string, got {_json_type(uri)}")
    metadata = record.get("metadata", {})
    if not isinstance(metadata, dict):
        raise DocumentError(f"document {document_id!r}: metadata must be a JSON object, got {_json_type(metadata)}")
    try:
        parsed_uri = S3Uri.parse(uri) if uri is not None else None
    except DocumentError as error:
        raise DocumentError(f"document {document_id!r}: {error}") from None
    return SourceDocument(id=document_id, text=text, uri=parsed_uri, metadata=metadata)


def extract_text(filename: str, data: bytes) -> str:
    """A file's plain text, by the extension of `filename`; a DocumentError when it cannot be read."""
    extension = PurePosixPath(filename).suffix.lower()
    extractor = _EXTRACTORS.get(extension)
    if extractor is None:
        supported = ", ".join(sorted(_EXTRACTORS))
        raise DocumentError(
            f"{filename}: unsupported file type {extension or '(no extension)'!r}; supported: {supported}"
        )
    return extractor(filename, data)


def _utf8_text(filename: str, data: bytes) -> str:
    try:
        return data.decode("utf-8-sig")  # -sig: a leading byte-order mark is dropped, not kept as text
    except UnicodeDecodeError as error:
        raise DocumentError(
            f"{filename}: not UTF-8 text (byte 0x{data[error.start]:02x} at offset {error.start}); "
            f"convert it to UTF-8"
        ) from None


def _html_main_text(filename: str, data: bytes) -> str:
    import trafilatura  # imported on first use: it loads lxml and date parsers that nothing else needs

    # Bytes, not decoded text: trafilatura reads the page's declared charset itself.
    text = trafilatura.extract(data, output_format="markdown", include_comments=False, include_tables=True)
    if text is None or not text.strip():
        raise DocumentError(f"{filename}: no main text found in the HTML page")
    return text


def _pdf_text(filename: str, data: bytes) -> str:
    # Imported on first use, like trafilatura: processes that only parse document lines need neither.
    from pypdf import PdfReader
    from pypdf.errors import DependencyError, FileNotDecryptedError, PyPdfError

    try:
        reader = PdfReader(io.BytesIO(data))  # opens a PDF with an empty user password by itself
        pages = [page.extract_text() for page in reader.pages]
    except FileNotDecryptedError:
        raise DocumentError(f"{filename}: the PDF is protected by a password; upload it decrypted") from None
    except DependencyError as error:  # AES-encrypted PDFs need the optional cryptography package
        raise DocumentError(f"{filename}: the PDF cannot be read here: {error}") from None
    except PyPdfError as error:
        raise DocumentError(f"{filename}: not a readable PDF ({error})") from None
    except (TypeError, AttributeError, KeyError, IndexError, ValueError) as error:
        # pypdf lets these escape when a damaged file's objects have the wrong types (a trailer that is a
        # name, an xref entry that is text); only pypdf's own calls are inside this try.
        raise DocumentError(f"{filename}: not a readable PDF (damaged structure: {error})") from None
    page_texts = [text.strip() for text in pages if text.strip()]
    if not page_texts:
        raise DocumentError(f"{filename}: the PDF has no text layer (a scanned PDF needs OCR first)")
    return "\n\n".join(page_texts)  # a blank line between pages: a paragraph boundary for the splitter


_JSON_TYPE_NAMES = {
    bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "an array", dict: "an object"
}


def _json_type(value: object) -> str:
    return "null" if value is None else _JSON_TYPE_NAMES[type(value)]


_EXTRACTORS: dict[str, Callable[[str, bytes], str]] = {
    ".txt": _utf8_text,
    ".md": _utf8_text,
    ".html": _html_main_text,
    ".htm": _html_main_text,
    ".pdf": _pdf_text,
}
