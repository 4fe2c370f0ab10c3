"""/v1/schedules through the real service: the API process, two `conveyor beat` processes sending the sweep every
second, and a worker consuming it, on PostgreSQL, Redis and SeaweedFS."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import httpx
import openai
import pytest
from sqlalchemy import Engine, create_engine, select, update

from conveyor.local_stack import ManagedProcess, free_port, scratch_redis_prefix, start_beat
from jobs.keys import create_key_in_database
from jobs.models import Batch, Schedule, WebhookEndpoint
from jobs.object_keys import inbox_key
from jobs.settings import Settings, replace
from jobs.storage import ObjectStore
from tests.stack_fixtures import REDIS_URL, Stack, running_stack

pytestmark = pytest.mark.slow

COMPLETIONS = "/v1/completions"
RAG_JOBS = "/v1/rag/jobs"
NIGHTLY = {"cron": "0 2 * * *", "endpoint": COMPLETIONS, "completion_window": "24h"}


def request_line(custom_id: str) -> bytes:
    body = {"prompt": "Once upon a time", "max_tokens": 2, "temperature": 0}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": COMPLETIONS, "body": body}).encode()


@pytest.fixture(scope="module")
def beat_stack(service_settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """API, worker and two beats of this module's own (its own queues), sweeping every second."""
    folder = tmp_path_factory.mktemp("schedules")
    with scratch_redis_prefix(REDIS_URL) as prefix:
        settings = replace(service_settings, redis_prefix=prefix, api_port=free_port(), beat_interval_seconds=1.0)
        with running_stack(settings, folder) as running:
            beats: list[ManagedProcess] = []
            try:
                for number in (1, 2):
                    beats.append(start_beat(settings, folder / f"beat{number}.log"))
                yield running
            finally:
                for beat in beats:
                    beat.stop()


@pytest.fixture(scope="module")
def database(beat_stack: Stack) -> Iterator[Engine]:
    engine = create_engine(beat_stack.settings.database_url)
    yield engine
    engine.dispose()


class Project:
    """One tenant: its id (for its inbox and direct database checks) and clients holding its key."""

    def __init__(self, stack: Stack, name: str) -> None:
        created = create_key_in_database(stack.settings.database_url, name)
        self.id = created.project_id
        self.http = httpx.Client(
            base_url=stack.base_url, headers={"Authorization": f"Bearer {created.secret}"}, timeout=30
        )
        self.sdk = openai.OpenAI(api_key=created.secret, base_url=stack.base_url, max_retries=0, timeout=30)

    def upload(self, content: bytes) -> str:
        return self.sdk.files.create(file=("input.jsonl", content), purpose="batch").id

    def create(self, **body: Any) -> httpx.Response:
        return self.http.post("/schedules", json=body)

    def created(self, **body: Any) -> dict[str, Any]:
        response = self.create(**body)
        assert response.status_code == 200, response.text
        return dict(response.json())

    def runs(self, schedule_id: str) -> list[dict[str, Any]]:
        response = self.http.get(f"/schedules/{schedule_id}/runs")
        assert response.status_code == 200, response.text
        return list(response.json()["data"])


@pytest.fixture
def new_project(beat_stack: Stack) -> Iterator[Callable[[str], Project]]:
    projects: list[Project] = []

    def make(name: str) -> Project:
        projects.append(Project(beat_stack, f"{name}-{time.monotonic_ns()}"))
        return projects[-1]

    yield make
    for project in projects:
        project.http.close()
        project.sdk.close()


def make_due(database: Engine, schedule_id: str, due_at: datetime) -> None:
    """What beat would see at `due_at`, without waiting for it: the schedule's next fire time moved into the past."""
    with database.begin() as connection:
        connection.execute(update(Schedule).where(Schedule.id == schedule_id).values(next_fire_at=due_at))


