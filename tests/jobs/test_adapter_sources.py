"""LoRA adapters from the object store (real SeaweedFS): `s3://` entries of CONVEYOR_LORA_ADAPTERS are downloaded once
into the worker's cache folder, a directory of adapters by its sub-prefixes, local folders left as they are."""

from __future__ import annotations

from pathlib import Path

import pytest

from jobs.adapter_sources import local_lora_adapters
from jobs.settings import S3Settings
from jobs.storage import ObjectStore

FILES = {"adapter_config.json": b'{"peft_type": "LORA"}', "adapter_model.safetensors": b"\x00weights" * 100}


def test_adapters_in_the_object_store_are_downloaded_once(
    object_store: ObjectStore, s3_settings: S3Settings, tmp_path
) -> None:
    for name in ("tone", "extract"):
        for file, data in FILES.items():
            object_store.put_bytes(f"adapters/{name}/{file}", name.encode() + data)
    object_store.put_bytes("adapters/notes/readme.md", b"not an adapter")
    root = f"s3://{s3_settings.bucket}/{s3_settings.prefix}adapters"
    cache = tmp_path / "cache"

    adapters = local_lora_adapters(root + "/", s3_settings, cache)  # a directory of adapters

    assert sorted(adapters) == ["extract", "tone"]
    for name, folder in adapters.items():
        assert {path.name: path.read_bytes() for path in sorted(Path(folder).iterdir())} == {
            file: name.encode() + data for file, data in FILES.items()
        }

    # One adapter's folder by name beside a local one; the cached file (same size) is kept, a changed one replaced.
    weights = Path(adapters["tone"]) / "adapter_model.safetensors"
    weights.write_bytes(b"X" * weights.stat().st_size)
    config = Path(adapters["tone"]) / "adapter_config.json"
    config.write_bytes(b"{}")
    again = local_lora_adapters(f"tone={root}/tone, local=/srv/local-adapter", s3_settings, cache)
    assert again == {"tone": adapters["tone"], "local": "/srv/local-adapter"}
    assert weights.read_bytes() == b"X" * weights.stat().st_size
    assert config.read_bytes() == b"tone" + FILES["adapter_config.json"]

    with pytest.raises(ValueError, match="holds no objects"):
        local_lora_adapters(f"gone={root}/absent/", s3_settings, cache)
    with pytest.raises(ValueError, match="holds no adapter"):
        local_lora_adapters(f"{root}/tone/", s3_settings, cache)

