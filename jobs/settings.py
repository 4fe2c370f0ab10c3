"""Service configuration, read once from environment variables (the README's table is generated from this class).

Every process of the service (API, worker, migrations) builds one `Settings` from its environment, so
one `.env` file or one set of container variables configures the whole stack. S3 credentials are
boto3's own: `AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY` (or any other source boto3 knows).

`Settings(...)` holds exactly what it is given (tests and `conveyor up` build settings for other processes, which
read them back from the variables `to_env` writes); `Settings.from_env()` reads the environment through
pydantic-settings: `CONVEYOR_<FIELD>`, `CONVEYOR_S3_<FIELD>` for the S3 fields, and `CONVEYOR_ENGINE_<FIELD>` for
any `EngineConfig` field. A variable that does not parse fails with its name in the message.
"""

from __future__ import annotations

import dataclasses
import math
import os
import typing
from collections.abc import Mapping
from typing import Annotated, Any, TypeVar

from pydantic import BeforeValidator, Field, TypeAdapter, ValidationError, model_validator
from pydantic.dataclasses import dataclass
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails
from pydantic_settings import BaseSettings, EnvSettingsSource, PydanticBaseSettingsSource, SettingsConfigDict

from engine.config import EngineConfig
from engine.model_registry import DEFAULT_EMBEDDING_MODEL, DEFAULT_MODEL
from jobs.batch_limits import BatchLimits, MessageBatchLimits
from jobs.images.inputs import ImageLimits
from jobs.served_models import DEFAULT_ANNOUNCE_TTL_SECONDS, parse_aliases

ENV_PREFIX = "CONVEYOR_"
# Longest input line validated; a longer one is that line's error, never read whole. A million-token context is
# ~4 MB of text, and JSON's escapes at most triple that: no request an engine could run is longer.
DEFAULT_MAX_LINE_BYTES = 16 * 1024 * 1024
S3_ENV_PREFIX = "CONVEYOR_S3_"
ENGINE_ENV_PREFIX = "CONVEYOR_ENGINE_"  # + any EngineConfig field in upper case, e.g. CONVEYOR_ENGINE_MAX_NUM_SEQS
LOG_FORMATS = ("json", "text")
SettingsT = TypeVar("SettingsT", "Settings", "S3Settings")


def _blank_is_none(value: object) -> object:
    """An optional setting's variable set to "" or "none" means unset."""
    return None if isinstance(value, str) and value.strip().lower() in ("", "none") else value


def _int_in_any_notation(value: object) -> object:
    """Integers may be written 2e8."""
    if isinstance(value, str) and "e" in value.lower():
        try:
            return int(float(value))
        except ValueError:  # not a number at all: pydantic says so
            return value
    return value


# Before-validators run last-listed first: list Optional after Integer.
Optional = BeforeValidator(_blank_is_none)
Integer = BeforeValidator(_int_in_any_notation)


