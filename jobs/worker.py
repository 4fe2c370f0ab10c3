"""The GPU worker process: one engine, stepped by its own thread, fed by many concurrent run_chunk tasks.

Celery runs tasks on a thread pool here, so every run_chunk of this process submits into the same
`EngineLoop`: the running batch stays full across chunk, job and tenant boundaries. Everything the tasks use is
built and wired here, once, before the worker consumes: the engine, the job kinds, the pipeline, the tasks.

A worker whose engine fails (`EngineFailed`: a tensor-parallel rank died) serves nothing more, so it stops: the
engine loop's failure sends this process SIGTERM, Celery's warm shutdown stops fetching tasks and waits for the
running ones, whose chunks write nothing, release their leases and go back to the queue (jobs/tasks.py), and the
process exits with `ENGINE_FAILED_EXIT_CODE`, for whatever runs it (`conveyor up`'s supervisor, the worker-group
supervisor, a container's restart policy) to start a fresh one.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
from pathlib import Path
from typing import Any

from redis import Redis

from engine.admission import EngineFailed
from engine.config import model_quantization
from engine.embedder import Embedder
from engine.engine_loop import EngineLoop
from engine.llm_engine import LLMEngine
from engine.model_registry import default_cache_dir, resolve_embedding_model
from jobs import enqueue
from jobs.adapter_sources import local_lora_adapters
from jobs.batches import RAG_ENDPOINT
from jobs.celery_app import CONTROL_QUEUE, celery_app
from jobs.db import make_engine, make_session_factory
from jobs.formats.anthropic_messages import MESSAGES
from jobs.lazy_embedder import LazyEmbedder
from jobs.openai_format.requests import CHAT_COMPLETIONS, COMPLETIONS, EMBEDDINGS, RESPONSES
from jobs.rag.kind import RagKind
from jobs.run.embeddings import EmbeddingsKind
from jobs.run.generation import GenerationKind
from jobs.run.kinds import EngineHandle, JobKind
from jobs.run.memory import cap_malloc_arenas
from jobs.run.pipeline import Pipeline
from jobs.served_models import (
    UNROUTED_QUEUE, ModelRegistry, WorkerModels, parse_aliases, parse_names, process_models,
)
from jobs.settings import Settings
from jobs.stop_flags import StopFlags
from jobs.storage import ObjectStore
from jobs.tasks import register_tasks
from jobs.webhooks.targets import AllowList
from jobs.telemetry.worker_metrics import ENGINE_STATS_TIMEOUT_SECONDS, start_worker_telemetry
from jobs.telemetry.worker_samples import SampleRecorder

log = logging.getLogger(__name__)

# Slots beyond the chunk tasks, so validate and finalize never wait behind a full house of chunks.
CONTROL_SLOTS = 2
# The exit status of a worker whose engine failed (sysexits' EX_SOFTWARE): not 0, so that it is restarted.
ENGINE_FAILED_EXIT_CODE = 70


def build_engine(settings: Settings) -> EngineLoop:
    # Only found, not loaded (see LazyEmbedder): a misnamed embedding model fails the worker now, not a batch later.
    resolve_embedding_model(settings.embedding_model)
    log.info("loading model %s", settings.model)
    adapter_cache = Path(settings.lora_adapter_cache_dir or default_cache_dir() / "lora-adapters")
    adapters = local_lora_adapters(settings.lora_adapters, settings.s3, adapter_cache)

    def engine_with_adapters() -> LLMEngine:
        options = {**settings.engine_options, **({"enable_lora": True} if adapters else {})}
        engine = LLMEngine(settings.model, dtype=settings.dtype, device=settings.device, **options)
        for name, folder in adapters.items():
            engine.add_lora(name, folder)
        return engine

    loop = EngineLoop.build(engine_with_adapters, on_failure=stop_this_worker)
    engine = loop.engine
    if engine.tokenizer is None:
        loop.stop()
        raise ValueError(f"model {settings.model!r} has no tokenizer; the batch API needs one to read prompts")
    log.info("model %s loaded: %s, quantization %s", settings.model, engine.dtype,
             generation_metadata(engine).get("quantization", "none"))
    return loop


def generation_metadata(engine: LLMEngine) -> dict[str, Any]:
    """How the engine runs its model, as /v1/models shows it: its quantization (method, bits, group size, GGUF
    tensor types) when quantized."""
    quantization = model_quantization(engine.model_config, engine.config)
    return {} if quantization is None else {"quantization": quantization.describe()}


def build_pipeline(settings: Settings, loop: EngineLoop) -> Pipeline:
    engine = loop.engine
    assert engine.tokenizer is not None  # build_engine refuses a model without one
    store = ObjectStore(settings.s3)
    store.ensure_bucket()
    redis = Redis.from_url(settings.redis_url)
    stop_flags = StopFlags(redis, settings.redis_prefix)
    models = worker_models(
        settings, engine.model_name, engine.adapter_names, redis, generation_metadata(engine), engine.accepts_images
    )
    engine_handle = EngineHandle(
        loop=loop,
        tokenizer=engine.tokenizer,
        max_model_len=engine.max_model_len,
        model_name=models.default("generation"),
        served=models.names,
        admission_limits=engine.admission_limits,
    )
    embedder = LazyEmbedder(
        settings.embedding_model,
        lambda: Embedder(settings.embedding_model, dtype=settings.dtype, device=settings.device),
    )
    limits = settings.batch_limits()
    generation = GenerationKind(
        engine_handle,
        store,
        stop_flags,
        settings.chunk_size,
        limits,
        settings.image_limits(),
        AllowList.parse(settings.image_allowed_hosts),
    )
    kinds: dict[str, JobKind] = {
        CHAT_COMPLETIONS: generation,
        COMPLETIONS: generation,
        RESPONSES: generation,
        MESSAGES: generation,
        EMBEDDINGS: EmbeddingsKind(engine_handle, store, embedder, settings.chunk_size, limits),
        RAG_ENDPOINT: RagKind(settings=settings, store=store, stop_flags=stop_flags, engine=engine_handle, embedder=embedder),
    }
    return Pipeline(
        settings=settings,
        sessions=make_session_factory(make_engine(settings.database_url)),
        store=store,
        redis=redis,
        kinds=kinds,
        models=models,
        enqueue_validate=enqueue.validate,
        enqueue_run_chunk=enqueue.run_chunk,
        enqueue_finalize=enqueue.finalize,
        enqueue_webhook_deliveries=enqueue.webhook_deliveries,
    )


def worker_models(
    settings: Settings,
    engine_model_name: str,
    engine_adapters: list[str],
    redis: Redis,
    metadata: dict[str, Any] | None = None,
    accepts_images: bool = False,
) -> WorkerModels:
    """accepts_images: whether the engine reads images (a vision-language model); announced in /v1/models."""
    names = parse_names(settings.served_model_names) or [engine_model_name]
    return WorkerModels(
        process_models(names, settings.embedding_model, list(engine_adapters), metadata, accepts_images=accepts_images),
        ModelRegistry(redis, settings.redis_prefix, settings.model_announce_ttl_seconds),
        parse_aliases(settings.model_aliases),
    )


def stop_this_worker(failure: EngineFailed) -> None:
    """Ask this process for Celery's warm shutdown, as an operator's SIGTERM does: it stops fetching tasks, lets the
    running ones end (the dead engine fails them at once) and returns from `consume`."""
    log.critical(
        "the engine failed (%s): stopping this worker, which exits with status %d to be restarted",
        failure, ENGINE_FAILED_EXIT_CODE,
    )
    os.kill(os.getpid(), signal.SIGTERM)


def run_worker(
    settings: Settings, queues: list[str] | None = None, loglevel: str = "INFO", node_name: str | None = None
) -> int:
    """Consume `queues`; None: the control queue, the unrouted one and the queues of the models this worker serves.
    Returns the process's exit status."""
    cap_malloc_arenas()  # before the engine's and the pool's threads exist (jobs.run.memory)
    loop = build_engine(settings)  # before consuming: a model that cannot load fails the worker at start
    pipeline = build_pipeline(settings, loop)
    register_tasks(celery_app, pipeline)
    # Only now: its batches can be validated here. Re-announced while it lives; it lapses once the worker is gone.
    heartbeat = pipeline.models.registry.keep_announcing(pipeline.models.served)
    start_worker_telemetry(settings, loop)
    samples = SampleRecorder(
        Redis.from_url(settings.redis_url),
        settings.redis_prefix,
        node_name or f"{socket.gethostname()}:{os.getpid()}",
        [model.id for model in pipeline.models.served],
        lambda: loop.stats(timeout=ENGINE_STATS_TIMEOUT_SECONDS),
    )
    samples.start()
    try:
        return consume(
            loop, settings, queues or [CONTROL_QUEUE, UNROUTED_QUEUE, *pipeline.models.queues()], loglevel, node_name
        )
    finally:
        samples.stop()
        heartbeat.stop()


def consume(loop: EngineLoop, settings: Settings, queues: list[str], loglevel: str, node_name: str | None) -> int:
    """Run Celery's worker on the registered tasks until it shuts down. Returns the exit status:
    `ENGINE_FAILED_EXIT_CODE` if the engine failed meanwhile, else Celery's own."""
    status = celery_app.start(
        [
            # Celery's start-up banner is many lines of plain text, which would break a stream of JSON lines.
            *(["--quiet"] if settings.log_format == "json" else []),
            "worker",
            "--pool=threads",
            f"--concurrency={settings.effective_worker_concurrency + CONTROL_SLOTS}",
            "--queues=" + ",".join(queues),
            f"--loglevel={loglevel}",
            "--without-gossip",
            "--without-mingle",
            *([f"--hostname={node_name}"] if node_name else []),
        ]
    )
    return ENGINE_FAILED_EXIT_CODE if loop.failure is not None else status or 0
