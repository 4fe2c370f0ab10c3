"""The console in a real browser: the system's headless Chromium driven by Selenium, against the shared stack
(PostgreSQL, Redis, SeaweedFS, a worker on the bundled SmolLM2). Nothing is downloaded at run time: without the
Debian packages `chromium` and `chromium-driver` these tests skip, saying so.

Screenshots of the main pages go to $CONVEYOR_CONSOLE_SCREENSHOTS (default: a folder of the test run's tmp dir);
README shows two of them, copied into docs/console/.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from jobs import db
from jobs.keys import create_key_in_database
from jobs.webhooks.endpoints import create_endpoint
from jobs.webhooks.targets import AllowList
from tests.api.test_batch_service import client_for, completion_line, jsonl, wait_for
from tests.api.test_console import api_root
from tests.stack_fixtures import Stack

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
INSTALL_HINT = "apt-get update && apt-get install -y chromium chromium-driver, and pip install selenium"
WAIT_SECONDS = 240.0  # a batch of a few short lines on a busy 2-core machine
# Form controls a screen reader could not name.
UNLABELLED_CONTROLS = """return Array.from(document.querySelectorAll("input:not([type=hidden]), select, textarea"))
  .filter((control) => !(control.labels && control.labels.length) && !control.getAttribute("aria-label"))
  .map((control) => control.outerHTML);"""

try:
    from selenium import webdriver
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.remote.webdriver import WebDriver
except ImportError:  # pragma: no cover - the `test` extra installs it
    webdriver = None


@pytest.fixture(scope="module")
def screenshots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = Path(os.environ.get("CONVEYOR_CONSOLE_SCREENSHOTS") or tmp_path_factory.mktemp("console-screenshots"))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture(scope="module")
def downloads(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("console-downloads")


@pytest.fixture(scope="module")
def browser(downloads: Path) -> Iterator[WebDriver]:
    if webdriver is None or not (os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)):
        pytest.skip(f"headless Chromium is not installed: {INSTALL_HINT}")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,900"):
        options.add_argument(argument)
    options.add_experimental_option(
        "prefs", {"download.default_directory": str(downloads), "download.prompt_for_download": False}
    )
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.execute_cdp_cmd("Page.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(downloads)})
    try:
        yield driver
    finally:
        driver.quit()


def eventually(check: Callable[[], Any], what: str, timeout_s: float = WAIT_SECONDS) -> Any:
    """check()'s first truthy answer; the page's own polling changes the DOM under us, so a vanished element is
    just another try."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            answer = check()
        except (NoSuchElementException, StaleElementReferenceException):
            answer = None
        if answer:
            return answer
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.25)


def sign_in(driver: WebDriver, root: str, key: str) -> None:
    driver.get(f"{root}/console/sign-in")
    field = driver.find_element(By.ID, "api_key")
    assert driver.find_element(By.CSS_SELECTOR, "label[for=api_key]").text == "API key"
    field.send_keys(key)
    field.submit()
    eventually(lambda: driver.current_url.endswith("/console"), "the overview after sign-in", 30)


def sign_out(driver: WebDriver) -> None:
    driver.find_element(By.CSS_SELECTOR, ".sign-out button").click()
    eventually(lambda: "/console/sign-in" in driver.current_url, "the sign-in form after sign-out", 30)


