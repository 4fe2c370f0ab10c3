"""Service configuration, read once from environment variables (the README's table lists them all).

Every process of the service (API, worker, migrations) builds one `Settings` from its environment, so
one `.env` file or one set of container variables configures the whole stack. S3 credentials are
boto3's own: `AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY` (or any other source boto3 knows).
"""

from __future__ import annotations

import dataclasses
import math
import os
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from engine.config import EngineConfig
from engine.model_registry import DEFAULT_EMBEDDING_MODEL, DEFAULT_MODEL

ENV_PREFIX = "CONVEYOR_"
LOG_FORMATS = ("json", "text")
ENGINE_ENV_PREFIX = "CONVEYOR_ENGINE_"  # + any EngineConfig field in upper case, e.g. CONVEYOR_ENGINE_MAX_NUM_SEQS


@dataclass(frozen=True)
class S3Settings:
    endpoint_url: str | None = None  # None: AWS itself; e.g. http://127.0.0.1:8333 for SeaweedFS or MinIO
    bucket: str = "conveyor"
    prefix: str = ""  # prepended to every object key, e.g. "prod/"
    region: str = "us-east-1"


@dataclass(frozen=True)
class Settings:
    database_url: str = "postgresql+psycopg://postgres@127.0.0.1:5432/conveyor"
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_prefix: str = "conveyor:"  # prefix of every Redis key the service writes (Celery queues included)
    s3: S3Settings = field(default_factory=S3Settings)
    model: str = DEFAULT_MODEL  # model name, .gguf file or Hugging Face folder, as `conveyor run --model`
    # What answers /v1/embeddings batches: the bundled model's name or a sentence-transformers folder; loaded by a
    # worker on its first embeddings chunk, with the same dtype and device as the model.
    embedding_model: str = DEFAULT_EMBEDDING_MODEL
    dtype: str = "auto"
    device: str | None = None  # None: cuda when available, else cpu
    engine_options: Mapping[str, Any] = field(default_factory=dict)  # EngineConfig fields overriding defaults
    chunk_size: int = 100  # requests per run_chunk task
    rag_documents_per_chunk: int = 16  # documents per run_chunk task of a RAG job
    worker_concurrency: int | None = None  # run_chunk tasks one worker runs at once; None: enough to fill the batch
    max_upload_bytes: int = 200 * 1000 * 1000  # largest file POST /v1/files accepts (200 MB)
    task_visibility_timeout: float = 600.0  # seconds before Redis hands an unacknowledged task to another worker
    chunk_lease_seconds: float = 60.0  # a running chunk's claim; renewed while it runs, lapses when its worker dies
    beat_interval_seconds: float = 10.0  # how often beat runs the periodic sweeps (schedules, expiry, webhook retries)
    # How long a new batch may run before it expires, whatever its completion_window says; None: the window's own
    # length (24h). For tests and deployments that want a shorter deadline.
    completion_window_seconds: float | None = None
    # Comma-separated hostnames, IPs and CIDRs that may receive webhooks although they are not public addresses.
    webhook_allowed_hosts: str = ""
    webhook_retry_scale: float = 1.0  # multiplies the webhook retry delays (5 s ... 10 h); tests use a small fraction
    api_host: str = "127.0.0.1"
    api_port: int = 8000
    worker_metrics_host: str = "127.0.0.1"  # where a worker serves /metrics and /healthz
    worker_metrics_port: int = 9464  # 0: no metrics server (several workers on one host need one port each)
    log_format: str = "json"  # "json": one JSON object per line, with batch_id / chunk_index while a task runs; "text"

    def __post_init__(self) -> None:
        if self.log_format not in LOG_FORMATS:
            raise ValueError(f"CONVEYOR_LOG_FORMAT must be one of {', '.join(LOG_FORMATS)}, got {self.log_format!r}")
        if self.chunk_size < 1:
            raise ValueError(f"CONVEYOR_CHUNK_SIZE must be >= 1, got {self.chunk_size}")
        if self.rag_documents_per_chunk < 1:
            raise ValueError(f"CONVEYOR_RAG_DOCUMENTS_PER_CHUNK must be >= 1, got {self.rag_documents_per_chunk}")
        if self.max_upload_bytes < 1:
            raise ValueError(f"CONVEYOR_MAX_UPLOAD_BYTES must be >= 1, got {self.max_upload_bytes}")
        unknown = set(self.engine_options) - {f.name for f in dataclasses.fields(EngineConfig)}
        if unknown:
            raise ValueError(f"unknown engine options {sorted(unknown)}")

    @property
    def engine_config(self) -> EngineConfig:
        return EngineConfig(**self.engine_options)

    @property
    def effective_worker_concurrency(self) -> int:
        """Enough chunks in flight to hold twice the running batch, so the engine's waiting queue never empties
        while a finished chunk's thread picks up the next one."""
        if self.worker_concurrency is not None:
            return self.worker_concurrency
        return max(2, math.ceil(2 * self.engine_config.max_num_seqs / self.chunk_size))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "Settings":
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            name = ENV_PREFIX + f.name.upper()
            if f.name in ("s3", "engine_options") or name not in env:
                continue
            values[f.name] = _parse(env[name], _field_types(cls)[f.name], name)
        s3_values = {
            f.name: _parse(env[ENV_PREFIX + "S3_" + f.name.upper()], _field_types(S3Settings)[f.name], f.name)
            for f in dataclasses.fields(S3Settings)
            if ENV_PREFIX + "S3_" + f.name.upper() in env
        }
        engine_types = _field_types(EngineConfig)
        engine_options = {
            name: _parse(env[ENGINE_ENV_PREFIX + name.upper()], engine_types[name], ENGINE_ENV_PREFIX + name.upper())
            for name in engine_types
            if ENGINE_ENV_PREFIX + name.upper() in env
        }
        return cls(**values, s3=S3Settings(**s3_values), engine_options=engine_options)

    def to_env(self) -> dict[str, str]:
        """The variables that reproduce these settings in another process (the inverse of `from_env`)."""
        env: dict[str, str] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "s3":
                env.update(
                    {
                        ENV_PREFIX + "S3_" + k.upper(): str(v)
                        for k, v in dataclasses.asdict(value).items()
                        if v is not None
                    }
                )
            elif f.name == "engine_options":
                env.update({ENGINE_ENV_PREFIX + k.upper(): str(v) for k, v in value.items()})
            elif value is not None:
                env[ENV_PREFIX + f.name.upper()] = str(value)
        return env


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _parse(raw: str, annotation: Any, name: str) -> Any:
    kinds = [arg for arg in typing.get_args(annotation) if arg is not type(None)] or [annotation]
    if type(None) in typing.get_args(annotation) and raw.strip().lower() in ("", "none"):
        return None
    kind = kinds[0]
    try:
        if kind is bool:
            if raw.strip().lower() not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
                raise ValueError(f"expected true or false, got {raw!r}")
            return raw.strip().lower() in ("1", "true", "yes", "on")
        if kind is int:
            return int(float(raw)) if "e" in raw.lower() else int(raw)
        if kind is float:
            return float(raw)
        return raw
    except ValueError as invalid:
        raise ValueError(f"environment variable {name}: {invalid}") from None
