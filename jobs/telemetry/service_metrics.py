"""The service's state as Prometheus gauges, read at scrape time for the API's `/metrics`: batches, RAG jobs and
webhook deliveries by status (PostgreSQL, one query), the Celery queues' lengths and the restarts `conveyor up` made of
the processes it supervises (Redis, one pipelined round trip).

A backend that fails is left out of that scrape (and logged) rather than failing the whole scrape.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from kombu.transport.redis import PRIORITY_STEPS, Channel
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from redis import Redis
from redis.exceptions import RedisError
from sqlalchemy import String, cast, func, literal, select, union_all
from sqlalchemy.exc import SQLAlchemyError

from jobs.batches import RAG_ENDPOINT
from jobs.db import SessionFactory
from jobs.models import Batch, BatchStatus, DeliveryStatus, WebhookDelivery

log = logging.getLogger(__name__)


def process_restarts_key(redis_prefix: str) -> str:
    """Redis hash: process name -> how many times `conveyor up` restarted it."""
    return redis_prefix + "process_restarts"


class ServiceCollector(Collector):
    def __init__(
        self,
        sessions: SessionFactory,
        redis: Redis,
        redis_prefix: str,
        queues: Callable[[], Sequence[str]],  # the queues now: one per served model, so they change with workers
        broker_transport_options: Mapping[str, Any],
    ) -> None:
        self._sessions = sessions
        self._redis = redis
        self._redis_prefix = redis_prefix
        self._queues = queues
        self._priority_steps = sorted(set(broker_transport_options.get("priority_steps", PRIORITY_STEPS)))

    def collect(self) -> Iterator[Metric]:
        yield from self._database_families()
        yield from self._redis_families()

    def _database_families(self) -> Iterator[Metric]:
        rag = Batch.endpoint == RAG_ENDPOINT  # RAG jobs share the batches table, not its metric
        by_table = union_all(
            select(literal("batches"), cast(Batch.status, String), func.count()).where(~rag).group_by(Batch.status),
            select(literal("rag_jobs"), cast(Batch.status, String), func.count()).where(rag).group_by(Batch.status),
            select(literal("webhook_deliveries"), cast(WebhookDelivery.status, String), func.count()).group_by(
                WebhookDelivery.status
            ),
        )
        try:
            with self._sessions() as session:
                rows = session.execute(by_table).all()
        except SQLAlchemyError as unavailable:
            log.warning("database unavailable for this scrape: %r", unavailable)
            return
        counts = {(table, status): count for table, status, count in rows}
        # Every status is exported, zeros included, so a status's series exists before its first row.
        batches = GaugeMetricFamily("conveyor_batches", "Batches by status (RAG jobs apart)", labels=["status"])
        rag_jobs = GaugeMetricFamily("conveyor_rag_jobs", "RAG jobs by status", labels=["status"])
        for batch_status in BatchStatus:
            batches.add_metric([batch_status.value], counts.get(("batches", batch_status.name), 0))
            rag_jobs.add_metric([batch_status.value], counts.get(("rag_jobs", batch_status.name), 0))
        deliveries = GaugeMetricFamily(
            "conveyor_webhook_deliveries", "Webhook deliveries (an event to one endpoint) by status", labels=["status"]
        )
        for delivery_status in DeliveryStatus:
            deliveries.add_metric([delivery_status.value], counts.get(("webhook_deliveries", delivery_status.name), 0))
        yield batches
        yield rag_jobs
        yield deliveries

    def _redis_families(self) -> Iterator[Metric]:
        lists = {queue: self._list_keys(queue) for queue in self._queues()}
        pipeline = self._redis.pipeline(transaction=False)
        for keys in lists.values():
            for key in keys:
                pipeline.llen(key)
        pipeline.hlen(self._redis_prefix + Channel.unacked_key)
        pipeline.hgetall(process_restarts_key(self._redis_prefix))
        try:
            lengths = iter(pipeline.execute())
        except RedisError as unavailable:
            log.warning("redis unavailable for this scrape: %r", unavailable)
            return
        queued = GaugeMetricFamily(
            "conveyor_celery_queue_length", "Tasks waiting in a Celery queue (every priority level)", labels=["queue"]
        )
        for queue, keys in lists.items():
            queued.add_metric([queue], sum(next(lengths) for _ in keys))
        yield queued
        yield GaugeMetricFamily(
            "conveyor_celery_unacked_tasks",
            "Tasks delivered to workers and not yet acknowledged: running, or prefetched by a worker",
            value=next(lengths),
        )
        restarts = CounterMetricFamily(
            "conveyor_process_restarts", "Times `conveyor up` restarted a process that died", labels=["process"]
        )
        for process, count in sorted(next(lengths).items()):
            restarts.add_metric([process.decode()], int(count))
        yield restarts

    def _list_keys(self, queue: str) -> list[str]:
        """kombu's Redis transport keeps priority level p > 0 of a queue in its own list, `queue` + separator + p;
        every Redis key also carries the global key prefix."""
        return [
            self._redis_prefix + (f"{queue}{Channel.sep}{step}" if step else queue)
            for step in self._priority_steps
        ]
