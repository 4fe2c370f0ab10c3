"""A chunk whose run_chunk task fails every attempt fails its own requests, and the batch still completes: against
real PostgreSQL, Redis and SeaweedFS, the real run_chunk task in Celery's eager mode (its retries run at once), the
real pipeline and finalize. Only the kind's `run_chunk` is one that always raises, as a poison the engine cannot
survive would."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest
from redis import Redis

from conveyor.local_stack import scratch_database
from engine.admission import AdmissionLimits
from engine.model_registry import DEFAULT_EMBEDDING_MODEL, DEFAULT_MODEL
from engine.tokenizer import Tokenizer
from jobs.celery_app import TaskName, create_celery_app
from jobs.db import SessionFactory, make_engine, make_session_factory, upgrade
from jobs.models import Batch, BatchStatus, Chunk, ChunkStatus, File, Project, utcnow
from jobs.object_keys import file_key
from jobs.run.generation import GenerationKind
from jobs.run.kinds import ChunkResult, EngineHandle
from jobs.run.pipeline import Pipeline
from jobs.run.split import LineNumber
from jobs.served_models import ModelNames, ModelRegistry, WorkerModels, process_models
from jobs.settings import Settings
from jobs.stop_flags import StopFlags
from jobs.storage import ObjectStore
from jobs.tasks import register_tasks
from tests.stack_fixtures import POSTGRES_ADMIN_URL

CHAT = "/v1/chat/completions"
CUSTOM_IDS = ["a", "b", "c"]
MAX_MODEL_LEN = 2048


@pytest.fixture(scope="module")
def sessions() -> Iterator[SessionFactory]:
    with scratch_database(POSTGRES_ADMIN_URL) as url:
        upgrade(url)
        engine = make_engine(url)
        yield make_session_factory(engine)
        engine.dispose()


class AlwaysFailingKind(GenerationKind):
    """Generation lines as validate and finalize see them; running a chunk always raises."""

    def run_chunk(self, batch: Batch, chunk_index: int, lines: Sequence[tuple[LineNumber, bytes]]) -> ChunkResult:
        raise MemoryError("the step asked for more memory than the machine has")


def request_line(custom_id: str) -> bytes:
    body = {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": f"Say {custom_id}"}], "max_tokens": 4}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": CHAT, "body": body}).encode()


@dataclass
class ValidatedBatch:
    """A batch of three lines, validated into two chunks, over a pipeline whose kind always fails."""

    pipeline: Pipeline
    batch_id: str
    run_chunks: list[int]  # the chunks validate enqueued
    finalizes: list[str]  # the batches whose finalize was enqueued


@pytest.fixture
def validated(sessions: SessionFactory, object_store: ObjectStore, smollm2_folder: Path) -> Iterator[ValidatedBatch]:
    settings = Settings(database_url="postgresql+psycopg://unused", redis_prefix=f"test-give-up-{secrets.token_hex(4)}:")
    redis = Redis.from_url("redis://127.0.0.1:6379/0")
    limits = AdmissionLimits(
        max_sequences_per_request=128, max_model_len=MAX_MODEL_LEN, max_tokens_limit=None, default_max_tokens=None,
        num_kv_blocks=256, block_size=16, max_blocks_per_sequence=None, max_prefill_tokens=None,
    )
    served = process_models([DEFAULT_MODEL], DEFAULT_EMBEDDING_MODEL)
    handle = EngineHandle(
        None,  # type: ignore[arg-type]  # never stepped: this kind's run_chunk raises first
        Tokenizer.from_folder(smollm2_folder),
        MAX_MODEL_LEN,
        DEFAULT_MODEL,
        ModelNames(served, {}),
        limits,
    )
    kind = AlwaysFailingKind(
        handle, object_store, StopFlags(redis, settings.redis_prefix), per_chunk=2, limits=settings.batch_limits()
    )

    data = b"".join(request_line(custom_id) + b"\n" for custom_id in CUSTOM_IDS)
    with sessions.begin() as session:
        project = Project(name=f"give-up-{secrets.token_hex(4)}")
        session.add(project)
        session.flush()
        input_file = File(
            project_id=project.id, filename="in.jsonl", purpose="batch", bytes=len(data), object_key="unused"
        )
        session.add(input_file)
        session.flush()
        input_file.object_key = file_key(project.id, input_file.id)
        batch = Batch(
            project_id=project.id,
            input_file_id=input_file.id,
            endpoint=CHAT,
            completion_window="24h",
            expires_at=utcnow() + timedelta(hours=24),
            model=DEFAULT_MODEL,
        )
        session.add(batch)
        session.flush()
        batch_id, object_key = batch.id, input_file.object_key
    object_store.put_bytes(object_key, data)

    run_chunks: list[int] = []
    finalizes: list[str] = []
    pipeline = Pipeline(
        settings=settings,
        sessions=sessions,
        store=object_store,
        redis=redis,
        kinds={CHAT: kind},
        models=WorkerModels(served, ModelRegistry(redis, settings.redis_prefix), {}),
        enqueue_validate=lambda *_: None,
        enqueue_run_chunk=lambda _batch, index, *_: run_chunks.append(index),
        enqueue_finalize=finalizes.append,
        enqueue_webhook_deliveries=lambda _: None,
    )
    pipeline.validate(batch_id)
    assert run_chunks == [0, 1]  # two lines, then one
    yield ValidatedBatch(pipeline, batch_id, run_chunks, finalizes)
    redis.close()


def test_a_chunk_whose_retries_are_spent_fails_its_requests_and_the_batch_completes(
    validated: ValidatedBatch, sessions: SessionFactory, object_store: ObjectStore
) -> None:
    pipeline, batch_id, run_chunks, finalizes = (
        validated.pipeline, validated.batch_id, validated.run_chunks, validated.finalizes
    )
    app = create_celery_app(pipeline.settings)
    register_tasks(app, pipeline)
    for index in run_chunks:
        app.tasks[TaskName.run_chunk].apply(args=(batch_id, index))  # eager: 9 attempts, then the give-up
    assert finalizes == [batch_id]  # the last chunk to give up moved the batch on; it did not wait for its expiry
    pipeline.finalize(batch_id)

    with sessions() as session:
        batch = session.get(Batch, batch_id)
        assert batch is not None
        chunks = session.query(Chunk).filter_by(batch_id=batch_id).all()
        assert {chunk.status for chunk in chunks} == {ChunkStatus.failed}
        assert batch.status == BatchStatus.completed
        assert (batch.completed_requests, batch.failed_requests) == (0, 3)
        assert batch.output_file_id is None and batch.error_file_id is not None
        error_file = session.get(File, batch.error_file_id)
        assert error_file is not None
        records = [json.loads(row) for row in object_store.read_bytes(error_file.object_key).splitlines()]
    assert sorted(record["custom_id"] for record in records) == CUSTOM_IDS  # each request once, none lost
    for record in records:
        assert record["error"]["code"] == "chunk_failed"
        assert "failed 9 times, the last with MemoryError" in record["error"]["message"]
        assert "machine has" not in record["error"]["message"]  # internal details stay in the worker's log

    app.tasks[TaskName.run_chunk].apply(args=(batch_id, 0))  # a late re-delivery changes nothing
    with sessions() as session:
        assert session.get(Batch, batch_id).failed_requests == 3  # type: ignore[union-attr]


def test_a_chunk_running_elsewhere_is_not_failed_by_a_give_up(validated: ValidatedBatch, sessions: SessionFactory) -> None:
    """A re-delivery of the chunk holds its lease: its results are the ones to keep, so the give-up leaves it be."""
    pipeline, batch_id = validated.pipeline, validated.batch_id
    with pipeline.leases.hold(batch_id, 0):
        pipeline.give_up_chunk(batch_id, 0, 9, MemoryError())
    with sessions() as session:
        chunk = session.get(Chunk, (batch_id, 0))
        assert chunk is not None and chunk.status == ChunkStatus.pending
        assert session.get(Batch, batch_id).failed_requests == 0  # type: ignore[union-attr]
    assert validated.finalizes == []


def test_a_chunk_whose_input_vanished_fails_at_once_from_what_validate_recorded(
    validated: ValidatedBatch, sessions: SessionFactory, object_store: ObjectStore
) -> None:
    """No retry can bring the input back: the first attempt gives up, and the error records need nothing of it."""
    pipeline, batch_id = validated.pipeline, validated.batch_id
    with sessions() as session:
        batch = session.get(Batch, batch_id)
        assert batch is not None
        input_key, input_file_id = file_key(batch.project_id, batch.input_file_id), batch.input_file_id
    object_store.delete(input_key)
    reads: list[str] = []
    read_range = object_store.read_range

    def counted_read_range(key: str, start: int, end: int) -> bytes:
        reads.append(key)
        return read_range(key, start, end)

    pipeline.store.read_range = counted_read_range  # type: ignore[method-assign]  # the real store, its reads counted
    app = create_celery_app(pipeline.settings)
    register_tasks(app, pipeline)
    for index in validated.run_chunks:
        app.tasks[TaskName.run_chunk].apply(args=(batch_id, index))
    assert reads == [input_key, input_key]  # one attempt per chunk, and the give-up read nothing
    assert validated.finalizes == [batch_id]
    pipeline.finalize(batch_id)

    with sessions() as session:
        batch = session.get(Batch, batch_id)
        assert batch is not None and batch.status == BatchStatus.completed
        assert (batch.completed_requests, batch.failed_requests) == (0, 3)
        error_file = session.get(File, batch.error_file_id)
        assert error_file is not None
        records = [json.loads(row) for row in object_store.read_bytes(error_file.object_key).splitlines()]
    assert sorted(record["custom_id"] for record in records) == CUSTOM_IDS
    for record in records:
        assert record["error"]["code"] == "chunk_failed" and input_file_id in record["error"]["message"]
