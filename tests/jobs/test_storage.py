"""ObjectStore against a real SeaweedFS S3 server (the `seaweedfs` session fixture): streaming, ranges, compose.

SeaweedFS enforces S3's 5 MiB minimum for every multipart part but the last, so multipart tests use parts of exactly
that minimum, the smallest objects that still exercise the real code paths.
"""

from __future__ import annotations

import random
import secrets
from collections.abc import Iterator

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError
from hypothesis import given
from hypothesis import strategies as st

from jobs.settings import S3Settings
from jobs.storage import MIN_PART_BYTES, ObjectNotFound, ObjectStore, S3Client, _plan_parts

PART = MIN_PART_BYTES


def random_bytes(size: int) -> bytes:
    return random.Random(size).randbytes(size)


def pieces(data: bytes, size: int) -> Iterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start : start + size]


@pytest.fixture
def prefix(request: pytest.FixtureRequest) -> str:
    """A key prefix of the test's own, so tests never see each other's objects."""
    return f"{request.node.name}-{secrets.token_hex(3)}/"


@pytest.fixture(scope="module")
def raw_s3(s3_settings: S3Settings) -> S3Client:
    """A plain boto3 client on the same bucket, to look behind ObjectStore (full keys, pending multipart uploads)."""
    return boto3.session.Session().client(
        "s3",
        endpoint_url=s3_settings.endpoint_url,
        region_name=s3_settings.region,
        config=Config(signature_version="s3v4", s3={"addressing_style": "path"}),
    )


def pending_uploads(raw_s3: S3Client, settings: S3Settings, key: str) -> list[str]:
    response = raw_s3.list_multipart_uploads(Bucket=settings.bucket, Prefix=settings.prefix + key)
    return [upload["UploadId"] for upload in response.get("Uploads", [])]


def test_streaming_upload_sends_parts_as_they_fill(
    object_store: ObjectStore, raw_s3: S3Client, s3_settings: S3Settings, prefix: str
) -> None:
    key = prefix + "big.bin"
    data = random_bytes(2 * PART + 12_345)
    upload = object_store.upload_stream(key, part_bytes=PART)
    for piece in pieces(data, 777_777):  # writes that straddle part boundaries
        upload.write(piece)

    (upload_id,) = pending_uploads(raw_s3, s3_settings, key)
    parts = raw_s3.list_parts(Bucket=s3_settings.bucket, Key=s3_settings.prefix + key, UploadId=upload_id)["Parts"]
    assert [part["Size"] for part in parts] == [PART, PART]  # sent while writing; the tail waits for complete()
    assert not object_store.exists(key)

    assert upload.complete() == len(data)
    assert object_store.read_bytes(key) == data
    assert pending_uploads(raw_s3, s3_settings, key) == []


def test_small_upload_completes_as_one_object(
    object_store: ObjectStore, raw_s3: S3Client, s3_settings: S3Settings, prefix: str
) -> None:
    key = prefix + "small.txt"
    with object_store.upload_stream(key) as upload:
        for piece in (b"hello", b", ", b"world"):
            upload.write(piece)
        assert upload.complete() == 12
    assert object_store.read_bytes(key) == b"hello, world"
    assert pending_uploads(raw_s3, s3_settings, key) == []


def test_empty_upload_creates_an_empty_object(object_store: ObjectStore, prefix: str) -> None:
    assert object_store.upload_stream(prefix + "empty").complete() == 0
    info = object_store.head(prefix + "empty")
    assert info is not None and info.size == 0


def test_upload_context_completes_on_a_clean_exit(object_store: ObjectStore, prefix: str) -> None:
    with object_store.upload_stream(prefix + "auto") as upload:
        upload.write(b"done")
    assert upload.bytes_written == 4
    assert object_store.read_bytes(prefix + "auto") == b"done"


def test_abort_leaves_no_object_and_no_parts(
    object_store: ObjectStore, raw_s3: S3Client, s3_settings: S3Settings, prefix: str
) -> None:
    key = prefix + "aborted"
    upload = object_store.upload_stream(key, part_bytes=PART)
    upload.write(random_bytes(PART + 10))  # one part already on the server
    assert len(pending_uploads(raw_s3, s3_settings, key)) == 1

    upload.abort()
    assert not object_store.exists(key)
    assert pending_uploads(raw_s3, s3_settings, key) == []
    with pytest.raises(RuntimeError, match="aborted"):
        upload.write(b"more")


