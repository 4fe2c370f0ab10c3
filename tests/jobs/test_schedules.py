"""Schedules in the domain: next-fire times across DST changes, template checks, and firing exactly once when many
sweeps race (real PostgreSQL and S3, sweeps in threads of this process)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from zoneinfo import ZoneInfo

import pytest
from sqlalchemy import select, update

from engine.model_registry import DEFAULT_EMBEDDING_MODEL
from jobs.batches import RAG_ENDPOINT, check_input_prefix
from jobs.db import SessionFactory, make_engine, make_session_factory
from jobs.errors import ServiceError
from jobs.files import record_file
from jobs.keys import create_key_in_database
from jobs.models import Batch, File, FilePurpose, Schedule, ScheduleFire, new_id
from jobs.object_keys import file_key, inbox_key
from jobs.rag.processing import RagOptions
from jobs.schedules.cron import next_fire_time, normalized_cron
from jobs.schedules.definitions import ScheduleSpec, create_schedule, list_runs, run_id
from jobs.schedules.firing import Fire, fire_due_schedules
from jobs.served_models import process_models
from jobs.storage import ObjectStore

UTC = timezone.utc
PARIS = ZoneInfo("Europe/Paris")
EMBEDDING_MODEL = DEFAULT_EMBEDDING_MODEL  # the service's, as Settings.embedding_model gives it


def utc(*parts: int) -> datetime:
    return datetime(*parts, tzinfo=UTC)


def fires(cron: str, zone: str, after: datetime, count: int) -> list[datetime]:
    times = []
    for _ in range(count):
        after = next_fire_time(cron, zone, after)
        times.append(after)
    return times


# ---------------------------------------------------------------------------------------------------------
# time, no services


def test_nightly_paris_schedule_keeps_local_time_across_both_dst_changes() -> None:
    spring = fires("0 2 * * *", "Europe/Paris", utc(2026, 3, 27, 12), 3)
    # 2026-03-29: 02:00 does not exist in Paris (02:00 CET -> 03:00 CEST); it fires as the clock jumps.
    assert spring == [utc(2026, 3, 28, 1), utc(2026, 3, 29, 1), utc(2026, 3, 30, 0)]
    assert [moment.astimezone(PARIS).hour for moment in spring] == [2, 3, 2]

    autumn = fires("0 2 * * *", "Europe/Paris", utc(2026, 10, 23, 12), 3)
    # 2026-10-25: 02:00 happens twice in Paris (03:00 CEST -> 02:00 CET); the night's job fires once, at the first.
    assert autumn == [utc(2026, 10, 24, 0), utc(2026, 10, 25, 0), utc(2026, 10, 26, 1)]
    assert {moment.astimezone(PARIS).hour for moment in autumn} == {2}


def test_repeated_hour_fires_each_wall_clock_time_once_and_never_goes_back() -> None:
    # From 01:50 CEST across the fall-back: the repeated 02:00-02:59 (CET) does not fire again.
    times = fires("*/30 * * * *", "Europe/Paris", utc(2026, 10, 24, 23, 50), 4)
    assert times == [utc(2026, 10, 25, 0), utc(2026, 10, 25, 0, 30), utc(2026, 10, 25, 2), utc(2026, 10, 25, 2, 30)]
    # Asked from inside the repeated hour, the answer is after it, not a first-pass time already gone.
    assert next_fire_time("*/15 * * * *", "Europe/Paris", utc(2026, 10, 25, 1, 10)) == utc(2026, 10, 25, 2)


def test_utc_and_other_zones() -> None:
    assert next_fire_time("* * * * *", "UTC", utc(2026, 1, 1, 12, 0, 30)) == utc(2026, 1, 1, 12, 1)
    assert next_fire_time("0 9 * * 1", "America/New_York", utc(2026, 3, 4)) == utc(2026, 3, 9, 13)  # EDT from 03-08


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("0 2 * *", "five fields"),
        ("0 0 2 * * *", "five fields"),
        ("61 2 * * *", "invalid cron expression"),
        ("0 2 * * mon-xyz", "invalid cron expression"),
    ],
)
def test_cron_must_be_five_valid_fields(expression: str, message: str) -> None:
    with pytest.raises(ServiceError, match=message) as raised:
        normalized_cron(expression)
    assert raised.value.kind == "invalid_request" and raised.value.param == "cron"


def test_cron_is_normalized_and_impossible_dates_are_refused() -> None:
    assert normalized_cron("  0   2 * *  1-5 ") == "0 2 * * 1-5"
    with pytest.raises(ServiceError, match="never fires"):
        next_fire_time("0 0 31 2 *", "UTC", utc(2026, 1, 1))


@pytest.mark.parametrize("prefix", ["", "/absolute/", "../other/", "a/../b/", "a//b", "./x", "x/..", "bad\nname"])
def test_input_prefix_stays_inside_the_inbox(prefix: str) -> None:
    with pytest.raises(ServiceError) as raised:
        check_input_prefix(prefix)
    assert raised.value.param == "input_prefix"


@pytest.mark.parametrize("prefix", ["nightly/", "nightly", "exports/2026-", "a/b/c.jsonl"])
def test_input_prefix_accepts_relative_prefixes(prefix: str) -> None:
    check_input_prefix(prefix)


# ---------------------------------------------------------------------------------------------------------
# firing, against PostgreSQL and S3


@pytest.fixture
def sessions(database_url: str) -> Iterator[SessionFactory]:
    engine = make_engine(database_url, pool_size=12)
    yield make_session_factory(engine)
    engine.dispose()


def _input_file(sessions: SessionFactory, store: ObjectStore, project_id: str) -> str:
    file_id = new_id("file-")
    body = {"prompt": "hi", "max_tokens": 1}
    line = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": body}).encode() + b"\n"
    store.put_bytes(file_key(project_id, file_id), line)
    with sessions.begin() as session:
        record_file(
            session,
            file_id=file_id,
            project_id=project_id,
            filename="in.jsonl",
            purpose=FilePurpose.batch,
            size=len(line),
            object_key=file_key(project_id, file_id),
        )
    return file_id


def _new_project(database_url: str) -> str:
    return create_key_in_database(database_url, f"schedules-{new_id('')}").project_id


def _create_due(sessions: SessionFactory, project_id: str, spec: ScheduleSpec, due_at: datetime) -> str:
    with sessions.begin() as session:
        schedule_id = create_schedule(session, project_id, spec, embedding_model=EMBEDDING_MODEL).id
        session.execute(update(Schedule).where(Schedule.id == schedule_id).values(next_fire_at=due_at))
    return schedule_id


def _due_schedule(sessions: SessionFactory, store: ObjectStore, database_url: str, cron: str, due_at: datetime) -> str:
    project_id = _new_project(database_url)
    spec = ScheduleSpec(
        cron=cron,
        timezone="UTC",
        endpoint="/v1/completions",
        completion_window="24h",
        input_file_id=_input_file(sessions, store, project_id),
        input_prefix=None,
        metadata={"kind": "nightly"},
        priority=3,
        webhook_endpoint_id=None,
    )
    return _create_due(sessions, project_id, spec, due_at)


def _batches_of(sessions: SessionFactory, schedule_id: str) -> list[Batch]:
    with sessions() as session:
        project_id = session.scalar(select(Schedule.project_id).where(Schedule.id == schedule_id))
        return list(session.scalars(select(Batch).where(Batch.project_id == project_id)))


def test_racing_sweeps_fire_a_due_schedule_exactly_once(
    sessions: SessionFactory, object_store: ObjectStore, database_url: str
) -> None:
    now = datetime.now(UTC).replace(microsecond=0)
    due_at = now.replace(second=0) - timedelta(minutes=1)
    schedule_id = _due_schedule(sessions, object_store, database_url, "* * * * *", due_at)
    ours, enqueued = _sweep_at_once(sessions, object_store, schedule_id, now, sweeps=8)
    assert len(ours) == 1 and ours[0].fire_time == due_at and ours[0].error is None
    (batch,) = _batches_of(sessions, schedule_id)
    assert ours[0].batch_id == batch.id and batch.id in enqueued
    assert (batch.priority, batch.batch_metadata, batch.status.value) == (3, {"kind": "nightly"}, "validating")
    with sessions() as session:
        schedule = session.get(Schedule, schedule_id)
        assert schedule is not None and schedule.next_fire_at == now.replace(second=0) + timedelta(minutes=1)
        fired = session.scalars(select(ScheduleFire).where(ScheduleFire.schedule_id == schedule_id)).all()
    assert [(row.fire_time, row.batch_id) for row in fired] == [(due_at, batch.id)]


def test_a_fire_time_recorded_once_never_fires_again(
    sessions: SessionFactory, object_store: ObjectStore, database_url: str
) -> None:
    """next_fire_at put back to a time that already fired (a database restore, say): the guard row refuses it."""
    now = datetime.now(UTC)
    due_at = now.replace(second=0, microsecond=0) - timedelta(minutes=5)
    schedule_id = _due_schedule(sessions, object_store, database_url, "0 3 * * *", due_at)
    fired_now = fire_due_schedules(
        sessions, object_store, lambda _: None, embedding_model=EMBEDDING_MODEL, served_models=list, now=now
    )
    (first,) = [fire for fire in fired_now if fire.schedule_id == schedule_id]
    with sessions.begin() as session:
        session.execute(update(Schedule).where(Schedule.id == schedule_id).values(next_fire_at=due_at))
    again = fire_due_schedules(
        sessions, object_store, lambda _: None, embedding_model=EMBEDDING_MODEL, served_models=list, now=now
    )
    assert [fire for fire in again if fire.schedule_id == schedule_id] == []
    assert len(_batches_of(sessions, schedule_id)) == 1 and first.batch_id is not None
    with sessions() as session:
        assert session.scalar(select(Schedule.next_fire_at).where(Schedule.id == schedule_id)) > now


def test_a_schedule_found_a_day_late_fires_once_then_resumes_from_now(
    sessions: SessionFactory, object_store: ObjectStore, database_url: str
) -> None:
    now = datetime.now(UTC)
    missed_since = now.replace(minute=0, second=0, microsecond=0) - timedelta(hours=24)
    schedule_id = _due_schedule(sessions, object_store, database_url, "0 * * * *", missed_since)
    for _ in range(3):  # later sweeps of the same moment find nothing more to do
        fire_due_schedules(
            sessions, object_store, lambda _: None, embedding_model=EMBEDDING_MODEL, served_models=list, now=now
        )
    with sessions() as session:
        fired = session.scalars(select(ScheduleFire).where(ScheduleFire.schedule_id == schedule_id)).all()
        next_fire_at = session.scalar(select(Schedule.next_fire_at).where(Schedule.id == schedule_id))
    assert [row.fire_time for row in fired] == [missed_since] and fired[0].batch_id is not None
    assert next_fire_at == now.replace(minute=0, second=0, microsecond=0) + timedelta(hours=1)
    assert len(_batches_of(sessions, schedule_id)) == 1


def test_runs_are_listed_newest_first_a_page_at_a_time(
    sessions: SessionFactory, object_store: ObjectStore, database_url: str
) -> None:
    start = datetime.now(UTC).replace(second=0, microsecond=0) - timedelta(minutes=10)
    schedule_id = _due_schedule(sessions, object_store, database_url, "* * * * *", start)
    for minute in range(3):  # sweeps a minute apart, each finding the next minute due
        fire_due_schedules(
            sessions, object_store, lambda _: None, embedding_model=EMBEDDING_MODEL, served_models=list,
            now=start + timedelta(minutes=minute, seconds=5),
        )
    with sessions() as session:
        project_id = session.scalar(select(Schedule.project_id).where(Schedule.id == schedule_id))
        first = list_runs(session, project_id, schedule_id, after=None, limit=2)
        rest = list_runs(session, project_id, schedule_id, after=run_id(first.rows[-1].fire_time), limit=2)
        with pytest.raises(ServiceError) as stranger:
            list_runs(session, "proj_someone_else", schedule_id, after=None, limit=2)
    expected = [start + timedelta(minutes=minute) for minute in (2, 1, 0)]
    assert [row.fire_time for row in first.rows] == expected[:2] and first.has_more
    assert [row.fire_time for row in rest.rows] == expected[2:] and not rest.has_more
    assert stranger.value.kind == "not_found"


def test_racing_sweeps_fire_a_due_rag_schedule_into_exactly_one_rag_job(
    sessions: SessionFactory, object_store: ObjectStore, database_url: str
) -> None:
    project_id = _new_project(database_url)
    for name in ("manuals/b.txt", "manuals/a.md"):
        object_store.put_bytes(inbox_key(project_id, name), b"# Pumps\n\nPrime the pump before starting it.\n")
    spec = ScheduleSpec(
        cron="0 2 * * *",
        timezone="UTC",
        endpoint=RAG_ENDPOINT,
        completion_window="24h",
        input_file_id=None,
        input_prefix="manuals/",
        metadata={"corpus": "manuals"},
        priority=4,
        webhook_endpoint_id=None,
        rag_options={"chunk_tokens": 64, "contextualize": True},
    )
    now = datetime.now(UTC).replace(microsecond=0)
    due_at = now - timedelta(hours=1)
    schedule_id = _create_due(sessions, project_id, spec, due_at)
    ours, enqueued = _sweep_at_once(sessions, object_store, schedule_id, now, sweeps=2)
    assert len(ours) == 1 and ours[0].fire_time == due_at and ours[0].error is None
    (job,) = _batches_of(sessions, schedule_id)
    assert ours[0].batch_id == job.id and job.id.startswith("ragjob_") and enqueued.count(job.id) == 1
    expected_options = RagOptions(chunk_tokens=64, contextualize=True, embedding_model=EMBEDDING_MODEL).to_json()
    assert (job.endpoint, job.rag_options, job.input_prefix) == (RAG_ENDPOINT, expected_options, "manuals/")
    assert (job.priority, job.batch_metadata, job.status.value) == (4, {"corpus": "manuals"}, "validating")
    with sessions() as session:
        listing = session.get(File, job.input_file_id)
        fired = session.scalars(select(ScheduleFire).where(ScheduleFire.schedule_id == schedule_id)).all()
    assert [(row.fire_time, row.batch_id, row.error) for row in fired] == [(due_at, job.id, None)]
    assert listing is not None and listing.project_id == project_id
    documents = [json.loads(line) for line in object_store.read_bytes(listing.object_key).splitlines()]
    assert [document["id"] for document in documents] == ["a.md", "b.txt"]  # the prefix listed in key order


def test_a_rag_schedule_reading_pages_binds_each_job_to_a_served_model_that_reads_images(
    sessions: SessionFactory, object_store: ObjectStore, database_url: str
) -> None:
    """As POST /v1/rag/jobs does, with the models served when it fires: none reading images records why on the fire
    (the schedule goes on to its next time); one reading images is the job's model."""
    project_id = _new_project(database_url)
    object_store.put_bytes(inbox_key(project_id, "scans/form.pdf"), b"%PDF-1.4")  # listed, never read here
    spec = ScheduleSpec(
        cron="0 2 * * *", timezone="UTC", endpoint=RAG_ENDPOINT, completion_window="24h", input_file_id=None,
        input_prefix="scans/", metadata=None, priority=0, webhook_endpoint_id=None, rag_options={"pdf_mode": "pages"},
    )
    now = datetime.now(UTC).replace(microsecond=0)
    text_only = process_models(["llm"], EMBEDDING_MODEL)
    served = [text_only, text_only + process_models(["vlm"], EMBEDDING_MODEL, accepts_images=True)]
    outcomes = []
    schedule_id = _create_due(sessions, project_id, spec, now - timedelta(hours=2))
    for hours_ago, models in zip((2, 1), served):
        with sessions.begin() as session:
            due = now - timedelta(hours=hours_ago)
            session.execute(update(Schedule).where(Schedule.id == schedule_id).values(next_fire_at=due))
        fired = fire_due_schedules(
            sessions, object_store, lambda _: None, embedding_model=EMBEDDING_MODEL, served_models=lambda: models,
            now=now,
        )
        outcomes += [fire for fire in fired if fire.schedule_id == schedule_id]
    refused, bound = outcomes
    assert refused.batch_id is None and refused.error is not None and "read text only ('llm')" in refused.error
    (job,) = _batches_of(sessions, schedule_id)
    assert (bound.batch_id, bound.error, job.model) == (job.id, None, "vlm")


def _sweep_at_once(
    sessions: SessionFactory, object_store: ObjectStore, schedule_id: str, now: datetime, sweeps: int
) -> tuple[list[Fire], list[str]]:
    """`sweeps` threads run fire_due_schedules at the same instant; returns this schedule's fires and the
    batch ids they enqueued."""
    enqueued: list[str] = []
    results: list[list[Fire]] = []
    start = threading.Barrier(sweeps)

    def sweep() -> None:
        start.wait()
        results.append(
            fire_due_schedules(
                sessions, object_store, enqueued.append, embedding_model=EMBEDDING_MODEL, served_models=list, now=now
            )
        )

    threads = [threading.Thread(target=sweep) for _ in range(sweeps)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [fire for result in results for fire in result if fire.schedule_id == schedule_id], enqueued
