"""The service's only door to S3: batch input and output files, and the pieces they are built from.

Every key the rest of the service passes here is relative; `S3Settings.prefix` is prepended, so several
deployments (or test runs) can share one bucket. Data goes in and out as plain bytes, streamed where files
can be large: `upload_stream` sends S3 multipart parts as they fill and `open_stream` reads in chunks, so
memory stays flat whatever the file size.

`compose` concatenates objects on the server, the way per-chunk results become one batch output file. S3
(AWS, MinIO, SeaweedFS alike) refuses a multipart upload in which any part but the last is smaller than
5 MiB, so small sources are read and sent together as one part, and only sources that can stand as a part
on their own are copied server side.

Credentials come from boto3's default chain (`AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY`, a profile, an
instance role...), never from the settings.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeAlias

import boto3
from botocore.config import Config
from botocore.exceptions import ClientError, ParamValidationError

from jobs.settings import S3Settings

S3Client: TypeAlias = Any  # boto3 builds its client classes at run time

MiB = 1024 * 1024
MIN_PART_BYTES = 5 * MiB  # S3's floor for every part of a multipart upload but the last
DEFAULT_PART_BYTES = 8 * MiB
DEFAULT_CHUNK_BYTES = 1 * MiB
MAX_PARTS = 10_000  # S3's ceiling on parts in one multipart upload
_DELETE_BATCH = 1000  # DeleteObjects takes at most this many keys
_NOT_FOUND_CODES = frozenset({"NoSuchKey", "404", "NotFound"})  # HEAD has no body, so only "404" names it
_KEY_REFUSED_STATUSES = frozenset({400, 414})  # bad request, URI too long


class ObjectRefused(Exception):
    """The store refused the key itself (400 or 414: a key it cannot name): retrying would not help. Everything else
    propagates as it is: a 5xx or a lost connection (transient), 403 (the deployment's credentials), 416 (a range)."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"the object store refused {key!r}: {reason}")
        self.key = key


class ObjectNotFound(KeyError):
    """No object under this (relative) key."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key

    def __str__(self) -> str:
        return f"no object at {self.key!r}"


@dataclass(frozen=True)
class ObjectInfo:
    size: int
    metadata: dict[str, str]  # user metadata; S3 gives the keys back in lower case


@dataclass(frozen=True)
class ListedObject:
    key: str  # relative, like every key passed to the store
    size: int


@dataclass(frozen=True)
class _Segment:
    """Bytes [start, end) of one source object."""

    key: str
    start: int
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class _Part:
    """One part of a composed object: a server-side copy of a single segment, or segments read and sent together."""

    segments: tuple[_Segment, ...]
    copy: bool

    @property
    def size(self) -> int:
        return sum(segment.size for segment in self.segments)


class ObjectStore:
    """A bucket seen through `S3Settings`. Thread-safe: one boto3 client is shared by every call."""

    def __init__(self, settings: S3Settings, *, min_part_bytes: int = MIN_PART_BYTES) -> None:
        self.settings = settings
        self.min_part_bytes = min_part_bytes
        self._client: S3Client = boto3.session.Session().client(
            "s3",
            endpoint_url=settings.endpoint_url,
            region_name=settings.region,
            config=Config(
                signature_version="s3v4",
                s3={"addressing_style": "path"},  # MinIO and SeaweedFS serve buckets as paths, not subdomains
                retries={"mode": "standard", "max_attempts": 5},
                connect_timeout=10,
                read_timeout=120,  # a server-side part copy of a large object answers only when it is done
                # Newer botocore adds CRC checksums to every upload by default, which not every S3 clone accepts.
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
            ),
        )

    def url(self, key: str) -> str:
        """Where a key lives, for people: `s3://<bucket>/<prefix><key>`."""
        return f"s3://{self.settings.bucket}/{self._full(key)}"

    def ensure_bucket(self) -> None:
        """Create the bucket unless it exists. HEAD first: credentials allowed to use a bucket may not create one."""
        try:
            self._client.head_bucket(Bucket=self.settings.bucket)
            return
        except ClientError as error:
            if _error_code(error) not in ("404", "NoSuchBucket", "NotFound"):
                raise
        options: dict[str, Any] = {}
        if self.settings.region != "us-east-1":  # S3 rejects us-east-1 as an explicit location
            options["CreateBucketConfiguration"] = {"LocationConstraint": self.settings.region}
        try:
            self._client.create_bucket(Bucket=self.settings.bucket, **options)
        except ClientError as error:
            if _error_code(error) != "BucketAlreadyOwnedByYou":  # another process won the race: fine
                raise

    def put_bytes(self, key: str, data: bytes, metadata: dict[str, str] | None = None) -> None:
        self._client.put_object(Bucket=self.settings.bucket, Key=self._full(key), Body=data, Metadata=metadata or {})

    def upload_stream(self, key: str, *, part_bytes: int = DEFAULT_PART_BYTES) -> StreamingUpload:
        """A writer that sends `part_bytes` at a time. Nothing is visible at `key` until `complete()`."""
        if part_bytes < self.min_part_bytes:
            raise ValueError(f"part_bytes must be at least {self.min_part_bytes} (S3's minimum part), got {part_bytes}")
        return StreamingUpload(self._client, self.settings.bucket, self._full(key), part_bytes)

    def open_stream(self, key: str, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[bytes]:
        """The object's bytes in chunks of at most `chunk_bytes`. Raises `ObjectNotFound` here, not on first read."""
        body = self._get(key)["Body"]
        return _chunks(body, chunk_bytes)

    def read_bytes(self, key: str) -> bytes:
        return _read_all(self._get(key))

    def read_range(self, key: str, start: int, end_exclusive: int) -> bytes:
        """Bytes [start, end_exclusive), cut short at the end of the object like a slice of `bytes`."""
        if not 0 <= start <= end_exclusive:
            raise ValueError(f"invalid range [{start}, {end_exclusive})")
        if start == end_exclusive:
            if not self.exists(key):
                raise ObjectNotFound(key)
            return b""
        try:
            return _read_all(self._get(key, Range=f"bytes={start}-{end_exclusive - 1}"))
        except ClientError as error:
            if _error_code(error) == "InvalidRange":  # S3's answer to a range that starts past the end
                return b""
            raise

    def exists(self, key: str) -> bool:
        return self.head(key) is not None

    def head(self, key: str) -> ObjectInfo | None:
        try:
            response = self._client.head_object(Bucket=self.settings.bucket, Key=self._full(key))
        except ClientError as error:
            if _error_code(error) in _NOT_FOUND_CODES:
                return None
            raise
        return ObjectInfo(size=response["ContentLength"], metadata=dict(response.get("Metadata", {})))

    def list_objects(self, prefix: str) -> list[ListedObject]:
        """Every object whose relative key starts with `prefix`, in key order (S3's listing order)."""
        objects: list[ListedObject] = []
        for page in self._client.get_paginator("list_objects_v2").paginate(
            Bucket=self.settings.bucket, Prefix=self._full(prefix)
        ):
            objects += [
                ListedObject(key=entry["Key"][len(self.settings.prefix) :], size=entry["Size"])
                for entry in page.get("Contents", [])
            ]
        return objects

    def delete(self, key: str) -> None:
        """Remove the object; removing one that is not there is not an error (S3's own semantics)."""
        self._client.delete_object(Bucket=self.settings.bucket, Key=self._full(key))

    def delete_prefix(self, prefix: str) -> int:
        """Remove every object whose relative key starts with `prefix`; return how many there were."""
        full_prefix = self._full(prefix)
        if not full_prefix:
            raise ValueError("refusing to empty the whole bucket: give a prefix, or configure S3Settings.prefix")
        deleted = 0
        for page in self._client.get_paginator("list_objects_v2").paginate(
            Bucket=self.settings.bucket, Prefix=full_prefix, PaginationConfig={"PageSize": _DELETE_BATCH}
        ):
            keys = [{"Key": entry["Key"]} for entry in page.get("Contents", [])]
            if not keys:
                continue
            response = self._client.delete_objects(Bucket=self.settings.bucket, Delete={"Objects": keys, "Quiet": True})
            if response.get("Errors"):
                raise RuntimeError(f"could not delete under {full_prefix!r}: {response['Errors'][:3]}")
            deleted += len(keys)
        return deleted

    def compose(self, dest_key: str, source_keys: Sequence[str]) -> int:
        """Write the concatenation of `source_keys` to `dest_key`; return its size.

        Sources of at least `min_part_bytes` are copied on the server. Runs of smaller neighbours are read and
        sent as one part once they reach the minimum, topped up from the front of the next large source when
        needed; such a part stays below twice the minimum, which bounds memory. Empty sources are skipped, and
        nothing at all to compose writes an empty object.
        """
        parts = _plan_parts([(key, self._size(key)) for key in source_keys], self.min_part_bytes)
        if not parts:
            self.put_bytes(dest_key, b"")
            return 0
        if len(parts) > MAX_PARTS:
            raise ValueError(f"{len(parts)} parts exceed S3's limit of {MAX_PARTS}")
        dest = self._full(dest_key)
        upload_id = self._client.create_multipart_upload(Bucket=self.settings.bucket, Key=dest)["UploadId"]
        try:
            etags = [self._send_part(dest, upload_id, number, part) for number, part in enumerate(parts, start=1)]
            self._client.complete_multipart_upload(
                Bucket=self.settings.bucket,
                Key=dest,
                UploadId=upload_id,
                MultipartUpload={"Parts": [{"PartNumber": n, "ETag": etag} for n, etag in enumerate(etags, start=1)]},
            )
        except BaseException:
            self._client.abort_multipart_upload(Bucket=self.settings.bucket, Key=dest, UploadId=upload_id)
            raise
        return sum(part.size for part in parts)

    def _send_part(self, dest: str, upload_id: str, number: int, part: _Part) -> str:
        """Upload one planned part and return its ETag."""
        target = {"Bucket": self.settings.bucket, "Key": dest, "UploadId": upload_id, "PartNumber": number}
        if part.copy:
            (segment,) = part.segments
            response = self._client.upload_part_copy(
                **target,
                CopySource={"Bucket": self.settings.bucket, "Key": self._full(segment.key)},
                CopySourceRange=f"bytes={segment.start}-{segment.end - 1}",
            )
            copy_etag: str = response["CopyPartResult"]["ETag"]
            return copy_etag
        data = b"".join(self.read_range(segment.key, segment.start, segment.end) for segment in part.segments)
        upload_etag: str = self._client.upload_part(**target, Body=data)["ETag"]
        return upload_etag

    def _size(self, key: str) -> int:
        info = self.head(key)
        if info is None:
            raise ObjectNotFound(key)
        return info.size

    def _get(self, key: str, **options: str) -> Any:
        """GetObject's response, its body still to read."""
        try:
            return self._client.get_object(Bucket=self.settings.bucket, Key=self._full(key), **options)
        except (ParamValidationError, UnicodeEncodeError) as invalid:  # refused before it is sent
            raise ObjectRefused(key, str(invalid)) from None
        except ClientError as error:
            if _error_code(error) in _NOT_FOUND_CODES:
                raise ObjectNotFound(key) from None
            status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            if status in _KEY_REFUSED_STATUSES:
                raise ObjectRefused(key, f"{_error_code(error)} ({status})") from None
            raise

    def _full(self, key: str) -> str:
        return self.settings.prefix + key


class StreamingUpload:
    """Bytes written in any pieces, sent to S3 a part at a time, so memory holds about two parts (the buffer and the
    part on its way out) plus the piece being written. Objects smaller than one part go up as a single PUT.

    As a context manager it completes on a clean exit and aborts if an exception escapes, so a failed writer never
    leaves a partial object behind.
    """

    def __init__(self, client: S3Client, bucket: str, key: str, part_bytes: int) -> None:
        self._client = client
        self._bucket = bucket
        self._key = key
        self._part_bytes = part_bytes
        self._buffer = bytearray()
        self._upload_id: str | None = None  # created with the first full part
        self._etags: list[str] = []
        self._bytes_written = 0
        self._finished = False

    @property
    def bytes_written(self) -> int:
        return self._bytes_written

    def write(self, data: bytes) -> None:
        self._check_open()
        self._buffer += data
        self._bytes_written += len(data)
        while len(self._buffer) >= self._part_bytes:
            with memoryview(self._buffer) as view:
                part = bytes(view[: self._part_bytes])
            self._send_part(part)
            del self._buffer[: self._part_bytes]

    def complete(self) -> int:
        """Make the object visible at its key; return its size in bytes."""
        self._check_open()
        if self._upload_id is None:
            self._client.put_object(Bucket=self._bucket, Key=self._key, Body=bytes(self._buffer))
        else:
            if self._buffer:
                self._send_part(bytes(self._buffer))
            self._client.complete_multipart_upload(
                Bucket=self._bucket,
                Key=self._key,
                UploadId=self._upload_id,
                MultipartUpload={"Parts": [{"PartNumber": n, "ETag": e} for n, e in enumerate(self._etags, start=1)]},
            )
        self._finish()
        return self._bytes_written

    def abort(self) -> None:
        """Drop everything written; the key is left as it was. Does nothing once completed or aborted."""
        if self._finished:
            return
        if self._upload_id is not None:
            self._client.abort_multipart_upload(Bucket=self._bucket, Key=self._key, UploadId=self._upload_id)
        self._finish()

    def __enter__(self) -> StreamingUpload:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if exc_type is None and not self._finished:
            try:
                self.complete()
            except BaseException:
                self.abort()
                raise
        self.abort()  # nothing to do once completed

    def _send_part(self, data: bytes) -> None:
        if len(self._etags) == MAX_PARTS:
            raise ValueError(f"more than {MAX_PARTS} parts of {self._part_bytes} bytes: use a larger part size")
        if self._upload_id is None:
            self._upload_id = self._client.create_multipart_upload(Bucket=self._bucket, Key=self._key)["UploadId"]
        response = self._client.upload_part(
            Bucket=self._bucket, Key=self._key, UploadId=self._upload_id, PartNumber=len(self._etags) + 1, Body=data
        )
        self._etags.append(response["ETag"])

    def _check_open(self) -> None:
        if self._finished:
            raise RuntimeError(f"upload to {self._key!r} is already completed or aborted")

    def _finish(self) -> None:
        self._finished = True
        self._buffer = bytearray()


def _plan_parts(sources: Sequence[tuple[str, int]], min_part_bytes: int) -> list[_Part]:
    """Cut (key, size) sources, in order, into multipart parts that S3 accepts.

    Every part but the last has at least `min_part_bytes`. A source that can stand alone is copied whole; a run of
    small sources becomes one read-and-sent part as soon as it reaches the minimum. A large source met while a run
    is pending tops the run up to exactly the minimum from its front; its rest is copied if it can stand alone, or
    starts the next run. A pending run therefore stays below the minimum, and a sent part below twice of it.
    """
    parts: list[_Part] = []
    pending: list[_Segment] = []
    pending_bytes = 0
    for key, size in sources:
        segment = _Segment(key, 0, size)
        if pending and size >= min_part_bytes:
            top_up = min_part_bytes - pending_bytes
            parts.append(_Part((*pending, _Segment(key, 0, top_up)), copy=False))
            pending, pending_bytes = [], 0
            segment = _Segment(key, top_up, size)
        if segment.size >= min_part_bytes:
            parts.append(_Part((segment,), copy=True))
        elif segment.size > 0:
            pending.append(segment)
            pending_bytes += segment.size
            if pending_bytes >= min_part_bytes:
                parts.append(_Part(tuple(pending), copy=False))
                pending, pending_bytes = [], 0
    if pending:
        parts.append(_Part(tuple(pending), copy=False))
    return parts


def _read_all(response: Any) -> bytes:
    with response["Body"] as body:
        data: bytes = body.read()
    return data


def _chunks(body: Any, chunk_bytes: int) -> Iterator[bytes]:
    with body:
        yield from body.iter_chunks(chunk_bytes)


def _error_code(error: ClientError) -> str:
    return str(error.response.get("Error", {}).get("Code", ""))