def test_upload_context_aborts_on_an_exception(
    object_store: ObjectStore, raw_s3: S3Client, s3_settings: S3Settings, prefix: str
) -> None:
    key = prefix + "failed"
    with pytest.raises(OSError, match="producer failed"):
        with object_store.upload_stream(key, part_bytes=PART) as upload:
            upload.write(random_bytes(PART + 1))
            raise OSError("producer failed")
    assert not object_store.exists(key)
    assert pending_uploads(raw_s3, s3_settings, key) == []


def test_part_size_below_the_s3_minimum_is_refused(object_store: ObjectStore) -> None:
    with pytest.raises(ValueError, match="part_bytes"):
        object_store.upload_stream("never", part_bytes=PART - 1)


def test_read_range_slices_like_bytes(object_store: ObjectStore, prefix: str) -> None:
    data = random_bytes(1000)
    object_store.put_bytes(prefix + "data", data)
    for start, end in [(0, 10), (123, 456), (990, 1000), (990, 5000), (1000, 1000), (1500, 1600), (7, 7)]:
        assert object_store.read_range(prefix + "data", start, end) == data[start:end], (start, end)
    object_store.put_bytes(prefix + "empty", b"")
    assert object_store.read_range(prefix + "empty", 0, 10) == b""
    for start, end in [(10, 5), (-1, 3)]:
        with pytest.raises(ValueError):
            object_store.read_range(prefix + "data", start, end)


def test_open_stream_yields_bounded_chunks(object_store: ObjectStore, prefix: str) -> None:
    data = random_bytes(10_500)
    object_store.put_bytes(prefix + "stream", data)
    chunks = list(object_store.open_stream(prefix + "stream", chunk_bytes=1000))
    assert b"".join(chunks) == data
    assert len(chunks) >= 11 and max(len(chunk) for chunk in chunks) <= 1000


def test_head_exists_and_idempotent_delete(object_store: ObjectStore, prefix: str) -> None:
    key = prefix + "doc.json"
    assert object_store.head(key) is None and not object_store.exists(key)
    object_store.put_bytes(key, b"{}", metadata={"purpose": "batch", "line-count": "0"})
    info = object_store.head(key)
    assert info is not None
    assert (info.size, info.metadata) == (2, {"purpose": "batch", "line-count": "0"})
    assert object_store.exists(key)

    object_store.delete(key)
    object_store.delete(key)
    assert object_store.head(key) is None


def test_missing_keys_raise_object_not_found(object_store: ObjectStore, prefix: str) -> None:
    missing = prefix + "missing"
    reads = [
        lambda: object_store.read_bytes(missing),
        lambda: object_store.open_stream(missing),
        lambda: object_store.read_range(missing, 0, 10),
        lambda: object_store.read_range(missing, 3, 3),
        lambda: object_store.compose(prefix + "dest", [missing]),
    ]
    for read in reads:
        with pytest.raises(ObjectNotFound) as raised:
            read()
        assert isinstance(raised.value, KeyError) and raised.value.key == missing
    assert not object_store.exists(prefix + "dest")


def test_compose_copies_large_sources_and_buffers_small_ones(object_store: ObjectStore, prefix: str) -> None:
    sizes = [
        PART + 11,  # copied whole
        0,
        3 * 1024 * 1024,  # two smalls reach the minimum: one uploaded part
        3 * 1024 * 1024,
        1000,  # pending when a large source comes...
        2 * PART + 17,  # ...which tops it up, then has a rest large enough to copy by range
        500,
        PART + 100,  # tops up again; its rest is too small to copy and waits
        0,
        77,  # the last part, below the minimum
    ]
    sources = [f"{prefix}source-{index}" for index in range(len(sizes))]
    contents = [random.Random(index).randbytes(size) for index, size in enumerate(sizes)]
    for key, content in zip(sources, contents, strict=True):
        object_store.put_bytes(key, content)
    kinds = [part.copy for part in _plan_parts(list(zip(sources, sizes, strict=True)), PART)]
    assert kinds == [True, False, False, True, False, False]

    expected = b"".join(contents)
    assert object_store.compose(prefix + "composed", sources) == len(expected)
    assert object_store.read_bytes(prefix + "composed") == expected


