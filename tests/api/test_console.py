"""The console over HTTP, against a real API process (PostgreSQL, Redis, SeaweedFS; no worker): sign-in, the session
cookie, tenancy identical to the REST API's, CSRF on state-changing forms, sign-out and revoked keys. The browser
tests (`test_console_browser.py`) drive the same pages in Chromium against the whole stack."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from conveyor.local_stack import free_port, scratch_redis_prefix
from jobs import db
from jobs.keys import create_key_in_database, revoke_key
from jobs.settings import Settings, replace
from tests.api.test_batch_service import client_for, completion_file
from tests.stack_fixtures import REDIS_URL, Stack, running_stack


@pytest.fixture(scope="module")
def console_stack(service_settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """An API process without a worker, on queues of its own: the shared stack's worker, if running, does not take
    these batches, which stay `validating` and so can be cancelled at leisure."""
    with scratch_redis_prefix(REDIS_URL) as prefix:
        settings = replace(service_settings, redis_prefix=prefix, api_port=free_port())
        with running_stack(settings, tmp_path_factory.mktemp("console-api"), with_worker=False) as stack:
            yield stack


def api_root(stack: Stack) -> str:
    return stack.base_url.removesuffix("/v1")


def signed_in(stack: Stack, key: str) -> httpx.Client:
    """A browser-like client holding a console session of `key`."""
    browser = httpx.Client(base_url=api_root(stack), timeout=30, follow_redirects=True)
    answer = browser.post("/console/sign-in", data={"api_key": key})
    assert answer.status_code == 200 and answer.url.path == "/console", answer.text
    return browser


def csrf_token(browser: httpx.Client, path: str = "/console") -> str:
    match = re.search(r'name="csrf_token" value="([^"]+)"', browser.get(path).text)
    assert match, "no CSRF token on the page"
    return match.group(1)


def submitted_batch(client: openai.OpenAI, prefix: str) -> Any:
    data, _ = completion_file(prefix, 2)
    upload = client.files.create(file=(f"{prefix}.jsonl", data), purpose="batch")
    return client.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")


def test_sign_in_exchanges_a_key_for_a_strict_httponly_cookie(console_stack: Stack) -> None:
    root = api_root(console_stack)
    away = httpx.get(f"{root}/console/batches?status=failed", follow_redirects=True)
    assert away.url.path == "/console/sign-in" and "next=%2Fconsole%2Fbatches%3Fstatus%3Dfailed" in str(away.url)
    refused = httpx.post(f"{root}/console/sign-in", data={"api_key": "sk-not-a-key"})
    assert refused.status_code == 401 and "not valid" in refused.text and "set-cookie" not in refused.headers

    key = console_stack.new_key("console-cookie")
    answer = httpx.post(f"{root}/console/sign-in", data={"api_key": key, "next": "https://elsewhere.example/"})
    assert answer.status_code == 303 and answer.headers["location"] == "/console"  # never off the console
    cookie = answer.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/console" in cookie
    assert key not in cookie  # an opaque token, not the key
    page = httpx.get(f"{root}/console", cookies=answer.cookies)
    assert page.status_code == 200 and "no-store" in page.headers["cache-control"]
    assert "frame-ancestors 'none'" in page.headers["content-security-policy"]  # no clickjacking of its buttons


def test_a_session_sees_only_its_projects_objects(console_stack: Stack) -> None:
    mine, theirs = console_stack.new_key("console-mine"), console_stack.new_key("console-theirs")
    batch = submitted_batch(client_for(console_stack, mine), "console-tenancy")
    own, other = signed_in(console_stack, mine), signed_in(console_stack, theirs)

    assert batch.id in own.get("/console/batches").text and batch.id in own.get(f"/console/batches/{batch.id}").text
    assert own.get(f"/console/files/{batch.input_file_id}/content").status_code == 200
    assert batch.id not in other.get("/console/batches").text
    assert batch.input_file_id not in other.get("/console/files").text
    for path in (f"/console/batches/{batch.id}", f"/console/batches/{batch.id}/live", f"/console/files/{batch.input_file_id}/content"):
        assert other.get(path).status_code == 404, path
    cancel = other.post(f"/console/batches/{batch.id}/cancel", data={"csrf_token": csrf_token(other)})
    assert cancel.status_code == 404
    assert client_for(console_stack, mine).batches.retrieve(batch.id).status == "validating"  # no worker here


def test_state_changing_forms_need_the_sessions_csrf_token(console_stack: Stack) -> None:
    key = console_stack.new_key("console-csrf")
    client = client_for(console_stack, key)
    batch = submitted_batch(client, "console-csrf")
    browser = signed_in(console_stack, key)
    other_session_token = csrf_token(signed_in(console_stack, key))

    for form in ({}, {"csrf_token": ""}, {"csrf_token": other_session_token}):
        refused = browser.post(f"/console/batches/{batch.id}/cancel", data=form)
        assert refused.status_code == 403, form
        assert client.batches.retrieve(batch.id).status == "validating"
    assert browser.post(f"/console/files/{batch.input_file_id}/delete", data={}).status_code == 403

    confirm = browser.get(f"/console/batches/{batch.id}/cancel")
    assert confirm.status_code == 200 and "Cancel the batch" in confirm.text
    done = browser.post(f"/console/batches/{batch.id}/cancel", data={"csrf_token": csrf_token(browser)})
    assert done.status_code == 200 and done.url.path == f"/console/batches/{batch.id}"
    assert client.batches.retrieve(batch.id).status == "cancelling"  # validate (no worker here) would finish it
    listed = browser.get("/console/batches", params={"status": "cancelling"}).text
    assert batch.id in listed and batch.id not in browser.get("/console/batches", params={"status": "failed"}).text

    # A batch reads its input until it ends: the console refuses that delete as the API does, naming the batch.
    in_use = browser.post(f"/console/files/{batch.input_file_id}/delete", data={"csrf_token": csrf_token(browser)})
    assert in_use.status_code == 409 and batch.id in in_use.text
    spare = client.files.create(file=("console-csrf-spare.jsonl", completion_file("console-csrf-spare", 1)[0]), purpose="batch")
    deleted = browser.post(f"/console/files/{spare.id}/delete", data={"csrf_token": csrf_token(browser)})
    assert deleted.status_code == 200
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(spare.id)


def test_signing_out_or_revoking_the_key_ends_the_session(console_stack: Stack) -> None:
    browser = signed_in(console_stack, console_stack.new_key("console-out"))
    stolen_cookie = dict(browser.cookies)
    assert browser.post("/console/sign-out", data={"csrf_token": csrf_token(browser)}).url.path == "/console/sign-in"
    replayed = httpx.get(api_root(console_stack) + "/console/batches", cookies=stolen_cookie, follow_redirects=True)
    assert replayed.url.path == "/console/sign-in"  # the token is gone server-side, not only from the browser
    assert httpx.get(api_root(console_stack) + "/console/batches/live", cookies=stolen_cookie).status_code == 401

    created = create_key_in_database(console_stack.settings.database_url, "console-revoked")
    browser = signed_in(console_stack, created.secret)
    sessions = db.make_session_factory(db.make_engine(console_stack.settings.database_url))
    with sessions.begin() as session:
        assert revoke_key(session, created.key_id)
    deadline = time.monotonic() + 5  # the revocation reaches the API by PostgreSQL NOTIFY, within moments
    while browser.get("/console/batches").url.path != "/console/sign-in":
        assert time.monotonic() < deadline, "a revoked key's session still works"
        time.sleep(0.1)


def test_every_page_renders_and_refuses_unknown_parameters(console_stack: Stack) -> None:
    key = console_stack.new_key("console-pages")
    batch = submitted_batch(client_for(console_stack, key), "console-pages")
    schedule = httpx.post(
        console_stack.base_url + "/schedules",
        headers={"authorization": f"Bearer {key}"},
        json={"cron": "0 2 * * *", "timezone": "Europe/Paris", "endpoint": "/v1/completions",
              "completion_window": "24h", "input_file_id": batch.input_file_id},
    )
    assert schedule.status_code == 200, schedule.text
    browser = signed_in(console_stack, key)
    # Fire times on the schedule's own clock: 02:00 in Paris, whatever the server's zone (CET or CEST by date).
    fires = re.findall(r"<li>(\d{4}-\d\d-\d\d \d\d:\d\d \w+)</li>", browser.get("/console/schedules").text)
    assert len(fires) == 3 and all(fire[11:16] == "02:00" and fire.split()[-1] in ("CET", "CEST") for fire in fires), fires
    for path in ("/console", "/console/batches", "/console/files", "/console/schedules", "/console/webhooks",
                 "/console/rag", "/console/models", "/console/workers", "/console/workers/live"):
        answer = browser.get(path)
        assert answer.status_code == 200 and "text/html" in answer.headers["content-type"], path
    assert browser.get("/console/batches", params={"limt": 5}).status_code == 400
    assert browser.get("/console/batches", params={"status": "done"}).status_code == 400
    assert browser.get("/console/static/console.js").status_code == 200
