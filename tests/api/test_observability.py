"""Metrics, health and logs of a real stack: the API's /metrics, /healthz and /readyz, a worker's /metrics and its
JSON log lines, and the Grafana dashboard's queries checked against the metric names the processes export."""

from __future__ import annotations

import json
import re
import secrets
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from conveyor.local_stack import free_port, scratch_redis_prefix
from conveyor.seaweedfs import SeaweedFS
from jobs.settings import Settings, replace
from tests.api.test_batch_service import chat_line, jsonl, wait_for
from tests.stack_fixtures import REDIS_URL, Stack, running_stack

pytestmark = pytest.mark.slow

DASHBOARD = Path(__file__).parents[2] / "deploy" / "grafana" / "conveyor.json"
REQUESTS = 4


@dataclass
class Observed:
    """A stack that ran one small batch, and what its endpoints said along the way."""

    stack: Stack
    batch_id: str
    api_metrics_while_queued: list[Sample]
    api_metrics: list[Sample]
    worker_metrics: list[Sample]

    @property
    def worker_metrics_url(self) -> str:
        return f"http://{self.stack.settings.worker_metrics_host}:{self.stack.settings.worker_metrics_port}"


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return int(response.status), bytes(response.read())
    except urllib.error.HTTPError as error:
        return int(error.code), bytes(error.read())


def api_url(stack: Stack, path: str) -> str:
    return f"http://{stack.settings.api_host}:{stack.settings.api_port}{path}"


def scrape(url: str) -> list[Sample]:
    status, body = get(url)
    assert status == 200, body
    return [sample for family in text_string_to_metric_families(body.decode()) for sample in family.samples]


