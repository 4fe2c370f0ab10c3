"""Readiness: can this process reach PostgreSQL, Redis and the S3 bucket right now? Each check is one cheap call
with a short timeout and no retries, so a dead dependency answers within seconds instead of hanging the probe."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import boto3
from botocore.config import Config
from redis import Redis
from sqlalchemy import text

from jobs.db import SessionFactory
from jobs.settings import S3Settings

PROBE_TIMEOUT_SECONDS = 2.0
_ERROR_CHARS = 300


@dataclass(frozen=True)
class DependencyCheck:
    name: str  # "database", "redis", "s3"
    ok: bool
    error: str | None = None  # why not, when not ok


class ReadinessProbe:
    def __init__(self, sessions: SessionFactory, redis: Redis, s3: S3Settings) -> None:
        self._sessions = sessions
        self._redis = redis
        self._bucket = s3.bucket
        # Not the ObjectStore's client: that one retries and waits long, right for data, wrong for a probe.
        self._s3 = boto3.session.Session().client(
            "s3",
            endpoint_url=s3.endpoint_url,
            region_name=s3.region,
            config=Config(
                signature_version="s3v4",
                s3={"addressing_style": "path"},
                retries={"mode": "standard", "max_attempts": 1},
                connect_timeout=PROBE_TIMEOUT_SECONDS,
                read_timeout=PROBE_TIMEOUT_SECONDS,
            ),
        )

    def check(self) -> list[DependencyCheck]:
        return [
            _run_check("database", self._ping_database),
            _run_check("redis", self._redis.ping),
            _run_check("s3", lambda: self._s3.head_bucket(Bucket=self._bucket)),
        ]

    def _ping_database(self) -> None:
        with self._sessions() as session:
            session.execute(text("SELECT 1"))


def _run_check(name: str, probe: Callable[[], object]) -> DependencyCheck:
    try:
        probe()
    except Exception as failure:  # any failure at all means "not ready"; the message says which
        return DependencyCheck(name, ok=False, error=f"{type(failure).__name__}: {failure}"[:_ERROR_CHARS])
    return DependencyCheck(name, ok=True)