def test_a_batch_seen_through_the_console(
    stack: Stack, browser: WebDriver, screenshots: Path, downloads: Path
) -> None:
    root = api_root(stack)
    created = create_key_in_database(stack.settings.database_url, "console-browser")
    key, project_id, other_key = created.secret, created.project_id, stack.new_key("console-browser-other")
    client = client_for(stack, key)
    sessions = db.make_session_factory(db.make_engine(stack.settings.database_url))
    # Created in the database: the API would refuse 127.0.0.1, and so does the worker's delivery, which the page
    # shows as a refused attempt.
    with sessions.begin() as session:
        hook = create_endpoint(
            session, project_id, url="http://127.0.0.1:9/hooks", events=None, allow_list=AllowList.parse("127.0.0.1")
        )
        hook_id = hook.id

    sign_in(browser, root, key)
    lines = [completion_line(f"story-{i}", f"Once upon a time, in story {i},", max_tokens=4) for i in range(3)]
    lines.append(completion_line("bad-temperature", "x", temperature="hot"))
    data = jsonl(lines)
    upload = client.files.create(file=("stories.jsonl", data), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")

    # The batch's page, opened while it runs, reaches completed by its own polling: the marker set on this page
    # load survives, so nothing reloaded it.
    browser.get(f"{root}/console/batches/{batch.id}")
    browser.execute_script("window.__loadedOnce = true;")
    eventually(
        lambda: browser.find_element(By.ID, "batch-status").text == "completed", "the batch page showing completed"
    )
    assert browser.execute_script("return window.__loadedOnce === true;")
    progress = browser.find_element(By.CSS_SELECTOR, "#batch-live [role=progressbar]")
    assert progress.get_attribute("aria-valuenow") == progress.get_attribute("aria-valuemax") == "4"
    assert "3 ok, 1 failed / 4" in browser.find_element(By.CSS_SELECTOR, "#batch-live .counts").text

    # Its errors, grouped by code, with the input line.
    group = browser.find_element(By.CSS_SELECTOR, "#errors details.error-group")
    assert group.get_attribute("open") and group.get_attribute("data-code")
    first_row = group.find_elements(By.CSS_SELECTOR, "tbody tr")[0].find_elements(By.TAG_NAME, "td")
    assert first_row[0].text == "4" and first_row[1].text == "bad-temperature"
    browser.save_screenshot(str(screenshots / "batch.png"))

    # The output file, downloaded by the browser, is the API's.
    finished = client.batches.retrieve(batch.id)
    assert finished.output_file_id
    browser.find_element(By.LINK_TEXT, "output file").click()
    downloaded = eventually(lambda: _one_download(downloads), "the downloaded output file", 30)
    assert downloaded.read_bytes() == client.files.content(finished.output_file_id).content

    # Another batch, long enough to be cancelled from its page, through the confirmation form, before it ends.
    long_lines = [completion_line(f"long-{i}", f"Chapter {i}. It was a dark night", max_tokens=32) for i in range(200)]
    doomed_upload = client.files.create(file=("doomed.jsonl", jsonl(long_lines)), purpose="batch")
    doomed = client.batches.create(input_file_id=doomed_upload.id, endpoint="/v1/completions", completion_window="24h")
    browser.get(f"{root}/console/batches/{doomed.id}")
    browser.find_element(By.LINK_TEXT, "Cancel this batch…").click()
    browser.find_element(By.CSS_SELECTOR, "form.confirm button[type=submit]").click()
    eventually(lambda: browser.current_url.endswith(f"/console/batches/{doomed.id}"), "back on the batch's page", 30)
    assert wait_for(client, doomed.id).status == "cancelled"
    eventually(
        lambda: browser.find_element(By.ID, "batch-status").text == "cancelled", "the cancelled batch's status", 60
    )

    # The list, open while a third batch runs, shows it reach completed by its own polling too.
    listed_upload = client.files.create(file=("listed.jsonl", jsonl(lines[:2])), purpose="batch")
    listed = client.batches.create(input_file_id=listed_upload.id, endpoint="/v1/completions", completion_window="24h")
    browser.get(f"{root}/console/batches")
    browser.execute_script("window.__loadedOnce = true;")
    row_status = f"tr[data-batch={listed.id}] .status"
    eventually(lambda: browser.find_element(By.CSS_SELECTOR, row_status).text == "completed", "the listed batch done")
    assert browser.execute_script("return window.__loadedOnce === true;")
    rows = {row.get_attribute("data-batch") for row in browser.find_elements(By.CSS_SELECTOR, "tr[data-batch]")}
    assert {batch.id, doomed.id, listed.id} <= rows
    # Filtering by status keeps only the cancelled one.
    browser.save_screenshot(str(screenshots / "batches.png"))
    browser.find_element(By.TAG_NAME, "body").send_keys(Keys.TAB)  # the keyboard's first stop skips the menu
    assert browser.switch_to.active_element.text == "Skip to content"
    browser.find_element(By.CSS_SELECTOR, "#status option[value=cancelled]").click()
    browser.find_element(By.CSS_SELECTOR, "form.filter button").click()
    eventually(lambda: "status=cancelled" in browser.current_url, "the filtered list", 30)
    rows = {row.get_attribute("data-batch") for row in browser.find_elements(By.CSS_SELECTOR, "tr[data-batch]")}
    assert doomed.id in rows and batch.id not in rows

    # The webhook delivery of batch.completed, with its attempt.
    def delivery_shown() -> bool:
        browser.get(f"{root}/console/webhooks/{hook_id}")
        return any(batch.id in item.text and item.find_elements(By.CSS_SELECTOR, "tbody tr")
                   for item in browser.find_elements(By.CSS_SELECTOR, ".delivery"))

    eventually(delivery_shown, "the webhook delivery and its attempt", 60)
    assert "batch.completed" in browser.find_element(By.CSS_SELECTOR, ".deliveries").text
    browser.save_screenshot(str(screenshots / "webhook.png"))

    # The worker that ran it, with its engine's gauges.
    def worker_shown() -> bool:
        browser.get(f"{root}/console/workers")
        return bool(browser.find_elements(By.CSS_SELECTOR, ".worker svg polyline"))

    eventually(worker_shown, "the worker's gauges", 60)
    browser.save_screenshot(str(screenshots / "workers.png"))
    for page in ("files", "models", "schedules", "batches", f"batches/{batch.id}", "sign-in"):
        browser.get(f"{root}/console/{page}")
        assert not browser.execute_script(UNLABELLED_CONTROLS), page
        if "/" not in page:
            browser.save_screenshot(str(screenshots / f"{page}.png"))
    browser.set_window_size(390, 844)  # a phone
    browser.get(f"{root}/console/batches/{batch.id}")
    browser.save_screenshot(str(screenshots / "batch-phone.png"))
    assert browser.execute_script("return document.documentElement.scrollWidth <= window.innerWidth + 1;")
    browser.set_window_size(1280, 900)

    # A form posted without the session's CSRF token is refused, with the session's own cookie.
    cookies = {cookie["name"]: cookie["value"] for cookie in browser.get_cookies()}
    refused = httpx.post(f"{root}/console/files/{upload.id}/delete", cookies=cookies, data={})
    assert refused.status_code == 403
    assert client.files.retrieve(upload.id).id == upload.id

    # Another project's key sees none of it.
    sign_out(browser)
    sign_in(browser, root, other_key)
    browser.get(f"{root}/console/batches")
    assert batch.id not in browser.page_source and doomed.id not in browser.page_source
    for path in (f"batches/{batch.id}", f"webhooks/{hook_id}", f"files/{finished.output_file_id}/content"):
        browser.get(f"{root}/console/{path}")
        assert "Something is not right" in browser.page_source, path
    browser.get(f"{root}/console/files")
    assert upload.id not in browser.page_source
    browser.get(f"{root}/console/webhooks")
    assert hook_id not in browser.page_source
    sign_out(browser)


def _one_download(folder: Path) -> Path | None:
    """The finished download in `folder` (Chromium writes `.crdownload` until done)."""
    done = [path for path in folder.iterdir() if not path.name.endswith(".crdownload")]
    return done[0] if len(done) == 1 else None

