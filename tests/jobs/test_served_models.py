"""Served models: a line's `model` is answered only by a model served under that name or an explicit alias."""

from __future__ import annotations

import json
import secrets
import time

import pytest
from redis import Redis

from jobs.openai_format.validation import BatchLineValidator
from jobs.served_models import (
    ModelNames, ModelRegistry, WorkerModels, listed_names, parse_aliases, parse_lora_adapters, process_models,
)
from tests.jobs.test_openai_format import SERVED, WordTokenizer, chat_line, validator


def test_aliases_read_as_pairs_or_json_and_refuse_anything_else() -> None:
    assert parse_aliases("") == {}
    assert parse_aliases("gpt-4o-mini=smollm2, gpt-4o = smollm2") == {"gpt-4o-mini": "smollm2", "gpt-4o": "smollm2"}
    assert parse_aliases('{"gpt-4o-mini": "smollm2"}') == {"gpt-4o-mini": "smollm2"}
    with pytest.raises(ValueError, match="alias=served"):
        parse_aliases("gpt-4o-mini")


def test_lora_adapters_read_as_pairs_json_or_a_directory(tmp_path) -> None:
    assert parse_lora_adapters("") == {}
    assert parse_lora_adapters("tone=/a/tone, extract=/a/extract") == {"tone": "/a/tone", "extract": "/a/extract"}
    for name in ("tone", "extract"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_config.json").write_text("{}")
    (tmp_path / "notes").mkdir()  # no adapter_config.json: not an adapter
    assert parse_lora_adapters(str(tmp_path)) == {"extract": str(tmp_path / "extract"), "tone": str(tmp_path / "tone")}
    with pytest.raises(ValueError, match="names no directory"):
        parse_lora_adapters(str(tmp_path / "absent"))


def test_adapter_lines_run_on_their_base_model_and_name_their_adapter() -> None:
    """An adapter is a served model whose parent is the base: a batch of the base takes its lines (the adapter goes
    into the line's sampling parameters), a batch whose first line names it runs the base, another base's adapter
    is not this batch's."""
    models = ModelNames(process_models(["a"], "e", ["tone"]) + process_models(["b"], "e", ["other"]), {"ft:x": "tone"})
    lines = BatchLineValidator(WordTokenizer(), 64, models=models, batch_model="a")
    assert lines.validate(chat_line("1", model="tone")).sampling_params.adapter == "tone"  # type: ignore[union-attr]
    assert lines.validate(chat_line("2", model="ft:x")).sampling_params.adapter == "tone"  # type: ignore[union-attr]
    assert lines.validate(chat_line("3", model="a")).sampling_params.adapter is None  # type: ignore[union-attr]
    error = lines.validate(chat_line("4", model="other"))
    assert error.code == "model_not_found"  # type: ignore[union-attr]
    assert models.base_of("tone") == "a" and models.base_of("a") == "a"
    assert listed_names(process_models(["a"], "e", ["tone"]), {})["tone"].parent == "a"


def test_names_resolve_by_kind_through_aliases_only() -> None:
    assert SERVED.resolve("smollm2-135m-instruct", "generation") == "smollm2"
    assert SERVED.resolve("gpt-4o-mini", "generation") == "smollm2"
    assert SERVED.resolve("gpt-4o", "generation") is None  # no implicit mapping
    assert SERVED.resolve("smollm2", "embedding") is None  # a generation model does not embed
    assert SERVED.resolve("text-embedding-3-small", "embedding") == "all-minilm-l6-v2"


@pytest.mark.parametrize("model", ["llama-3-70b-instruct", "all-minilm-l6-v2"])
def test_a_line_naming_a_model_not_served_fails_with_model_not_found(model: str) -> None:
    error = validator().validate(chat_line(model=model))
    assert error.code == "model_not_found" and model in error.message  # type: ignore[union-attr]


def test_a_batch_runs_the_one_model_its_first_line_names() -> None:
    models = ModelNames(process_models(["a"], "e") + process_models(["b"], "e"), {})
    lines = BatchLineValidator(WordTokenizer(), 64, models=models, batch_model="a")
    assert lines.validate(chat_line("1", model="a")).custom_id == "1"
    assert lines.validate(chat_line("2")).custom_id == "2"  # no model: the batch's
    error = lines.validate(chat_line("3", model="b"))
    assert error.code == "model_not_found" and "a batch runs one model" in error.message  # type: ignore[union-attr]


def test_the_registry_lists_every_worker_model_and_routes_validation_to_its_workers() -> None:
    redis = Redis.from_url("redis://127.0.0.1:6379/0")
    prefix = f"test-{secrets.token_hex(4)}:"
    try:
        registry = ModelRegistry(redis, prefix)
        here = WorkerModels(process_models(["smollm2"], "all-minilm-l6-v2"), registry, {"gpt-4o-mini": "tiny"})
        registry.announce(here.served)
        registry.announce(process_models(["tiny", "tiny-llama"], "all-minilm-l6-v2"))
        assert [model.id for model in registry.served()] == ["all-minilm-l6-v2", "smollm2", "tiny"]
        assert here.batch_model("gpt-4o-mini", "generation") == "tiny"
        assert here.batch_model("tiny-llama", "generation") == "tiny"
        assert here.batch_model("unknown", "generation") == "unknown"
        assert here.batch_model(None, "generation") == "smollm2"
        assert here.served_elsewhere("tiny") and not here.served_elsewhere("smollm2")
        assert not here.served_elsewhere("unknown")
        assert here.queues() == ["gpu.smollm2", "gpu.all-minilm-l6-v2"]
        names = listed_names(registry.served(), {"gpt-4o-mini": "tiny", "dangling": "nobody"})
        assert sorted(names) == ["all-minilm-l6-v2", "gpt-4o-mini", "smollm2", "tiny", "tiny-llama"]
        assert json.loads(redis.get(f"{prefix}served_model:tiny"))["kind"] == "generation"
    finally:
        redis.delete(*redis.keys(f"{prefix}*") or [f"{prefix}none"])


def test_a_quantized_model_shows_how_it_runs_in_v1_models() -> None:
    from api.models import ModelObject
    from engine.quantization.config import weight_only_quantization

    redis = Redis.from_url("redis://127.0.0.1:6379/0")
    prefix = f"test-{secrets.token_hex(4)}:"
    quantization = {"quantization": weight_only_quantization("int4", 64).describe()}
    try:
        registry = ModelRegistry(redis, prefix)
        registry.announce(process_models(["tiny-int4"], "all-minilm-l6-v2", generation_metadata=quantization))
        served = {model.id: model for model in registry.served()}
        listed = ModelObject.of("tiny-int4", served["tiny-int4"]).model_dump()
        assert listed["metadata"] == {"quantization": {"method": "int4", "bits": 4, "group_size": 64}}
        assert ModelObject.of("all-minilm-l6-v2", served["all-minilm-l6-v2"]).model_dump()["metadata"] == {}
    finally:
        redis.delete(*redis.keys(f"{prefix}*") or [f"{prefix}none"])


def test_v1_models_says_which_models_read_images() -> None:
    """The flag travels through the registry; an adapter reads what its base reads. Every model served today reads
    text only (the engine's model sets `accepts_images`)."""
    from api.models import ModelObject

    redis = Redis.from_url("redis://127.0.0.1:6379/0")
    prefix = f"test-{secrets.token_hex(4)}:"
    try:
        registry = ModelRegistry(redis, prefix)
        registry.announce(process_models(["vlm"], "all-minilm-l6-v2", ["tone"], accepts_images=True))
        registry.announce(process_models(["llm"], "all-minilm-l6-v2"))
        served = {model.id: model for model in registry.served()}
        modalities = {name: ModelObject.of(name, model).input_modalities for name, model in served.items()}
        assert modalities == {
            "vlm": ["text", "image"], "tone": ["text", "image"], "llm": ["text"], "all-minilm-l6-v2": ["text"]
        }
        names = ModelNames(list(served.values()), {})
        assert names.accepts_images("tone") and names.accepts_images("vlm") and not names.accepts_images("llm")
    finally:
        redis.delete(*redis.keys(f"{prefix}*") or [f"{prefix}none"])


def test_a_model_leaves_the_registry_once_no_worker_re_announces_it() -> None:
    redis = Redis.from_url("redis://127.0.0.1:6379/0")
    prefix = f"test-{secrets.token_hex(4)}:"
    try:
        # Long enough that a beat delayed by a loaded machine (up to 0.5 s) does not let "stays" lapse.
        registry = ModelRegistry(redis, prefix, ttl_seconds=0.8)
        stays = process_models(["stays"], "embedder")
        heartbeat = registry.keep_announcing(stays)  # re-announces every 0.27 s
        try:
            registry.announce(process_models(["stops"], "embedder"))  # a worker that stops right away
            created = {model.id: model.created for model in registry.served()}
            assert sorted(created) == ["embedder", "stays", "stops"]
            time.sleep(1.6)  # two TTLs: "stops" has lapsed, the heartbeat kept the others
            assert {model.id: model.created for model in registry.served()} == {
                "embedder": created["embedder"], "stays": created["stays"],  # re-announcing keeps `created`
            }
            assert not redis.sismember(f"{prefix}served_model_ids", "stops")  # pruned from the listing's set
        finally:
            heartbeat.stop()
        time.sleep(0.9)  # the last worker stopped: everything lapses within the TTL
        assert registry.served() == []
    finally:
        redis.delete(*redis.keys(f"{prefix}*") or [f"{prefix}none"])
