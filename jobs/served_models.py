"""The models a deployment serves: what each worker announces, what `/v1/models` lists, what a line's `model` means.

A worker serves one generation model under the names `CONVEYOR_SERVED_MODEL_NAMES` gives it (default: the model's
own name), and its embedding model under that model's name. The first name is the model's id: the Celery queue its
chunks go to (`model_queue`) and the `model` of the batches it runs. Workers announce what they serve in Redis
(`ModelRegistry`), which the API lists and the validating worker consults. An announcement expires: each worker
re-announces its models every third of `CONVEYOR_MODEL_ANNOUNCE_TTL_SECONDS` (`Heartbeat`), so a model leaves
`/v1/models` at most that long after the last worker serving it stopped, however it stopped. OpenAI's names reach a
local model only through aliases an operator wrote down (`CONVEYOR_MODEL_ALIASES`), never by guessing.

A worker's LoRA adapters (`CONVEYOR_LORA_ADAPTERS`) are served models of their own, named by their adapter name, whose
`parent` is the base model's id: routed like any name (aliases included), listed with their parent. A batch runs one
base model: its lines may name the base or any of its adapters, and each output line names what answered it.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from redis import Redis
from redis.exceptions import RedisError, WatchError

log = logging.getLogger(__name__)

ModelKind = Literal["generation", "embedding"]
OWNED_BY = "conveyor"  # OpenAI's `owned_by`: who provides the model, here the deployment itself
UNROUTED_QUEUE = "gpu"  # chunks of jobs bound to no named model (RAG jobs without pages): any worker takes them


def model_queue(model_id: str) -> str:
    """The Celery queue of one served model's work."""
    return f"gpu.{model_id}"


def parse_names(raw: str) -> list[str]:
    """A comma-separated list of names, blanks dropped."""
    return [name.strip() for name in raw.split(",") if name.strip()]


def parse_aliases(raw: str) -> dict[str, str]:
    """`CONVEYOR_MODEL_ALIASES`: a JSON object {"gpt-4o-mini": "smollm2-135m-instruct"} or `alias=served` pairs
    separated by commas."""
    return parse_pairs(raw, "CONVEYOR_MODEL_ALIASES", "alias=served")


def parse_pairs(raw: str, setting: str, shape: str) -> dict[str, str]:
    """A name -> value setting: a JSON object of strings, or `name=value` pairs (`shape` names them in errors)
    separated by commas."""
    text = raw.strip()
    if not text:
        return {}
    if text.startswith("{"):
        pairs = json.loads(text)
        if not (isinstance(pairs, dict) and all(isinstance(v, str) for v in pairs.values())):
            raise ValueError(f"{setting} as JSON must map names to strings")
        return pairs
    split = [pair.split("=", 1) for pair in parse_names(text)]
    if any(len(pair) != 2 or not pair[0].strip() or not pair[1].strip() for pair in split):
        raise ValueError(f"{setting} must be '{shape},...' pairs or a JSON object, got {raw!r}")
    return {name.strip(): value.strip() for name, value in split}


def parse_lora_adapters(raw: str) -> dict[str, str]:
    """`CONVEYOR_LORA_ADAPTERS`: `name=folder` pairs (or a JSON object), or one directory whose every subfolder holding
    an adapter_config.json is an adapter named by the subfolder."""
    text = raw.strip()
    if text and "=" not in text and not text.startswith("{"):
        directory = Path(text)
        if not directory.is_dir():
            raise ValueError(f"CONVEYOR_LORA_ADAPTERS names no directory and no 'name=folder' pairs: {raw!r}")
        return {sub.name: str(sub) for sub in sorted(directory.iterdir()) if (sub / "adapter_config.json").is_file()}
    return parse_pairs(text, "CONVEYOR_LORA_ADAPTERS", "name=folder")