@dataclass(frozen=True)
class S3Settings:
    endpoint_url: Annotated[str | None, Optional] = Field(
        None, description="S3-compatible endpoint, e.g. `http://127.0.0.1:8333`; unset: AWS itself"
    )
    bucket: str = Field("conveyor", description="bucket (created if missing)")
    prefix: str = Field("", description="prefix of every object key, e.g. `prod/`")
    region: str = Field("us-east-1", description="signing region")


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, frozen=True, extra="forbid")

    database_url: str = Field(
        "postgresql+psycopg://postgres@127.0.0.1:5432/conveyor",
        description="PostgreSQL (SQLAlchemy URL, psycopg 3 driver)",
    )
    redis_url: str = Field("redis://127.0.0.1:6379/0", description="Redis: the Celery broker and chunk leases")
    redis_prefix: str = Field(
        "conveyor:", description="prefix of every Redis key the service writes (deployments can share a server)"
    )
    s3: S3Settings = Field(default_factory=S3Settings)
    model: str = Field(DEFAULT_MODEL, description="model name, `.gguf` file or Hugging Face folder")
    embedding_model: str = Field(
        DEFAULT_EMBEDDING_MODEL,
        description="what answers `/v1/embeddings` batches and embeds RAG passages: the bundled model or a "
        "sentence-transformers folder (same dtype and device as the model), loaded on a worker's first use",
    )
    served_model_names: str = Field(
        "",
        description="comma-separated names the worker's model answers to in a line's `model`; the first is its id "
        "(its queue, the `model` of the batches it runs); empty: the model's own name, e.g. `smollm2-135m-instruct`",
    )
    lora_adapters: str = Field(
        "",
        description="LoRA adapters the worker serves on its model: `name=folder,...` (PEFT folders), a JSON object, or "
        "a directory whose subfolders are adapters named by the subfolder; each a served model named `name` "
        "(routable, aliasable, listed with its `parent`), loaded once at start. A folder or the directory may be "
        "`s3://bucket/prefix/` (the service's S3 endpoint and credentials), downloaded at start into "
        "`CONVEYOR_LORA_ADAPTER_CACHE_DIR`",
    )
    lora_adapter_cache_dir: str = Field(
        "",
        description="where a worker downloads the `s3://` adapters of `CONVEYOR_LORA_ADAPTERS` at start (files "
        "already there with the listed size are kept); empty: `lora-adapters` in `CONVEYOR_CACHE_DIR` "
        "(`~/.cache/conveyor`)",
    )
    model_announce_ttl_seconds: float = Field(
        DEFAULT_ANNOUNCE_TTL_SECONDS,
        gt=0,
        description="seconds a served model stays listed (`/v1/models`, routing) after the last announcement of a "
        "worker serving it; workers re-announce every third of that",
    )
    model_aliases: str = Field(
        "",
        description="aliases from other (e.g. OpenAI) names to served ones: `gpt-4o-mini=smollm2-135m-instruct,...` "
        "or a JSON object; empty: none, and a line naming a model nobody serves fails with `model_not_found`",
    )
    dtype: str = Field(
        "auto", description="`auto` (bf16 on GPUs and CPUs with fast bf16, else float32), `bfloat16`, `float32`"
    )
    device: Annotated[str | None, Optional] = Field(None, description="`cpu` or `cuda`; unset: cuda when available")
    engine_options: Mapping[str, Any] = Field(default_factory=dict)  # EngineConfig fields overriding its defaults
    chunk_size: Annotated[int, Integer] = Field(100, description="requests per `run_chunk` task")
    rag_documents_per_chunk: Annotated[int, Integer] = Field(
        16, description="documents per `run_chunk` task of a RAG job"
    )
    worker_concurrency: Annotated[int | None, Integer, Optional] = Field(
        None,
        description="run_chunk tasks one worker runs at once; unset: enough for twice `max_num_seqs` requests",
    )
    max_upload_bytes: Annotated[int, Integer] = Field(
        200 * 1000 * 1000, description="bytes: the largest upload `POST /v1/files` accepts (413 above)"
    )
    max_line_bytes: Annotated[int, Integer] = Field(
        DEFAULT_MAX_LINE_BYTES,
        description="bytes: the longest batch input line validated (16 MiB); a longer one is its line's "
        "`request_too_large` error, never read whole",
    )
    max_batch_requests: Annotated[int, Integer] = Field(
        50_000,
        description="requests: the most lines one `/v1/batches` input file may hold (OpenAI's limit); a file with "
        "more fails its batch at validation with `too_many_tasks`",
    )
    max_batch_input_bytes: Annotated[int, Integer] = Field(
        209_715_200,
        description="bytes: the largest input file `POST /v1/batches` takes (OpenAI's 200 MB: 209,715,200 bytes); a "
        "larger one is refused at creation (400)",
    )
    max_batch_embedding_inputs: Annotated[int, Integer] = Field(
        50_000,
        description="texts: the most embedding inputs across all lines of one `/v1/embeddings` batch (OpenAI's limit); "
        "more fails the batch at validation with `too_many_tasks`",
    )
    max_message_batch_requests: Annotated[int, Integer] = Field(
        100_000,
        description="requests: the most one Anthropic Message Batch may hold (Anthropic's limit); more is refused at "
        "creation (400)",
    )
    max_message_batch_bytes: Annotated[int, Integer] = Field(
        256_000_000,
        description="bytes: the largest a Message Batch's requests may be, as JSONL lines (Anthropic's 256 MB); "
        "larger is refused at creation (413)",
    )
    max_form_field_bytes: Annotated[int, Integer] = Field(
        4096, description="bytes: one text field's value in a `POST /v1/files` form (`purpose`); 400 above"
    )
    max_form_part_header_bytes: Annotated[int, Integer] = Field(
        8192, description="bytes: one part's headers in a `POST /v1/files` form (file name, type); 400 above"
    )
    task_visibility_timeout: float = Field(
        600.0, description="seconds before an unacknowledged task (a dead worker's) is delivered again"
    )
    chunk_lease_seconds: float = Field(
        60.0, description="seconds: a running chunk's Redis lease, renewed while it runs, lapses when its worker dies"
    )
    finalize_timeout_seconds: float = Field(
        3600.0,
        description="seconds a batch may stay `finalizing` (or `cancelling`) before the recovery sweep fails it with "
        "`finalize_failed`; the results its chunks wrote are kept and the error says where. Finalize copies objects "
        "inside the store, minutes for the largest batch: an hour rides out an object-store outage",
    )
    beat_interval_seconds: float = Field(
        10.0, description="seconds between beat's periodic sweeps (schedules, expiry, webhook retries)"
    )
    completion_window_seconds: Annotated[float | None, Optional] = Field(
        None,
        description="seconds a new batch may run before it expires, whatever its `completion_window`; "
        "unset: the window's own length (24 h)",
    )
    webhook_allowed_hosts: str = Field(
        "",
        description="comma-separated hostnames, IPs and CIDRs that may receive webhooks although they are not "
        "public (e.g. `hooks.internal,10.1.0.0/16`)",
    )
    webhook_retry_scale: float = Field(
        1.0, description="multiplies the webhook retry delays (5 s, 5 min, 30 min, 2 h, 5 h, 10 h, 10 h)"
    )
    image_max_bytes: Annotated[int, Integer] = Field(
        ImageLimits.max_bytes, description="bytes of one image in a batch line (encoded); past it the line fails"
    )
    image_max_pixels: Annotated[int, Integer] = Field(
        ImageLimits.max_pixels,
        description="width x height of one image, read from its header before decoding (a decompression bomb fails "
        "its line)",
    )
    image_max_aspect_ratio: float = Field(
        ImageLimits.max_aspect_ratio, description="an image's long side over its short side (a 1 x 100000 strip fails)"
    )
    image_max_per_line: Annotated[int, Integer] = Field(
        ImageLimits.max_per_line, description="image parts in one batch line (`too_many_images` past it)"
    )
    image_fetch_timeout_seconds: float = Field(
        ImageLimits.fetch_timeout_seconds,
        description="seconds one image URL may take, connection, redirects and body together",
    )
    image_fetch_threads: Annotated[int, Integer] = Field(
        ImageLimits.fetch_threads, description="images fetched and decoded at once per running chunk"
    )
    image_lines_in_flight: Annotated[int, Integer] = Field(
        ImageLimits.lines_in_flight,
        description="image lines of one running chunk fetched, decoded or in the engine at once (each holds its "
        "images' pixels, ~1.35 MB an image for LLaVA-1.5, 24 bytes per resized pixel for Qwen2.5-VL: ~24 MB at 1000 x "
        "1000 px); the chunk's other image lines wait their turn",
    )
    image_allowed_hosts: str = Field(
        "",
        description="comma-separated hostnames, IPs and CIDRs that image URLs may name although they are not "
        "public (as `CONVEYOR_WEBHOOK_ALLOWED_HOSTS`)",
    )
    api_host: str = Field("127.0.0.1", description="where `conveyor api` listens (`--host` overrides)")
    api_port: Annotated[int, Integer] = Field(8000, description="the port `conveyor api` listens on (`--port` overrides)")
    worker_metrics_host: str = Field("127.0.0.1", description="where a worker serves `/metrics` and `/healthz`")
    worker_metrics_port: Annotated[int, Integer] = Field(
        9464, description="the port of a worker's `/metrics` and `/healthz`; 0: none (one port per worker on a host)"
    )
    worker_devices: str = Field(
        "",
        description="comma-separated devices split into groups of the engine's `tensor_parallel_size`, one engine "
        "(worker process) per group: CUDA indices (`0,1,2,3,4,5,6,7`) or `cpu` entries; group i serves metrics on "
        "`worker_metrics_port` + i; empty: one engine on `device`",
    )
    log_format: str = Field(
        "json",
        description="`json` (one object per line, with `batch_id` / `chunk_index` while a task runs) or `text`",
    )

    @model_validator(mode="after")
    def _check(self) -> Settings:
        if self.log_format not in LOG_FORMATS:
            raise ValueError(f"CONVEYOR_LOG_FORMAT must be one of {', '.join(LOG_FORMATS)}, got {self.log_format!r}")
        if self.chunk_size < 1:
            raise ValueError(f"CONVEYOR_CHUNK_SIZE must be >= 1, got {self.chunk_size}")
        if self.rag_documents_per_chunk < 1:
            raise ValueError(f"CONVEYOR_RAG_DOCUMENTS_PER_CHUNK must be >= 1, got {self.rag_documents_per_chunk}")
        if self.finalize_timeout_seconds <= 0:
            raise ValueError(f"CONVEYOR_FINALIZE_TIMEOUT_SECONDS must be > 0, got {self.finalize_timeout_seconds}")
        for name in (
            "max_upload_bytes",
            "max_line_bytes",
            "max_batch_requests",
            "max_batch_input_bytes",
            "max_batch_embedding_inputs",
            "max_message_batch_requests",
            "max_message_batch_bytes",
            "max_form_field_bytes",
            "max_form_part_header_bytes",
            "image_max_bytes",
            "image_max_pixels",
            "image_max_per_line",
            "image_fetch_threads",
            "image_lines_in_flight",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"CONVEYOR_{name.upper()} must be >= 1, got {getattr(self, name)}")
        for name in ("image_max_aspect_ratio", "image_fetch_timeout_seconds"):
            if getattr(self, name) <= 0:
                raise ValueError(f"CONVEYOR_{name.upper()} must be > 0, got {getattr(self, name)}")
        parse_aliases(self.model_aliases)  # a malformed value fails every process at start, not a batch later
        unknown = set(self.engine_options) - {f.name for f in dataclasses.fields(EngineConfig)}
        if unknown:
            raise ValueError(f"unknown engine options {sorted(unknown)}")
        return self

    def batch_limits(self) -> BatchLimits:
        """OpenAI's limits on one batch, as configured."""
        return BatchLimits(self.max_batch_requests, self.max_batch_input_bytes, self.max_batch_embedding_inputs)

    def image_limits(self) -> ImageLimits:
        """What one image, and one line's images, may cost, as configured."""
        return ImageLimits(
            max_bytes=self.image_max_bytes,
            max_pixels=self.image_max_pixels,
            max_aspect_ratio=self.image_max_aspect_ratio,
            max_per_line=self.image_max_per_line,
            fetch_timeout_seconds=self.image_fetch_timeout_seconds,
            fetch_threads=self.image_fetch_threads,
            lines_in_flight=self.image_lines_in_flight,
        )

    def message_batch_limits(self) -> MessageBatchLimits:
        """Anthropic's limits on one Message Batch, as configured."""
        return MessageBatchLimits(self.max_message_batch_requests, self.max_message_batch_bytes)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings,)  # the environment only through from_env

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
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if environ is None else environ
        values = _EnvironSource(cls, env)()
        values["engine_options"] = _engine_options(env)
        try:
            return cls(**values)
        except ValidationError as invalid:
            raise ValueError("; ".join(_describe(error) for error in invalid.errors())) from None

    def to_env(self) -> dict[str, str]:
        """The variables that reproduce these settings in another process (the inverse of `from_env`)."""
        env: dict[str, str] = {}
        for name in type(self).model_fields:
            value = getattr(self, name)
            if name == "s3":
                env.update({S3_ENV_PREFIX + k.upper(): str(v) for k, v in dataclasses.asdict(value).items() if v is not None})
            elif name == "engine_options":
                env.update({ENGINE_ENV_PREFIX + k.upper(): str(v) for k, v in value.items()})
            elif value is not None:
                env[ENV_PREFIX + name.upper()] = str(value)
        return env


