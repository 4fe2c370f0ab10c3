"""Which workers read a RAG job. One reading PDFs as pages is bound at creation to a served model that reads images
(the deployment's models as the workers announce them in Redis), and a worker serving another model that takes its
validate from the shared queue passes it on to that model's queue; a deployment serving no such model refuses the job
at creation. A job reading text is bound to no model: any worker validates it, and its chunks go to the shared queue.
Against real PostgreSQL, Redis and SeaweedFS; no engine runs (no page is read here: tests/api/test_vision_service.py
runs a bound job on a LLaVA worker)."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator

import pytest
from redis import Redis
from sqlalchemy import select

from engine.model_registry import DEFAULT_EMBEDDING_MODEL
from jobs.batches import RAG_ENDPOINT
from jobs.db import SessionFactory, make_engine, make_session_factory
from jobs.enqueue import chunk_queue
from jobs.errors import ServiceError
from jobs.files import record_file
from jobs.keys import create_key_in_database
from jobs.lazy_embedder import LazyEmbedder
from jobs.models import Batch, BatchStatus, FilePurpose, new_id
from jobs.object_keys import file_key
from jobs.rag.jobs import RagJobSpec, add_rag_job, job_model, prepare_rag_job
from jobs.rag.kind import RagKind
from jobs.rag.processing import RagOptions
from jobs.run.kinds import EngineHandle
from jobs.run.pipeline import Pipeline
from jobs.served_models import ModelNames, ModelRegistry, WorkerModels, process_models
from jobs.settings import S3Settings, Settings
from jobs.stop_flags import StopFlags
from jobs.storage import ObjectStore

EMBEDDING = DEFAULT_EMBEDDING_MODEL
TEXT_ONLY = process_models(["llm"], EMBEDDING)
PAGES = {"pdf_mode": "pages"}
PREFIX = f"test-rag-models-{secrets.token_hex(4)}:"  # this module's Redis keys


def test_pages_need_a_served_model_that_reads_images() -> None:
    readers = process_models(["vlm-b"], EMBEDDING, accepts_images=True)
    readers += process_models(["vlm-a"], EMBEDDING, ["tone"], accepts_images=True)
    pages = RagOptions(pdf_mode="pages")
    # A job reading text needs no model, so its creation does not read the deployment's
    assert job_model(RagOptions(), lambda: pytest.fail("the served models were read")) is None
    # Several read images: the first by id, a base model (an adapter is its base's)
    assert job_model(pages, lambda: TEXT_ONLY + readers) == "vlm-a"
    with pytest.raises(ServiceError) as text_only:
        job_model(pages, lambda: TEXT_ONLY)
    refused = text_only.value
    assert (refused.kind, refused.param) == ("invalid_request", "options.pdf_mode")
    assert refused.code == "model_not_multimodal"
    assert "read text only ('llm')" in refused.message
    with pytest.raises(ServiceError) as nobody:
        job_model(pages, list)
    assert nobody.value.code == "model_not_multimodal" and "no worker has announced a model" in nobody.value.message


@pytest.fixture
def sessions(database_url: str) -> Iterator[SessionFactory]:
    engine = make_engine(database_url)
    yield make_session_factory(engine)
    engine.dispose()


@pytest.fixture
def redis() -> Iterator[Redis]:
    """A Redis client; the module's keys (PREFIX) are removed after the test."""
    client = Redis.from_url("redis://127.0.0.1:6379/0")
    yield client
    client.delete(*client.keys(f"{PREFIX}*") or [f"{PREFIX}none"])
    client.close()


def create_job(
    sessions: SessionFactory, store: ObjectStore, s3: S3Settings, project_id: str, file_id: str, options: dict,
    registry: ModelRegistry,
) -> Batch:
    """POST /v1/rag/jobs's two steps, with the deployment's models as the API reads them."""
    spec = RagJobSpec(file_id, None, options, metadata=None, completion_window="24h", priority=0)
    prepared = prepare_rag_job(store, s3, project_id, spec, EMBEDDING, registry.served)
    with sessions.begin() as session:
        job = add_rag_job(session, project_id, spec, prepared, None)
        session.expunge(job)
    return job


def test_a_text_only_worker_passes_a_pages_job_on_to_the_model_that_reads_images(
    sessions: SessionFactory, object_store: ObjectStore, s3_settings: S3Settings, database_url: str, redis: Redis
) -> None:
    registry = ModelRegistry(redis, PREFIX)
    project_id = create_key_in_database(database_url, f"rag-models-{secrets.token_hex(4)}").project_id
    file_id = new_id("file-")
    data = json.dumps({"id": "form", "text": "A form."}).encode() + b"\n"
    object_store.put_bytes(file_key(project_id, file_id), data)
    with sessions.begin() as session:
        record_file(session, file_id=file_id, project_id=project_id, filename="docs.jsonl", purpose=FilePurpose.batch,
                    size=len(data), object_key=file_key(project_id, file_id))

    registry.announce(TEXT_ONLY)  # a deployment of one text-only worker refuses pages at creation
    with pytest.raises(ServiceError) as refused:
        create_job(sessions, object_store, s3_settings, project_id, file_id, PAGES, registry)
    assert refused.value.code == "model_not_multimodal"

    registry.announce(process_models(["vlm"], EMBEDDING, accepts_images=True))  # a second group, reading images
    pages = create_job(sessions, object_store, s3_settings, project_id, file_id, PAGES, registry)
    text = create_job(sessions, object_store, s3_settings, project_id, file_id, {}, registry)
    assert (pages.model, text.model) == ("vlm", None)

    # The text-only worker's pipeline (its engine never runs here: validate reads no model)
    settings = Settings(database_url=database_url, redis_prefix=PREFIX, s3=s3_settings)
    handle = EngineHandle(None, None, 2048, "llm", ModelNames(TEXT_ONLY, {}), None)  # type: ignore[arg-type]
    kind = RagKind(settings=settings, store=object_store, stop_flags=StopFlags(redis, settings.redis_prefix),
                   engine=handle, embedder=LazyEmbedder(EMBEDDING, lambda: pytest.fail("nothing is embedded")))
    validates: list[tuple[str, str | None]] = []
    chunks: list[tuple[str, str | None]] = []
    pipeline = Pipeline(
        settings=settings, sessions=sessions, store=object_store, redis=redis, kinds={RAG_ENDPOINT: kind},
        models=WorkerModels(TEXT_ONLY, registry, {}),
        enqueue_validate=lambda job_id, model: validates.append((job_id, model)),
        enqueue_run_chunk=lambda job_id, _index, _priority, model: chunks.append((job_id, model)),
        enqueue_finalize=lambda _: None, enqueue_webhook_deliveries=lambda _: None,
    )
    pipeline.validate(pages.id)
    assert validates == [(pages.id, "vlm")] and chunks == []  # sent on to gpu.vlm, where vlm's workers validate it
    pipeline.validate(text.id)
    assert chunks == [(text.id, None)] and chunk_queue(None) == "gpu"  # any worker's
    assert chunk_queue("vlm") == "gpu.vlm"  # where the pages job's chunks go once vlm's worker has validated it
    with sessions() as session:
        statuses = dict(session.execute(select(Batch.id, Batch.status).where(Batch.id.in_([pages.id, text.id]))).all())
    assert statuses == {pages.id: BatchStatus.validating, text.id: BatchStatus.in_progress}