def value(samples: list[Sample], name: str, **labels: str) -> float:
    matching = [s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    assert matching, f"no sample {name}{labels}"
    return sum(matching)


@pytest.fixture(scope="module")
def observed(service_settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Observed]:
    with scratch_redis_prefix(REDIS_URL) as prefix:
        settings = replace(
            service_settings,
            redis_prefix=prefix,
            api_port=free_port(),
            worker_metrics_port=free_port(),
            log_format="json",
        )
        with running_stack(settings, tmp_path_factory.mktemp("observed"), with_worker=False) as stack:
            client = openai.OpenAI(api_key=stack.new_key("observability"), base_url=stack.base_url, max_retries=0)
            lines = [chat_line(f"obs-{i}", f"Say a number. Request {i}.") for i in range(REQUESTS)]
            batch_input = client.files.create(file=("obs.jsonl", jsonl(lines)), purpose="batch")
            batch = client.batches.create(
                input_file_id=batch_input.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
            # No worker yet: the batch's validate task waits in the control queue.
            while_queued = scrape(api_url(stack, "/metrics"))
            stack.start_worker()
            assert wait_for(client, batch.id).status == "completed"
            worker_url = f"http://{settings.worker_metrics_host}:{settings.worker_metrics_port}/metrics"
            yield Observed(stack, batch.id, while_queued, scrape(api_url(stack, "/metrics")), chunk_counted(worker_url))


def chunk_counted(worker_url: str, timeout_s: float = 120.0) -> list[Sample]:
    """The worker's metrics once its validate and run_chunk tasks have both ended, with the engine's. The batch
    completes before the tasks are counted: a task's last step enqueues the next one, which another thread may finish
    before Celery reports the first done (a loaded machine widens the gap; at load 8 it was seconds). A scrape that
    waited for the engine past its timeout leaves the engine's metrics out: the next one has them."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = scrape(worker_url)
        ended = {
            (s.name, s.labels.get("task"))
            for s in samples
            if s.value >= 1
            and (
                s.name in ("conveyor_chunk_duration_seconds_count", "conveyor_engine_steps_total")
                or (s.name == "conveyor_tasks_total" and s.labels.get("outcome") == "success")
            )
        }
        wanted = {
            ("conveyor_engine_steps_total", None),  # absent from a scrape that found the engine busy past its timeout
            ("conveyor_chunk_duration_seconds_count", None),
            ("conveyor_tasks_total", "conveyor.run_chunk"),
            ("conveyor_tasks_total", "conveyor.validate"),
        }
        if wanted <= ended or time.monotonic() > deadline:
            return samples
        time.sleep(0.5)


def test_api_metrics_count_batches_by_status_and_queued_tasks(observed: Observed) -> None:
    queued = observed.api_metrics_while_queued
    assert value(queued, "conveyor_celery_queue_length", queue="control") == 1  # the batch's validate task
    assert value(queued, "conveyor_celery_queue_length", queue="gpu") == 0
    assert value(queued, "conveyor_batches", status="validating") >= 1

    after = observed.api_metrics
    assert value(after, "conveyor_batches", status="completed") >= 1
    assert value(after, "conveyor_celery_queue_length", queue="control") == 0
    assert value(after, "conveyor_celery_queue_length", queue="gpu") == 0
    for status in ("pending", "succeeded", "failed"):
        assert value(after, "conveyor_webhook_deliveries", status=status) >= 0
    assert value(after, "conveyor_celery_unacked_tasks") >= 0


def test_worker_metrics_show_the_engine_and_the_chunk_at_work(observed: Observed) -> None:
    worker = observed.worker_metrics
    assert value(worker, "conveyor_engine_generation_tokens_total") > 0
    assert value(worker, "conveyor_engine_steps_total") > 0
    assert value(worker, "conveyor_engine_time_to_first_token_seconds_count") == REQUESTS
    assert value(worker, "conveyor_engine_time_per_output_token_seconds_count") > 0
    assert value(worker, "conveyor_engine_step_duration_seconds_count") == value(worker, "conveyor_engine_steps_total")
    assert value(worker, "conveyor_engine_sequences", state="running") == 0  # the batch is done
    assert 0 <= value(worker, "conveyor_engine_kv_cache_utilization") <= 1
    assert value(worker, "conveyor_chunk_duration_seconds_count") >= 1
    assert value(worker, "conveyor_tasks_total", task="conveyor.run_chunk", outcome="success") >= 1
    assert value(worker, "conveyor_tasks_total", task="conveyor.validate", outcome="success") == 1
    status, body = get(observed.worker_metrics_url + "/healthz")
    assert status == 200 and json.loads(body) == {"status": "ok"}


def test_worker_logs_are_json_lines_carrying_batch_and_chunk(observed: Observed) -> None:
    assert observed.stack.worker is not None
    records = [json.loads(line) for line in observed.stack.worker.log_path.read_text().splitlines() if line.startswith("{")]
    of_batch = [record for record in records if record.get("batch_id") == observed.batch_id]
    assert of_batch, "no worker log line carries the batch id"
    assert any(record.get("chunk_index") == 0 for record in of_batch)  # a line logged by run_chunk
    assert all({"time", "level", "logger", "message"} <= record.keys() for record in records)


def test_api_health_and_readiness(observed: Observed) -> None:
    status, body = get(api_url(observed.stack, "/healthz"))
    assert status == 200 and json.loads(body) == {"status": "ok"}
    status, body = get(api_url(observed.stack, "/readyz"))
    report = json.loads(body)
    assert status == 200, report
    assert report["status"] == "ready" and report["failed"] == []
    assert {name: check["ok"] for name, check in report["checks"].items()} == {"database": True, "redis": True, "s3": True}


def test_readyz_names_s3_when_it_goes_away(
    service_settings: Settings, seaweedfs: SeaweedFS, tmp_path: Path
) -> None:
    # An S3 server of this test's own, with the session's credentials, that can be stopped under a running API.
    doomed = SeaweedFS(tmp_path / "s3", access_key=seaweedfs.access_key, secret_key=seaweedfs.secret_key)
    with doomed, scratch_redis_prefix(REDIS_URL) as prefix:
        settings = replace(
            service_settings,
            s3=replace(service_settings.s3, endpoint_url=doomed.endpoint_url, bucket=f"doomed-{secrets.token_hex(4)}"),
            redis_prefix=prefix,
            api_port=free_port(),
        )
        with running_stack(settings, tmp_path / "stack", with_worker=False) as stack:
            assert get(api_url(stack, "/readyz"))[0] == 200
            doomed.stop()
            started = time.monotonic()
            status, body = get(api_url(stack, "/readyz"))
            report: dict[str, Any] = json.loads(body)
            assert status == 503, report
            assert report["failed"] == ["s3"] and report["checks"]["s3"]["error"]
            assert report["checks"]["database"]["ok"] and report["checks"]["redis"]["ok"]
            assert time.monotonic() - started < 10  # a probe, not a retrying client
            assert get(api_url(stack, "/healthz"))[0] == 200  # alive, only not ready


def test_grafana_dashboard_queries_only_exported_metrics(observed: Observed) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {variable["name"]: variable for variable in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    exported = {sample.name for sample in observed.api_metrics + observed.worker_metrics}
    panels = [panel for panel in dashboard["panels"] if panel["type"] != "row"]
    assert panels
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            used = set(re.findall(r"\bconveyor_[A-Za-z0-9_:]+", target["expr"]))
            assert used, f"{panel['title']}: {target['expr']}"
            assert used <= exported, f"{panel['title']}: {sorted(used - exported)} not exported"