@dataclass(frozen=True)
class ServedModel:
    """One model as a worker announces it: its id, every name it answers to, and OpenAI's model fields."""

    id: str
    names: tuple[str, ...]
    kind: ModelKind
    created: int  # unix seconds the first worker serving it announced it
    parent: str | None = None  # a LoRA adapter's base model id; None: a base model
    # How it runs, for /v1/models' `metadata`: {"quantization": {"method", "bits", "group_size", ...}} when quantized
    metadata: dict[str, Any] = field(default_factory=dict)
    # Whether its lines may hold images (/v1/models' `input_modalities`); an image line for a model that does not fails
    # with `model_not_multimodal`. The engine's model says (`process_models`).
    accepts_images: bool = False


class ModelNames:
    """Resolves the name a line gives to the id of a model served, through the operator's aliases."""

    def __init__(self, served: list[ServedModel], aliases: dict[str, str]) -> None:
        self._models = {name: model for model in served for name in model.names}
        self._parents = {model.id: model.parent for model in served if model.parent is not None}
        self._multimodal = {model.id for model in served if model.accepts_images}
        self._aliases = aliases

    def resolve(self, name: str, kind: ModelKind) -> str | None:
        """The id of the `kind` model `name` means, or None when no such model is served."""
        model = self._models.get(self._aliases.get(name, name))
        return model.id if model is not None and model.kind == kind else None

    def base_of(self, model_id: str) -> str:
        """The base model a served id runs on: an adapter's parent, a base model itself."""
        return self._parents.get(model_id, model_id)

    def accepts_images(self, model_id: str) -> bool:
        """Whether the served model `model_id` (or, for an adapter, its base) reads images."""
        return self.base_of(model_id) in self._multimodal

    def adapter(self, model_id: str) -> str | None:
        """The LoRA adapter (the engine's name for it) a served id runs; None for a base model."""
        return model_id if model_id in self._parents else None


def image_models(served: list[ServedModel]) -> list[str]:
    """The ids of the served base generation models that read images, in id order: what may read a RAG job's pages."""
    return sorted(
        model.id for model in served if model.kind == "generation" and model.parent is None and model.accepts_images
    )


def listed_names(served: list[ServedModel], aliases: dict[str, str]) -> dict[str, ServedModel]:
    """Every name a line may put in `model`, to the model that answers it: ids, further names, aliases."""
    by_name = {name: model for model in served for name in model.names}
    by_alias = {alias: by_name[target] for alias, target in aliases.items() if target in by_name}
    return {**by_name, **by_alias}


DEFAULT_ANNOUNCE_TTL_SECONDS = 60.0


class ModelRegistry:
    """The deployment's served models in Redis: one key per model holding its announcement (JSON), expiring
    `ttl_seconds` after the latest announcement of any worker serving it, and a set of the ids, for listing (pruned
    of the expired ones as it is read)."""

    def __init__(self, redis: Redis, prefix: str, ttl_seconds: float = DEFAULT_ANNOUNCE_TTL_SECONDS) -> None:
        self._redis = redis
        self._ids_key = f"{prefix}served_model_ids"
        self._model_prefix = f"{prefix}served_model:"
        self.ttl_seconds = ttl_seconds

    def _key(self, model_id: str) -> str:
        return self._model_prefix + model_id

    def announce(self, models: list[ServedModel]) -> None:
        """Announce (or re-announce) `models` as served for the next `ttl_seconds`."""
        for model in models:
            # The first announcement's time stays: `created` is when the deployment started serving the model.
            known = self._redis.get(self._key(model.id))
            created = json.loads(known)["created"] if known else model.created
            announcement = json.dumps({**asdict(model), "created": created})
            with self._redis.pipeline() as both:  # MULTI: a listing never sees the key without its id, nor the reverse
                both.set(self._key(model.id), announcement, px=int(self.ttl_seconds * 1000))
                both.sadd(self._ids_key, model.id)
                both.execute()

    def served(self) -> list[ServedModel]:
        ids = sorted(member.decode() for member in self._redis.smembers(self._ids_key))
        announcements = self._redis.mget([self._key(model_id) for model_id in ids]) if ids else []
        models, expired = [], []
        for model_id, raw in zip(ids, announcements):
            if raw is None:
                expired.append(model_id)
                continue
            fields = json.loads(raw)
            models.append(ServedModel(
                fields["id"], tuple(fields["names"]), fields["kind"], fields["created"], fields.get("parent"),
                fields.get("metadata", {}), fields.get("accepts_images", False),
            ))
        if expired:
            self._forget(expired)
        return models

    def _forget(self, model_ids: list[str]) -> None:
        """Drop expired ids from the set, unless a worker announces one of them meanwhile (WATCH aborts then)."""
        keys = [self._key(model_id) for model_id in model_ids]
        with self._redis.pipeline() as prune:
            try:
                prune.watch(*keys)
                if prune.exists(*keys):
                    return  # announced again since it was read: the next listing sorts it out
                prune.multi()
                prune.srem(self._ids_key, *model_ids)
                prune.execute()
            except WatchError:
                pass

    def keep_announcing(self, models: list[ServedModel]) -> "Heartbeat":
        """Announce `models` now, then every third of the TTL on a thread, until the heartbeat is stopped."""
        self.announce(models)
        heartbeat = Heartbeat(self, models)
        heartbeat.start()
        return heartbeat


