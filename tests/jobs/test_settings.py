"""Configuration from environment variables."""

from __future__ import annotations

import pytest

from jobs.settings import S3Settings, Settings
from jobs.settings_doc import README, readme_with_table


def test_defaults_need_no_environment() -> None:
    settings = Settings.from_env({})
    assert settings == Settings()
    assert settings.max_upload_bytes == 200_000_000 and settings.chunk_size == 100


def test_every_field_reads_from_its_variable() -> None:
    settings = Settings.from_env(
        {
            "CONVEYOR_DATABASE_URL": "postgresql+psycopg://db/x",
            "CONVEYOR_CHUNK_SIZE": "32",
            "CONVEYOR_TASK_VISIBILITY_TIMEOUT": "12.5",
            "CONVEYOR_DEVICE": "cpu",
            "CONVEYOR_S3_ENDPOINT_URL": "http://127.0.0.1:8333",
            "CONVEYOR_S3_BUCKET": "b",
            "CONVEYOR_ENGINE_MAX_NUM_SEQS": "64",
            "CONVEYOR_ENGINE_ENABLE_PREFIX_CACHING": "false",
            "CONVEYOR_ENGINE_PREEMPTION_MODE": "recompute",
            "CONVEYOR_ENGINE_QUANTIZED_ACTIVATIONS": "int8",
        }
    )
    assert settings.database_url == "postgresql+psycopg://db/x"
    assert settings.chunk_size == 32 and settings.task_visibility_timeout == 12.5 and settings.device == "cpu"
    assert settings.s3 == S3Settings(endpoint_url="http://127.0.0.1:8333", bucket="b")
    assert settings.engine_config.max_num_seqs == 64
    assert settings.engine_config.enable_prefix_caching is False
    assert settings.engine_config.preemption_mode == "recompute"
    assert settings.engine_config.quantized_activations == "int8"


def test_to_env_round_trips() -> None:
    settings = Settings(
        redis_prefix="p:",
        s3=S3Settings(endpoint_url="http://s3", prefix="run/"),
        worker_concurrency=3,
        engine_options={"max_num_seqs": 8, "enable_chunked_prefill": False},
    )
    assert Settings.from_env(settings.to_env()) == settings


def test_worker_concurrency_fills_twice_the_running_batch() -> None:
    assert Settings(chunk_size=100).effective_worker_concurrency == 6  # 2 x 256 sequences / 100 per chunk
    assert Settings(chunk_size=1000).effective_worker_concurrency == 2
    assert Settings(worker_concurrency=9).effective_worker_concurrency == 9


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("CONVEYOR_CHUNK_SIZE", "many", "CONVEYOR_CHUNK_SIZE"),
        ("CONVEYOR_CHUNK_SIZE", "0", "CONVEYOR_CHUNK_SIZE must be >= 1"),
        ("CONVEYOR_ENGINE_ENABLE_PREFIX_CACHING", "maybe", "expected true or false"),
        ("CONVEYOR_ENGINE_QUANTIZED_ACTIVATIONS", "int4", "Input should be 'int8'"),
    ],
)
def test_bad_values_name_their_variable(variable: str, value: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Settings.from_env({variable: value})


def test_settings_built_in_code_read_no_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONVEYOR_CHUNK_SIZE", "7")
    assert Settings().chunk_size == 100 and Settings.from_env().chunk_size == 7


def test_blank_optional_variables_mean_unset_and_integers_may_be_written_in_e_notation() -> None:
    settings = Settings.from_env(
        {"CONVEYOR_S3_ENDPOINT_URL": "", "CONVEYOR_WORKER_CONCURRENCY": "none", "CONVEYOR_MAX_UPLOAD_BYTES": "2e8"}
    )
    assert settings.s3.endpoint_url is None and settings.worker_concurrency is None
    assert settings.max_upload_bytes == 200_000_000


def test_the_readme_table_is_generated_from_the_settings() -> None:
    readme = README.read_text()
    assert readme_with_table(readme) == readme, "README's settings table is stale: run `python -m jobs.settings_doc`"
