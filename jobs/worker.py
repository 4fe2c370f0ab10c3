"""The GPU worker process: one engine, stepped by its own thread, fed by many concurrent run_chunk tasks.

Celery runs tasks on a thread pool here, so every run_chunk of this process submits into the same
`EngineLoop`: the running batch stays full across chunk, job and tenant boundaries.
"""

from __future__ import annotations

import logging
import threading

from redis import Redis

from engine.embedder import Embedder
from engine.engine_loop import EngineLoop
from engine.llm_engine import LLMEngine
from engine.model_registry import resolve_embedding_model
from jobs.celery_app import CONTROL_QUEUE, GPU_QUEUE, celery_app
from jobs.db import make_engine, make_session_factory
from jobs.lazy_embedder import LazyEmbedder
from jobs.pipeline import EngineHandle, Pipeline
from jobs.rag.job_pipeline import RagJobRunner
from jobs.settings import Settings
from jobs.stop_flags import StopFlags
from jobs.worker_metrics import start_worker_telemetry
from jobs.storage import ObjectStore

log = logging.getLogger(__name__)

# Slots beyond the chunk tasks, so validate and finalize never wait behind a full house of chunks.
CONTROL_SLOTS = 2

_pipeline: Pipeline | None = None
_pipeline_lock = threading.Lock()


def build_pipeline(settings: Settings) -> Pipeline:
    from jobs import tasks

    # Only found, not loaded (see LazyEmbedder): a misnamed embedding model fails the worker now, not a batch later.
    resolve_embedding_model(settings.embedding_model)
    log.info("loading model %s", settings.model)
    loop = EngineLoop.build(
        lambda: LLMEngine(settings.model, dtype=settings.dtype, device=settings.device, **settings.engine_options)
    )
    engine = loop.engine
    if engine.tokenizer is None:
        loop.stop()
        raise ValueError(f"model {settings.model!r} has no tokenizer; the batch API needs one to read prompts")
    store = ObjectStore(settings.s3)
    store.ensure_bucket()
    redis = Redis.from_url(settings.redis_url)
    engine_handle = EngineHandle(
        loop=loop, tokenizer=engine.tokenizer, max_model_len=engine.max_model_len, model_name=engine.model_name
    )
    embedder = LazyEmbedder(
        settings.embedding_model,
        lambda: Embedder(settings.embedding_model, dtype=settings.dtype, device=settings.device),
    )
    return Pipeline(
        settings=settings,
        sessions=make_session_factory(make_engine(settings.database_url)),
        store=store,
        redis=redis,
        engine=engine_handle,
        embedder=embedder,
        rag=RagJobRunner(
            settings=settings,
            store=store,
            stop_flags=StopFlags(redis, settings.redis_prefix),
            engine=engine_handle,
            embedder=embedder,
        ),
        enqueue_run_chunk=tasks.enqueue_run_chunk,
        enqueue_finalize=tasks.enqueue_finalize,
        enqueue_webhook_deliveries=tasks.enqueue_webhook_deliveries,
    )


def get_pipeline() -> Pipeline:
    global _pipeline
    with _pipeline_lock:
        if _pipeline is None:
            _pipeline = build_pipeline(Settings.from_env())
        return _pipeline


def run_worker(settings: Settings, queues: list[str] | None = None, loglevel: str = "INFO") -> None:
    concurrency = settings.effective_worker_concurrency + CONTROL_SLOTS
    pipeline = get_pipeline()  # before consuming: a model that cannot load fails the worker at start, not every task
    start_worker_telemetry(settings, pipeline.engine.loop)
    celery_app.worker_main(
        [
            # Celery's start-up banner is many lines of plain text, which would break a stream of JSON lines.
            *(["--quiet"] if settings.log_format == "json" else []),
            "worker",
            "--pool=threads",
            f"--concurrency={concurrency}",
            "--queues=" + ",".join(queues or [GPU_QUEUE, CONTROL_QUEUE]),
            f"--loglevel={loglevel}",
            "--without-gossip",
            "--without-mingle",
        ]
    )
