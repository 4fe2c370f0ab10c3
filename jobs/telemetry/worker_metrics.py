"""A worker's own HTTP endpoint, served from a thread of the worker process: `/metrics` (the engine's telemetry and
the tasks' outcomes and chunk durations, in Prometheus format) and `/healthz`.

Engine numbers are read at scrape time through `EngineLoop.stats`, which the loop thread answers between two steps:
the engine's queues and block pools are only consistent there.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from itertools import accumulate
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, ProcessCollector, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from engine.engine_loop import EngineLoop
from engine.metrics import EngineStats, Histogram
from jobs.settings import Settings
from jobs.telemetry.task_metrics import TaskTelemetry

log = logging.getLogger(__name__)

WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]

# A scrape waits for the engine's step in progress; a long prefill step on a CPU can take seconds.
ENGINE_STATS_TIMEOUT_SECONDS = 5.0
PREEMPTION_MODES = ("swap", "recompute")  # always exported, so a dashboard's series exist before the first one


class EngineCollector(Collector):
    def __init__(self, read_stats: Callable[[], EngineStats]) -> None:
        self._read_stats = read_stats

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self._read_stats()
        except (TimeoutError, RuntimeError) as unavailable:  # busy past the timeout, or the loop has stopped
            log.warning("engine stats unavailable for this scrape: %r", unavailable)
            return
        yield from engine_families(stats)


def engine_families(stats: EngineStats) -> Iterator[Metric]:
    counters = stats.counters
    yield _labelled(
        GaugeMetricFamily,
        "conveyor_engine_sequences",
        "Sequences in the engine's queues",
        "state",
        {"running": stats.num_running, "waiting": stats.num_waiting, "swapped": stats.num_swapped},
    )
    yield GaugeMetricFamily(
        "conveyor_engine_batch_sequences",
        "Sequences computed in the last step: the effective batch size",
        value=counters.last_step_sequences,
    )
    yield GaugeMetricFamily(
        "conveyor_engine_batch_tokens",
        "Tokens computed in the last step: prefill chunks plus one per decoding sequence",
        value=counters.last_step_tokens,
    )
    yield GaugeMetricFamily(
        "conveyor_engine_kv_cache_utilization", "Share of the device KV blocks held by sequences", value=stats.kv_utilization
    )
    yield _labelled(
        GaugeMetricFamily,
        "conveyor_engine_kv_blocks",
        "Device KV blocks: used (held by sequences), cached (held by nobody, kept for the prefix cache), empty",
        "state",
        {
            "used": stats.kv_blocks_used,
            "cached": stats.kv_blocks_cached,
            "empty": stats.kv_blocks_free - stats.kv_blocks_cached,
        },
    )
    yield _labelled(
        GaugeMetricFamily,
        "conveyor_engine_host_kv_blocks",
        "Host (swap) pool KV blocks",
        "state",
        {"used": stats.host_blocks_used, "free": stats.host_blocks_total - stats.host_blocks_used},
    )
    yield GaugeMetricFamily(
        "conveyor_engine_kv_cache_fragmentation",
        "Share of the slots in used blocks that hold no token",
        value=stats.kv_fragmentation,
    )
    yield _labelled(
        CounterMetricFamily,
        "conveyor_engine_preemptions",
        "Sequences preempted, by mode",
        "mode",
        {mode: stats.preemptions.get(mode, 0) for mode in (*PREEMPTION_MODES, *stats.preemptions)},
    )
    yield _labelled(
        CounterMetricFamily,
        "conveyor_engine_swapped_blocks",
        "KV blocks moved between the device and host pools",
        "direction",
        {"out": stats.blocks_swapped_out, "in": stats.blocks_swapped_in},
    )
    yield CounterMetricFamily(
        "conveyor_engine_swap_bytes", "Bytes moved between the device and host pools", value=stats.swap_bytes
    )
    yield CounterMetricFamily(
        "conveyor_engine_prefix_cache_queried_tokens",
        "Prompt tokens looked up in the prefix cache",
        value=stats.prefix_cache_queried_tokens,
    )
    yield CounterMetricFamily(
        "conveyor_engine_prefix_cache_hit_tokens",
        "Prompt tokens found in the prefix cache (not computed)",
        value=stats.prefix_cache_hit_tokens,
    )
    yield GaugeMetricFamily(
        "conveyor_engine_prefix_cache_hit_rate",
        "Prefix-cache hit tokens / queried tokens since the worker started",
        value=stats.prefix_cache_hit_rate,
    )
    yield CounterMetricFamily("conveyor_engine_steps", "Engine steps", value=counters.steps)
    yield CounterMetricFamily(
        "conveyor_engine_prompt_tokens",
        "Prompt positions computed (recomputed after preemption counts again)",
        value=counters.prompt_tokens_computed,
    )
    yield CounterMetricFamily(
        "conveyor_engine_generation_tokens", "Tokens sampled; rate() is the output tokens/s", value=counters.generation_tokens
    )
    yield CounterMetricFamily(
        "conveyor_engine_batched_tokens", "Positions computed: prefill chunks plus decodes", value=counters.batched_tokens
    )
    yield CounterMetricFamily(
        "conveyor_engine_requests_finished", "Requests finished or aborted", value=counters.requests_finished
    )
    yield _histogram("conveyor_engine_step_duration_seconds", "Wall time of one engine step", counters.step_time)
    yield _histogram(
        "conveyor_engine_time_to_first_token_seconds",
        "From a request's arrival in the engine to its first sampled token",
        counters.time_to_first_token,
    )
    yield _histogram(
        "conveyor_engine_time_per_output_token_seconds",
        "Per finished request: time from its first token to its last, over its further tokens",
        counters.time_per_output_token,
    )


def _labelled(
    family: type[GaugeMetricFamily] | type[CounterMetricFamily],
    name: str,
    documentation: str,
    label: str,
    values: Mapping[str, float],
) -> Metric:
    metric = family(name, documentation, labels=[label])
    for label_value, value in values.items():
        metric.add_metric([label_value], value)
    return metric


def _histogram(name: str, documentation: str, histogram: Histogram) -> HistogramMetricFamily:
    cumulative = list(accumulate(histogram.counts))
    buckets = [(floatToGoString(bound), count) for bound, count in zip(histogram.bounds, cumulative)]
    buckets.append(("+Inf", cumulative[-1]))
    return HistogramMetricFamily(name, documentation, buckets=buckets, sum_value=histogram.total)


def start_worker_telemetry(settings: Settings, loop: EngineLoop) -> None:
    """Record task outcomes and chunk durations, and serve them with the engine's stats on the metrics port
    (none when CONVEYOR_WORKER_METRICS_PORT is 0)."""
    registry = CollectorRegistry()
    TaskTelemetry(registry).connect()
    if settings.worker_metrics_port == 0:
        return
    registry.register(EngineCollector(lambda: loop.stats(timeout=ENGINE_STATS_TIMEOUT_SECONDS)))
    ProcessCollector(registry=registry)
    try:
        server = make_server(
            settings.worker_metrics_host,
            settings.worker_metrics_port,
            _metrics_and_health_app(registry),
            ThreadingWSGIServer,
            handler_class=_QuietRequestHandler,
        )
    except OSError as cannot_listen:
        # A worker without metrics still does its work; e.g. a second worker on a host that kept the default port.
        log.error(
            "cannot serve metrics on %s:%d (%s); set CONVEYOR_WORKER_METRICS_PORT to a free port, or 0",
            settings.worker_metrics_host,
            settings.worker_metrics_port,
            cannot_listen,
        )
        return
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    log.info("serving metrics on http://%s:%d/metrics", settings.worker_metrics_host, settings.worker_metrics_port)


def _metrics_and_health_app(registry: CollectorRegistry) -> WsgiApp:
    metrics_app = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            return metrics_app(environ, start_response)
        if path == "/healthz":
            start_response("200 OK", [("Content-Type", "application/json")])
            return [b'{"status": "ok"}']
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [b"not found: try /metrics or /healthz\n"]

    return app


class _QuietRequestHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's parameter name
        """Scrapes come every few seconds; a line each would drown the worker's log."""