def test_compose_of_small_sources_only(object_store: ObjectStore, prefix: str) -> None:
    for index, content in enumerate([b"first,", b"", b"second,", b"third"]):
        object_store.put_bytes(f"{prefix}{index}", content)
    assert object_store.compose(prefix + "out", [f"{prefix}{index}" for index in range(4)]) == 18
    assert object_store.read_bytes(prefix + "out") == b"first,second,third"


def test_compose_of_nothing_writes_an_empty_object(object_store: ObjectStore, prefix: str) -> None:
    assert object_store.compose(prefix + "none", []) == 0
    object_store.put_bytes(prefix + "empty", b"")
    assert object_store.compose(prefix + "empties", [prefix + "empty", prefix + "empty"]) == 0
    for key in ("none", "empties"):
        assert object_store.read_bytes(prefix + key) == b""


@given(st.lists(st.integers(min_value=0, max_value=350), max_size=12))
def test_planned_parts_are_legal_and_cover_the_sources_in_order(sizes: list[int]) -> None:
    minimum = 100
    sources = [(f"k{index}", size) for index, size in enumerate(sizes)]
    parts = _plan_parts(sources, minimum)
    assert all(part.size >= minimum for part in parts[:-1])
    assert all(part.size < 2 * minimum for part in parts if not part.copy)  # memory bound of a sent part
    assert all(len(part.segments) == 1 for part in parts if part.copy)
    # Reading the segments in order gives every byte of every source, in order, nothing twice, nothing empty.
    segments = [(segment.key, segment.start, segment.end) for part in parts for segment in part.segments]
    assert all(start < end for _, start, end in segments)
    position = {key: 0 for key, _ in sources}
    for key, start, end in segments:
        assert start == position[key]
        position[key] = end
    assert list(position.values()) == sizes
    assert [key for key, _, _ in segments] == sorted((key for key, _, _ in segments), key=lambda k: int(k[1:]))


def test_keys_land_under_the_prefix(
    object_store: ObjectStore, raw_s3: S3Client, s3_settings: S3Settings, prefix: str
) -> None:
    object_store.put_bytes(prefix + "a/b.txt", b"x")
    listed = raw_s3.list_objects_v2(Bucket=s3_settings.bucket, Prefix=s3_settings.prefix + prefix)
    assert [entry["Key"] for entry in listed["Contents"]] == [s3_settings.prefix + prefix + "a/b.txt"]

    neighbour = ObjectStore(S3Settings(s3_settings.endpoint_url, s3_settings.bucket, prefix="other-run/"))
    assert not neighbour.exists(prefix + "a/b.txt")
    neighbour.put_bytes(prefix + "a/b.txt", b"y")
    assert object_store.read_bytes(prefix + "a/b.txt") == b"x"
    neighbour.delete_prefix(prefix)


def test_delete_prefix_removes_only_that_prefix(object_store: ObjectStore, prefix: str) -> None:
    for key in ("p/1", "p/2", "p/deeper/3", "q/1"):
        object_store.put_bytes(prefix + key, b".")
    assert object_store.delete_prefix(prefix + "p/") == 3
    assert [object_store.exists(prefix + key) for key in ("p/1", "p/deeper/3", "q/1")] == [False, False, True]
    with pytest.raises(ValueError, match="whole bucket"):
        ObjectStore(S3Settings("http://unused", "bucket")).delete_prefix("")


def test_ensure_bucket_is_idempotent(object_store: ObjectStore) -> None:
    object_store.ensure_bucket()


def test_a_wrong_secret_is_rejected(
    s3_settings: S3Settings, object_store: ObjectStore, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    object_store.put_bytes(prefix + "secret", b"s")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(ClientError) as raised:
        ObjectStore(s3_settings).read_bytes(prefix + "secret")
    assert raised.value.response["Error"]["Code"] == "SignatureDoesNotMatch"