def wait_for_runs(project: Project, schedule_id: str, timeout_s: float = 60.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout_s
    while not (runs := project.runs(schedule_id)):
        assert time.monotonic() < deadline, f"schedule {schedule_id} did not fire within {timeout_s} s"
        time.sleep(0.3)
    return runs


def wait_for_batch(project: Project, batch_id: str, timeout_s: float = 180.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while (batch := project.sdk.batches.retrieve(batch_id)).status not in ("completed", "failed"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.5)
    return batch


def error_of(response: httpx.Response) -> dict[str, Any]:
    return dict(response.json()["error"])


def count_in_log(path: Path, text: str) -> int:
    return path.read_text(errors="replace").count(text)


# ---------------------------------------------------------------------------------------------------------


def test_create_refuses_bad_templates_with_clear_errors(new_project: Callable[[str], Project]) -> None:
    project = new_project("invalid")
    file_id = project.upload(request_line("a") + b"\n")
    cases: list[tuple[dict[str, Any], int, str, str]] = [
        ({"cron": "0 2 * *"}, 400, "cron", "five fields"),
        ({"cron": "61 2 * * *"}, 400, "cron", "invalid cron expression"),
        ({"cron": "0 0 31 2 *"}, 400, "cron", "never fires"),
        ({"timezone": "Mars/Olympus_Mons"}, 400, "timezone", "IANA time zone"),
        ({"endpoint": "/v1/moderations"}, 400, "endpoint", "endpoint must be one of"),
        ({"completion_window": "1h"}, 400, "completion_window", "completion_window must be one of"),
        ({"input_prefix": "nightly/"}, 400, "input_file_id", "exactly one of input_file_id and input_prefix"),
        ({"input_file_id": None}, 400, "input_file_id", "exactly one of input_file_id and input_prefix"),
        ({"input_file_id": None, "input_prefix": "../other/"}, 400, "input_prefix", "relative to the project's inbox"),
        ({"input_file_id": "file-nope"}, 404, "file_id", "No such File object"),
        ({"webhook_endpoint_id": "wh_nope"}, 404, "webhook_endpoint_id", "No such webhook endpoint"),
        ({"priority": 2**40}, 400, "priority", "priority must be an integer from"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, 400, "metadata", "at most 16"),
        ({"every": "night"}, 400, "every", "Extra inputs"),
    ]
    for change, status, param, message in cases:
        response = project.create(**{**NIGHTLY, "input_file_id": file_id, **change})
        assert response.status_code == status, (change, response.text)
        error = error_of(response)
        assert error["param"] == param and message in error["message"], (change, error)
    assert project.http.get("/schedules").json()["data"] == []


def test_create_list_pause_resume_delete(new_project: Callable[[str], Project], database: Engine) -> None:
    project = new_project("crud")
    file_id = project.upload(request_line("a") + b"\n")
    before = datetime.now(timezone.utc)
    schedule = project.created(
        **NIGHTLY, timezone="Europe/Paris", input_file_id=file_id, metadata={"team": "search"}, priority=7
    )
    next_fire = datetime.fromtimestamp(schedule["next_fire_at"], timezone.utc)
    assert before < next_fire <= before + timedelta(days=1)
    assert next_fire.astimezone(ZoneInfo("Europe/Paris")).strftime("%H:%M") in ("02:00", "03:00")  # 03:00: DST gap
    assert {key: schedule[key] for key in ("object", "cron", "timezone", "paused", "priority", "metadata")} == {
        "object": "schedule", "cron": "0 2 * * *", "timezone": "Europe/Paris", "paused": False, "priority": 7,
        "metadata": {"team": "search"},
    }
    assert schedule["input_file_id"] == file_id and schedule["input_prefix"] is None and schedule["input_uri"] is None
    assert schedule["rag_options"] is None  # a batch template
    assert project.http.get(f"/schedules/{schedule['id']}").json() == schedule

    others = [project.created(**NIGHTLY, input_file_id=file_id)["id"] for _ in range(2)]
    first_page = project.http.get("/schedules", params={"limit": 2}).json()
    assert [row["id"] for row in first_page["data"]] == others[::-1] and first_page["has_more"]
    second_page = project.http.get("/schedules", params={"limit": 2, "after": first_page["last_id"]}).json()
    assert [row["id"] for row in second_page["data"]] == [schedule["id"]] and not second_page["has_more"]

    paused = project.http.post(f"/schedules/{schedule['id']}/pause").json()
    assert paused["paused"] is True
    make_due(database, schedule["id"], datetime.now(timezone.utc) - timedelta(minutes=1))
    time.sleep(3)  # several sweeps
    assert project.runs(schedule["id"]) == []  # a paused schedule does not fire
    resumed = project.http.post(f"/schedules/{schedule['id']}/resume").json()
    # Resuming starts from now: the time missed while paused does not fire.
    assert resumed["paused"] is False and resumed["next_fire_at"] == schedule["next_fire_at"]

    deleted = project.http.delete(f"/schedules/{schedule['id']}")
    assert deleted.json() == {"id": schedule["id"], "object": "schedule.deleted", "deleted": True}
    assert project.http.get(f"/schedules/{schedule['id']}").status_code == 404
    assert [row["id"] for row in project.http.get("/schedules").json()["data"]] == others[::-1]
    for other in others:
        assert project.http.delete(f"/schedules/{other}").status_code == 200


def test_another_projects_schedules_answer_404(new_project: Callable[[str], Project], database: Engine) -> None:
    owner, stranger = new_project("owner"), new_project("stranger")
    with database.begin() as connection:
        endpoint_id = connection.scalar(
            WebhookEndpoint.__table__.insert()
            .values(
                id="wh_" + owner.id, project_id=owner.id, url="http://127.0.0.1:9/", name="elsewhere", events=[],
                secret="whsec_x", created_at=datetime.now(timezone.utc),
            )
            .returning(WebhookEndpoint.id)
        )
    file_id = owner.upload(request_line("a") + b"\n")
    schedule = owner.created(**NIGHTLY, input_file_id=file_id, webhook_endpoint_id=endpoint_id)
    assert schedule["webhook_endpoint_id"] == endpoint_id

    for method, path in [
        ("GET", ""), ("POST", "/pause"), ("POST", "/resume"), ("GET", "/runs"), ("DELETE", ""),
    ]:
        response = stranger.http.request(method, f"/schedules/{schedule['id']}{path}")
        assert response.status_code == 404, (method, path, response.text)
        assert error_of(response)["message"] == f"No such Schedule object: {schedule['id']}"
    assert stranger.http.get("/schedules").json()["data"] == []
    assert stranger.create(**NIGHTLY, input_file_id=file_id).status_code == 404  # the owner's file
    own_file = stranger.upload(request_line("b") + b"\n")
    refused = stranger.create(**NIGHTLY, input_file_id=own_file, webhook_endpoint_id=endpoint_id)
    assert refused.status_code == 404 and error_of(refused)["param"] == "webhook_endpoint_id"
    assert owner.http.get(f"/schedules/{schedule['id']}").json()["paused"] is False  # untouched
    owner.http.delete(f"/schedules/{schedule['id']}")


def test_two_beats_fire_a_due_schedule_once_and_its_batch_runs(
    beat_stack: Stack, new_project: Callable[[str], Project], database: Engine
) -> None:
    project = new_project("every-minute")
    file_id = project.upload(request_line("tick-1") + b"\n" + request_line("tick-2") + b"\n")
    schedule = project.created(
        cron="* * * * *", endpoint=COMPLETIONS, completion_window="24h", input_file_id=file_id,
        metadata={"source": "schedule"}, priority=5,
    )
    beat_logs = [beat_stack.folder / "beat1.log", beat_stack.folder / "beat2.log"]
    sent_before = [count_in_log(log, "fire-due-schedules") for log in beat_logs]
    due_at = datetime.now(timezone.utc).replace(microsecond=0) - timedelta(seconds=30)
    make_due(database, schedule["id"], due_at)

    first, *_ = wait_for_runs(project, schedule["id"])[::-1]
    time.sleep(4)  # both beats go on sending sweeps that find the schedule's fire already taken
    assert all(count_in_log(log, "fire-due-schedules") >= before + 3 for log, before in zip(beat_logs, sent_before))

    runs = project.runs(schedule["id"])
    assert first["fire_time"] == int(due_at.timestamp()) and first["batch_id"] and first["error"] is None
    # Fire times are unique, and every batch of the project is the one batch of one fire: none was made twice.
    # (A later fire is legitimate: the schedule fires every minute.)
    assert len({run["fire_time"] for run in runs}) == len(runs)
    batch_ids = [batch.id for batch in project.sdk.batches.list()]
    assert sorted(batch_ids) == sorted(run["batch_id"] for run in runs)
    assert [run["fire_time"] for run in runs].count(int(due_at.timestamp())) == 1
    after_fire = project.http.get(f"/schedules/{schedule['id']}").json()["next_fire_at"]
    assert after_fire > time.time() - 60 and after_fire % 60 == 0

    done = wait_for_batch(project, first["batch_id"])
    assert done.status == "completed" and done.metadata == {"source": "schedule"}
    assert done.input_file_id == file_id and done.request_counts.completed == 2
    with database.connect() as connection:
        assert connection.scalar(select(Batch.priority).where(Batch.id == first["batch_id"])) == 5
    project.http.delete(f"/schedules/{schedule['id']}")


def test_a_fire_whose_input_is_gone_records_the_error_and_advances(
    new_project: Callable[[str], Project], database: Engine
) -> None:
    project = new_project("deleted-input")
    file_id = project.upload(request_line("a") + b"\n")
    schedule = project.created(**NIGHTLY, input_file_id=file_id)
    assert project.sdk.files.delete(file_id).deleted
    due_at = datetime.now(timezone.utc).replace(microsecond=0) - timedelta(minutes=2)
    make_due(database, schedule["id"], due_at)

    (run,) = wait_for_runs(project, schedule["id"])
    assert run["batch_id"] is None and f"No such File object: {file_id}" in run["error"]
    assert run["fire_time"] == int(due_at.timestamp()) and run["id"] == f"run_{int(due_at.timestamp())}"
    assert project.http.get(f"/schedules/{schedule['id']}").json()["next_fire_at"] > time.time()
    assert list(project.sdk.batches.list()) == []
    project.http.delete(f"/schedules/{schedule['id']}")


def test_inbox_prefix_schedule_concatenates_only_its_own_projects_objects(
    new_project: Callable[[str], Project], database: Engine, object_store: ObjectStore, beat_stack: Stack
) -> None:
    project, neighbour = new_project("inbox"), new_project("neighbour")
    # The project's tools drop files into its inbox; the first has no final newline, which must not merge lines.
    object_store.put_bytes(inbox_key(project.id, "nightly/2026-01-01-a.jsonl"), request_line("inbox-a"))
    object_store.put_bytes(inbox_key(project.id, "nightly/2026-01-01-b.jsonl"), request_line("inbox-b") + b"\n")
    object_store.put_bytes(inbox_key(project.id, "other/c.jsonl"), request_line("not-under-the-prefix") + b"\n")
    object_store.put_bytes(inbox_key(neighbour.id, "nightly/x.jsonl"), request_line("neighbours-secret") + b"\n")

    schedule = project.created(**{**NIGHTLY, "input_prefix": "nightly/"})
    s3 = beat_stack.settings.s3
    assert schedule["input_uri"] == f"s3://{s3.bucket}/{s3.prefix}inbox/{project.id}/nightly/"
    empty = project.created(**{**NIGHTLY, "input_prefix": "nothing-here/"})
    due_at = datetime.now(timezone.utc).replace(microsecond=0) - timedelta(minutes=1)
    make_due(database, schedule["id"], due_at)
    make_due(database, empty["id"], due_at)

    (run,) = wait_for_runs(project, schedule["id"])
    batch = project.sdk.batches.retrieve(run["batch_id"])
    composed = project.sdk.files.content(batch.input_file_id).content
    assert composed == request_line("inbox-a") + b"\n" + request_line("inbox-b") + b"\n"
    assert project.sdk.files.retrieve(batch.input_file_id).bytes == len(composed)
    (empty_run,) = wait_for_runs(project, empty["id"])
    assert empty_run["batch_id"] is None and "no objects under the inbox prefix 'nothing-here/'" in empty_run["error"]

    done = wait_for_batch(project, run["batch_id"])
    output = [json.loads(line) for line in project.sdk.files.content(done.output_file_id).text.splitlines()]
    assert sorted(line["custom_id"] for line in output) == ["inbox-a", "inbox-b"]
    for schedule_id in (schedule["id"], empty["id"]):
        project.http.delete(f"/schedules/{schedule_id}")


def test_a_rag_schedule_checks_its_options_like_a_rag_job_and_fires_one(
    new_project: Callable[[str], Project], database: Engine, object_store: ObjectStore, beat_stack: Stack
) -> None:
    project = new_project("rag")
    object_store.put_bytes(inbox_key(project.id, "manuals/pump.md"), b"# Pumps\n\nPrime the pump before starting.\n")
    template = {**NIGHTLY, "endpoint": RAG_JOBS, "input_prefix": "manuals/", "metadata": {"corpus": "manuals"}}
    cases: list[tuple[dict[str, Any], str, str]] = [
        ({"rag_options": {"chunk_tokens": 32, "overlap_tokens": 32}}, "rag_options", "options: "),
        ({"rag_options": {"embedding_model": "another-model"}}, "rag_options.embedding_model", "embedding model"),
        ({"rag_options": {"chunk_size": 64}}, "rag_options.chunk_size", "Extra inputs"),
        ({"endpoint": COMPLETIONS}, "rag_options", f"rag_options needs endpoint '{RAG_JOBS}'"),
    ]
    for change, param, message in cases:
        response = project.create(**{**template, "rag_options": {"chunk_tokens": 64}, **change})
        assert response.status_code == 400, (change, response.text)
        error = error_of(response)
        assert error["param"] == param and message in error["message"], (change, error)
    assert project.http.get("/schedules").json()["data"] == []

    schedule = project.created(**template, rag_options={"chunk_tokens": 64, "overlap_tokens": 8})
    options = schedule["rag_options"]  # stored with its defaults filled in, as a RAG job shows them
    assert schedule["endpoint"] == RAG_JOBS and schedule["input_uri"].endswith(f"inbox/{project.id}/manuals/")
    assert (options["chunk_tokens"], options["overlap_tokens"], options["contextualize"]) == (64, 8, False)
    assert options["embedding_model"] == beat_stack.settings.embedding_model
    assert project.http.get(f"/schedules/{schedule['id']}").json() == schedule

    make_due(database, schedule["id"], datetime.now(timezone.utc).replace(microsecond=0) - timedelta(minutes=1))
    (run,) = wait_for_runs(project, schedule["id"])
    job = project.http.get(f"/rag/jobs/{run['batch_id']}").json()  # the run names the RAG job where batches go
    assert run["error"] is None and job["object"] == "rag.job" and job["options"] == options
    assert (job["input_prefix"], job["metadata"]) == ("manuals/", {"corpus": "manuals"})
    listing = project.http.get(f"/files/{job['input_file_id']}/content").text
    assert [json.loads(line)["id"] for line in listing.splitlines()] == ["pump.md"]
    assert list(project.sdk.batches.list()) == []  # a RAG job, not a batch
    project.http.delete(f"/schedules/{schedule['id']}")
