"""File expiry: `expires_after` sets `expires_at`; an expired file is gone for readers at once and the sweep deletes
its row and its bytes."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from datetime import timedelta

import pytest
from sqlalchemy import update

from jobs import files
from jobs.db import SessionFactory, make_engine, make_session_factory
from jobs.errors import ServiceError
from jobs.models import Batch, BatchStatus, File, FilePurpose, Project, utcnow
from jobs.object_keys import file_key
from jobs.storage import ObjectStore


@pytest.fixture(scope="module")
def sessions(database_url: str) -> Iterator[SessionFactory]:
    engine = make_engine(database_url)
    yield make_session_factory(engine)
    engine.dispose()


def test_expires_after_is_checked_like_openai() -> None:
    created = utcnow()
    fields = {"purpose": "batch", "expires_after[anchor]": "created_at", "expires_after[seconds]": "3600"}
    assert files.upload_expiry(fields, created) == created + timedelta(hours=1)
    assert files.upload_expiry({"purpose": "batch"}, created) is None
    for anchor, seconds, problem in [("last_active_at", "3600", "anchor"), ("created_at", "60", "between"),
                                     ("created_at", "soon", "integer")]:
        with pytest.raises(ServiceError, match=problem):
            files.upload_expiry({"expires_after[anchor]": anchor, "expires_after[seconds]": seconds}, created)
    with pytest.raises(ServiceError, match="purpose must be one of"):
        files.parse_upload_purpose("fine-tune")


def test_an_expired_file_is_gone_for_readers_and_the_sweep_deletes_row_and_bytes(
    sessions: SessionFactory, object_store: ObjectStore
) -> None:
    with sessions.begin() as session:
        project = Project(name=f"expiry-{secrets.token_hex(4)}")
        session.add(project)
        session.flush()
        project_id = project.id
        rows = {}
        for name, expires_at in [("expired", utcnow() - timedelta(seconds=1)), ("live", utcnow() + timedelta(hours=1))]:
            file_id = f"file-{secrets.token_hex(8)}"
            key = file_key(project_id, file_id)
            object_store.put_bytes(key, b"{}\n")
            files.record_file(session, file_id=file_id, project_id=project_id, filename=f"{name}.jsonl",
                              purpose=FilePurpose.batch, size=3, object_key=key, expires_at=expires_at)
            rows[name] = (file_id, key)
    with sessions() as session:
        with pytest.raises(ServiceError) as gone:
            files.get_file(session, project_id, rows["expired"][0])
        assert gone.value.kind == "not_found"
        listed = files.list_files(session, project_id, after=None, limit=10, order="desc", purpose=None)
        assert [row.id for row in listed.rows] == [rows["live"][0]]
    assert files.delete_expired_files(sessions, object_store) >= 1
    with sessions() as session:
        assert session.get(File, rows["expired"][0]) is None
        assert session.get(File, rows["live"][0]) is not None
    assert not object_store.exists(rows["expired"][1]) and object_store.exists(rows["live"][1])


def test_the_input_of_a_running_batch_is_kept_past_its_expiry_and_cannot_be_deleted(
    sessions: SessionFactory, object_store: ObjectStore
) -> None:
    with sessions.begin() as session:
        project = Project(name=f"in-use-{secrets.token_hex(4)}")
        session.add(project)
        session.flush()
        project_id, file_id = project.id, f"file-{secrets.token_hex(8)}"
        key = file_key(project_id, file_id)
        object_store.put_bytes(key, b"{}\n")
        files.record_file(session, file_id=file_id, project_id=project_id, filename="in.jsonl",
                          purpose=FilePurpose.batch, size=3, object_key=key, expires_at=utcnow() + timedelta(hours=1))
        batch = Batch(project_id=project_id, input_file_id=file_id, endpoint="/v1/chat/completions",
                      completion_window="24h", expires_at=utcnow() + timedelta(hours=24), status=BatchStatus.in_progress)
        session.add(batch)
        session.flush()
        batch_id = batch.id
    with sessions() as session:
        with pytest.raises(ServiceError) as in_use:
            files.delete_file(session, object_store, project_id, file_id)
    assert in_use.value.kind == "conflict" and in_use.value.code == "file_in_use" and batch_id in in_use.value.message
    with sessions.begin() as session:  # it expires while the batch still reads it
        session.execute(update(File).where(File.id == file_id).values(expires_at=utcnow() - timedelta(seconds=1)))
    files.delete_expired_files(sessions, object_store)
    assert object_store.exists(key)
    with sessions.begin() as session:  # the batch ends: the sweep may take the file now
        session.execute(update(Batch).where(Batch.id == batch_id).values(status=BatchStatus.completed))
    files.delete_expired_files(sessions, object_store)
    assert not object_store.exists(key)
