"""The API's service gauges: RAG jobs, which share the batches table, are counted apart from batches."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from prometheus_client.core import Metric
from redis import Redis

from jobs import db
from jobs.batches import RAG_ENDPOINT
from jobs.models import Batch, BatchStatus, Project
from jobs.telemetry.service_metrics import ServiceCollector
from tests.stack_fixtures import REDIS_URL


def gauge(families: list[Metric], name: str, status: str) -> float:
    family = next(family for family in families if family.name == name)
    return next(sample.value for sample in family.samples if sample.labels == {"status": status})


def test_rag_jobs_are_counted_apart_from_batches(empty_database_url: str) -> None:
    db.upgrade(empty_database_url)
    engine = db.make_engine(empty_database_url, pool_size=1)
    sessions = db.make_session_factory(engine)
    expires = datetime.now(timezone.utc) + timedelta(hours=24)
    with sessions.begin() as session:
        project = Project(name="metrics")
        session.add(project)
        session.flush()
        for endpoint in ("/v1/chat/completions", "/v1/completions", RAG_ENDPOINT, RAG_ENDPOINT, RAG_ENDPOINT):
            session.add(
                Batch(project_id=project.id, input_file_id="file-x", endpoint=endpoint, completion_window="24h",
                      expires_at=expires, status=BatchStatus.completed)
            )
    redis = Redis.from_url(REDIS_URL)
    try:
        families = list(ServiceCollector(sessions, redis, "test-service-metrics:", lambda: [], {})._database_families())
    finally:
        redis.close()
        engine.dispose()
    assert gauge(families, "conveyor_batches", "completed") == 2
    assert gauge(families, "conveyor_rag_jobs", "completed") == 3
    assert gauge(families, "conveyor_rag_jobs", "in_progress") == 0
