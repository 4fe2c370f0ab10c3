"""Where a worker's LoRA adapters come from: `CONVEYOR_LORA_ADAPTERS` entries naming the object store are downloaded
once, when the worker starts, into a local cache folder, so the engine reads local PEFT folders only (it knows no S3).

`name=s3://bucket/prefix/` is one adapter's folder; the whole setting `s3://bucket/prefix/` is a directory of adapters,
each sub-prefix holding an `adapter_config.json` an adapter named by it (as a local directory is). The store is reached
with the service's own endpoint, region and credentials (`CONVEYOR_S3_*`, boto3's chain); a file already in the cache
with the size the store lists is not downloaded again (a restarted worker), any other is replaced whole.
"""

from __future__ import annotations

import os
from pathlib import Path

from jobs.served_models import parse_lora_adapters
from jobs.settings import S3Settings
from jobs.storage import ObjectStore

S3_SCHEME = "s3://"
ADAPTER_CONFIG = "adapter_config.json"


def local_lora_adapters(raw: str, s3: S3Settings, cache_dir: Path) -> dict[str, str]:
    """`CONVEYOR_LORA_ADAPTERS` as adapter name -> local folder, the object store's adapters downloaded first."""
    text = raw.strip()
    if text.startswith(S3_SCHEME) and "=" not in text:  # a directory of adapters in the object store
        store, folder = _store(text, s3), _cache_folder(text, cache_dir)
        names = sorted({
            listed.key.split("/")[0] for listed in store.list_objects("")
            if listed.key.count("/") == 1 and listed.key.endswith("/" + ADAPTER_CONFIG)
        })
        if not names:
            raise ValueError(f"CONVEYOR_LORA_ADAPTERS: {text} holds no adapter (no <name>/{ADAPTER_CONFIG})")
        return {name: str(_download(store, name + "/", folder / name)) for name in names}
    return {
        name: str(_download(_store(source, s3), "", _cache_folder(source, cache_dir)))
        if source.startswith(S3_SCHEME) else source
        for name, source in parse_lora_adapters(text).items()
    }


def _store(url: str, s3: S3Settings) -> ObjectStore:
    bucket, _, prefix = url.removeprefix(S3_SCHEME).partition("/")
    if not bucket:
        raise ValueError(f"CONVEYOR_LORA_ADAPTERS: {url!r} names no bucket (s3://bucket/prefix/)")
    prefix = prefix if not prefix or prefix.endswith("/") else prefix + "/"  # a folder, not a key's prefix
    return ObjectStore(S3Settings(endpoint_url=s3.endpoint_url, region=s3.region, bucket=bucket, prefix=prefix))


def _cache_folder(url: str, cache_dir: Path) -> Path:
    """The cache mirrors the bucket and prefix, so two sources never share a folder."""
    parts = [part for part in url.removeprefix(S3_SCHEME).split("/") if part]
    if any(part in (".", "..") for part in parts):
        raise ValueError(f"CONVEYOR_LORA_ADAPTERS: {url!r} has '.' or '..' in its path")
    return cache_dir.joinpath(*parts)


def _download(store: ObjectStore, prefix: str, folder: Path) -> Path:
    """Every object under `prefix` (relative to the store's) into `folder`, keeping the keys' sub-paths."""
    listed = [entry for entry in store.list_objects(prefix) if not entry.key.endswith("/")]
    if not listed:
        raise ValueError(f"CONVEYOR_LORA_ADAPTERS: {store.url(prefix)} holds no objects")
    for entry in listed:
        relative = entry.key[len(prefix) :]
        if any(part in ("", ".", "..") for part in relative.split("/")):
            raise ValueError(f"CONVEYOR_LORA_ADAPTERS: object {store.url(entry.key)} has no safe local path")
        target = folder / relative
        if target.is_file() and target.stat().st_size == entry.size:
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(target.name + ".part")
        with partial.open("wb") as out:
            for chunk in store.open_stream(entry.key):
                out.write(chunk)
        os.replace(partial, target)  # a crash mid-download leaves no half file under the real name
    return folder