def replace(settings: SettingsT, **changes: Any) -> SettingsT:
    """`settings` (a `Settings` or `S3Settings`) with some fields changed, checked again."""
    if isinstance(settings, S3Settings):
        return dataclasses.replace(settings, **changes)
    return type(settings)(**{**dict(settings), **changes})


class _EnvironSource(EnvSettingsSource):
    """pydantic-settings' environment source over a given mapping; the S3 fields as CONVEYOR_S3_<FIELD>."""

    def __init__(self, settings_cls: type[BaseSettings], environ: Mapping[str, str]) -> None:
        self._environ = environ
        super().__init__(settings_cls, env_nested_delimiter="_", env_nested_max_split=1)

    def _load_env_vars(self) -> Mapping[str, str | None]:
        return {name.lower(): value for name, value in self._environ.items()}  # names are case-insensitive

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        if field_name == "engine_options":  # read by _engine_options, under its own prefix
            return None, field_name, False
        return super().get_field_value(field, field_name)


def _engine_options(env: Mapping[str, str]) -> dict[str, Any]:
    """The EngineConfig fields set by CONVEYOR_ENGINE_<FIELD>, each parsed as its field's type."""
    options: dict[str, Any] = {}
    for name, annotation in typing.get_type_hints(EngineConfig).items():
        variable = ENGINE_ENV_PREFIX + name.upper()
        if variable not in env:
            continue
        try:
            options[name] = TypeAdapter(annotation).validate_python(_blank_is_none(env[variable]))
        except ValidationError as invalid:
            raise ValueError(_describe(invalid.errors()[0], variable)) from None
    return options


def _describe(error: ErrorDetails, variable: str | None = None) -> str:
    location = [str(part) for part in error["loc"]]
    if variable is None and location:
        variable = ENV_PREFIX + "_".join(location).upper()
    message = "expected true or false" if error["type"] == "bool_parsing" else error["msg"]
    if error["type"] == "value_error":  # our own checks name their variable
        return str(error["ctx"]["error"]) if "ctx" in error else message
    return f"environment variable {variable}: {message}, got {error['input']!r}"