class Heartbeat:
    """Re-announces a worker's models every third of the registry's TTL, so that they stay listed while it lives.
    A Redis that cannot be reached is retried at the next beat: one missed beat does not expire anything."""

    def __init__(self, registry: ModelRegistry, models: list[ServedModel]) -> None:
        self._registry = registry
        self._models = models
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="model-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _beat(self) -> None:
        while not self._stop.wait(self._registry.ttl_seconds / 3):
            try:
                self._registry.announce(self._models)
            except RedisError as unreachable:
                log.warning("cannot re-announce the served models: %s", unreachable)


def process_models(
    generation_names: list[str],
    embedding_model: str,
    adapters: Sequence[str] = (),
    generation_metadata: dict[str, Any] | None = None,
    accepts_images: bool = False,
) -> list[ServedModel]:
    """What one process serves: its generation model under its names (with `generation_metadata`: how it runs, and
    `accepts_images`: whether it reads images), its LoRA adapters (by name, their parent the generation model), and
    its embedding model."""
    created = int(time.time())
    base = generation_names[0]
    return [
        ServedModel(
            base, tuple(generation_names), "generation", created, metadata=generation_metadata or {},
            accepts_images=accepts_images,
        ),
        *(
            ServedModel(adapter, (adapter,), "generation", created, parent=base, accepts_images=accepts_images)
            for adapter in adapters
        ),
        ServedModel(embedding_model, (embedding_model,), "embedding", created),
    ]


@dataclass(frozen=True)
class WorkerModels:
    """What one worker serves, beside the registry of what the whole deployment serves."""

    served: list[ServedModel]
    registry: ModelRegistry
    aliases: dict[str, str]

    @property
    def names(self) -> ModelNames:
        return ModelNames(self.served, self.aliases)

    def default(self, kind: ModelKind) -> str:
        return next(model.id for model in self.served if model.kind == kind)

    def queues(self) -> list[str]:
        return [model_queue(model.id) for model in self.served]

    def batch_model(self, first_line_model: str | None, kind: ModelKind) -> str:
        """A batch's model, from the name its first line gives: the served id it resolves to anywhere in the
        deployment, the name itself when nobody serves it, this worker's own model when the line names none."""
        if first_line_model is None:
            return self.default(kind)
        deployment = ModelNames([*self.served, *self.registry.served()], self.aliases)
        served = deployment.resolve(first_line_model, kind)
        return deployment.base_of(served) if served is not None else first_line_model

    def served_elsewhere(self, model_id: str) -> bool:
        """Whether another worker must read this model's batches: it serves the model and this one does not."""
        here = {model.id for model in self.served}
        return model_id not in here and any(model.id == model_id for model in self.registry.served())
