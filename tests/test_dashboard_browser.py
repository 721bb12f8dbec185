"""The dashboard in a real browser: ``sqla-queue dashboard`` started on a free port,
headless Chromium driven through chromedriver to filter jobs, requeue a dead letter,
cancel a pending job and every job a filter matches, run a schedule now, pause and
resume a queue and a schedule, set a queue's limit, requeue and delete every job a
filter matches, and be refused each kind of form without its token, the database
checked after each, a screenshot of every page.

CI installs Debian's ``chromium`` and ``chromium-driver`` (.ci/run) and fails this test
when they are missing; elsewhere it is skipped, saying what to install. Screenshots go
to the test's tmp dir, or to ``$SQLA_QUEUE_SCREENSHOTS`` when set (the docs' pictures).
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, func, insert, select, text
from sqlalchemy.orm import Session

from sqla_queue import Workflow, enqueue_workflow
from sqla_queue import sql as q
from sqla_queue.activity import RESOLUTIONS, due_range

from .helpers import Server, table_of, wait_for
from .models import (
    CHART_ACTIVITY,
    RESULT_WORKERS,
    SHARD_QUEUES,
    TASK_QUEUES,
    TASK_SCHEDULES,
    ChartJob,
    EmailJob,
    Order,
    ResultTask,
    ShardJob,
    StepTask,
    Task,
)

pytestmark = pytest.mark.system

pytest.importorskip("flask")

JOBS = table_of(EmailJob)
TASKS = table_of(Task)
STEPS = table_of(StepTask)
JOBS_OF_CHARTS = table_of(ChartJob)
REPO = Path(__file__).resolve().parent.parent
CHROMIUM = ("/usr/bin/chromium", "chromium")
CHROMEDRIVER = ("/usr/bin/chromedriver", "chromedriver")
INSTALL = "apt-get install -y chromium chromium-driver"


def _find(candidates: tuple[str, ...]) -> str | None:
    for name in candidates:
        found = shutil.which(name)
        if found:
            return found
    return None


def _need(what: str) -> None:
    """Missing browser: a failure in CI (it must run there), a skip that says why elsewhere."""
    message = f"the dashboard's browser test needs {what} ({INSTALL})"
    if os.environ.get("CI"):
        pytest.fail(message + "; CI must have it, so this fails rather than skips")
    pytest.skip(message)


@pytest.fixture
def browser() -> Iterator[Any]:
    chromium, driver_path = _find(CHROMIUM), _find(CHROMEDRIVER)
    if chromium is None:
        _need("Debian's chromium")
    if driver_path is None:
        _need("Debian's chromium-driver")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        _need("selenium (the test extra)")
    options = webdriver.ChromeOptions()
    options.binary_location = str(chromium)
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                     "--window-size=1400,1000", "--no-first-run", "--disable-extensions"):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # the console: CSP violations
    driver = webdriver.Chrome(service=Service(executable_path=str(driver_path)), options=options)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


@contextlib.contextmanager
def _dashboard_of(server: Server, *targets: str) -> Iterator[str]:
    """``sqla-queue dashboard TARGETS`` on a free port (``--port 0``); its address, once it
    listens."""
    url = server.url.render_as_string(hide_password=False)
    process = subprocess.Popen(
        [sys.executable, "-m", "sqla_queue", "dashboard", *targets, "--url", url, "--port", "0", "--api-actions"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        env={**os.environ, "SQLA_QUEUE_TEST_URL": url},
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()  # printed once the socket listens; EOF if it died
        assert line.startswith("sqla_queue dashboard on http://127.0.0.1:"), line
        yield line.split()[3]
    finally:
        process.terminate()
        process.wait(timeout=30)
        if process.stdout is not None:
            process.stdout.close()


@pytest.fixture
def dashboard(server: Server, engine: Engine) -> Iterator[str]:
    # The periodic app's worker: the schedules page knows its schedule (in the code).
    with _dashboard_of(server, "tests.models:ChartJob", "tests.models:EmailJob", "tests.models:Task",
                       "tests.models:ResultTask", "tests.models:StepTask", "tests.periodic_app:make_worker") as url:
        yield url


@pytest.fixture
def shots(tmp_path: Path) -> Path:
    folder = Path(os.environ.get("SQLA_QUEUE_SCREENSHOTS") or tmp_path / "screenshots")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def status_of(engine: Engine, key: int) -> str | None:
    with engine.connect() as conn:
        return conn.scalar(select(JOBS.c.status).where(JOBS.c.id == key))


def _flashed(browser: Any) -> str:
    """The flash message of the page an action led to, once that page is shown."""
    from selenium.webdriver.common.by import By

    wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, ".flash"), what="the flash message")
    return str(browser.find_element(By.CSS_SELECTOR, ".flash").text)


def _open_confirm(browser: Any, opener: str, confirm: str, what: str) -> None:
    """Click ``opener`` (a CSS selector), which leads to an action's confirm page; wait
    for that page's button (the id ``confirm``)."""
    from selenium.webdriver.common.by import By

    browser.find_element(By.CSS_SELECTOR, opener).click()
    wait_for(lambda: browser.find_elements(By.ID, confirm), what=what)


def _confirmed(browser: Any, confirm: str) -> str:
    """Click the confirm page's button (the id ``confirm``): the flash message after."""
    from selenium.webdriver.common.by import By

    browser.find_element(By.ID, confirm).click()
    return _flashed(browser)


def test_filter_requeue_and_cancel_in_a_real_browser(
    engine: Engine, dashboard: str, browser: Any, shots: Path
) -> None:
    from selenium.common.exceptions import NoAlertPresentException
    from selenium.webdriver.common.by import By

    xss = "<script>alert('x')</script>"
    with engine.begin() as conn:
        conn.execute(insert(table_of(Order)).values(id=1, customer="ann"))
        keys = {}
        specs: dict[str, dict[str, Any]] = {
            "mail_pending": {"queue": "mail"},
            "mail_other": {"queue": "mail", "run_after": func.now() - timedelta(minutes=3)},
            "sms_pending": {"queue": "sms"},
            "dead": {"queue": "mail", "status": "failed", "attempts": 20, "order_id": 1, "recipient": xss,
                     "last_error": "Traceback (most recent call last):\n  ...\n" + xss + "\nSMTPError: 550 refused",
                     "finished_at": func.now()},
            "running": {"queue": "mail", "status": "running", "attempts": 1, "lease_owner": "web-1:4242:1a2b3c4d/0",
                        "lease_expires_at": func.now() + timedelta(seconds=45)},
        }
        for name, values in specs.items():
            keys[name] = conn.execute(insert(JOBS).values(**values).returning(JOBS.c.id)).scalar_one()
        conn.execute(insert(JOBS).values(queue="mail", status="done", finished_at=func.now()), [{}] * 12)
        now: datetime = conn.execute(select(func.now())).scalar_one()
        conn.execute(insert(JOBS), [  # a minute each over the last twenty: the charts' lines
            {"queue": "mail", "status": "done", "finished_at": now - timedelta(minutes=i, seconds=10),
             "started_at": now - timedelta(minutes=i, seconds=10.3 + 0.05 * i),
             "run_after": now - timedelta(minutes=i, seconds=10.4 + 0.07 * i),
             "created_at": now - timedelta(minutes=i, seconds=10.4 + 0.07 * i)} for i in range(20)
        ])
        conn.execute(insert(JOBS).values(queue="sms", status="done", finished_at=func.now() - timedelta(minutes=20)),
                     [{}] * 5)
        conn.execute(insert(TASKS).values(task="render", payload={"html": xss, "blob": "z" * 5000}, queue="pdf"))
    _recorded_activity(engine)

    def page(path: str, shot: str) -> None:
        browser.get(dashboard.rstrip("/") + path)
        wait_for(lambda: browser.execute_script("return document.readyState") == "complete", what=path)
        with pytest.raises(NoAlertPresentException):  # no payload's script ran
            browser.switch_to.alert  # noqa: B018 - the property raises when there is none
        browser.save_screenshot(str(shots / f"{shot}.png"))

    def shown() -> list[int]:
        return [int(row.get_attribute("data-id")) for row in browser.find_elements(By.CSS_SELECTOR, "tr[data-id]")]

    page("/", "overview")
    for chart in ("finished", "waiting", "pickup", "run"):  # the activity table's, every chart drawn
        assert browser.find_elements(By.CSS_SELECTOR, f'section[data-queue="emails"] .chart-{chart} svg '
                                                      ":is(rect.done, polyline)"), chart
    assert browser.find_element(By.CSS_SELECTOR, 'section[data-queue="mail"] .chart-finished svg rect.done')
    for chart in ("pickup", "run"):  # p50 and p99 lines, drawn on the server
        assert len(browser.find_elements(By.CSS_SELECTOR, f'section[data-queue="mail"] .chart-{chart} polyline')) == 2
    assert not browser.find_elements(By.ID, "live")  # live refresh off: no script
    page("/?window=24h", "overview-24h")
    assert len(browser.find_elements(By.CSS_SELECTOR, 'section[data-queue="mail"] .chart-finished svg g')) == 96

    # live refresh: a link turns it on (every second here), the counts follow the table
    browser.get(dashboard.rstrip("/") + "/?live=1")
    assert browser.find_element(By.CSS_SELECTOR, "a.live-on").get_attribute("href").endswith("live=5")

    def sms_pending() -> str:
        # Read in one call: live refresh may replace the element between a find and a read.
        return str(browser.execute_script(
            "return document.querySelector('section[data-queue=\"sms\"] .count-pending a').textContent"))

    assert sms_pending() == "1"
    with engine.begin() as conn:
        conn.execute(insert(JOBS).values(queue="sms"))
    wait_for(lambda: sms_pending() == "2", timeout=15, what="the live refresh to show the new job")
    assert browser.execute_script("return document.getElementById('live-status').textContent").startswith("updated")
    browser.find_element(By.ID, "live-off").click()
    wait_for(lambda: "live=" not in browser.current_url, what="live refresh turned off")
    assert not browser.find_elements(By.ID, "live")
    refused = [e["message"] for e in browser.get_log("browser") if "Content Security Policy" in e["message"]]
    assert refused == []

    # filter: queue mail, status pending
    page("/email_jobs/jobs", "jobs")
    queue = browser.find_element(By.NAME, "queue")
    queue.clear()
    queue.send_keys("mail")
    browser.find_element(By.CSS_SELECTOR, 'input[name="status"][value="pending"]').click()
    browser.find_element(By.ID, "apply-filters").click()
    wait_for(lambda: "status=pending" in browser.current_url, what="the filtered page")
    assert sorted(shown()) == sorted([keys["mail_pending"], keys["mail_other"]])
    browser.save_screenshot(str(shots / "jobs-filtered.png"))

    # cancel one pending job from the filtered list
    browser.find_element(By.CSS_SELECTOR, f'input[name="id"][value="{keys["mail_pending"]}"]').click()
    browser.find_element(By.ID, "cancel-selected").click()
    assert "cancelled 1 of 1" in _flashed(browser)
    assert status_of(engine, keys["mail_pending"]) == "cancelled"
    assert status_of(engine, keys["mail_other"]) == "pending"
    assert "status=pending" in browser.current_url  # back on the filtered page
    assert keys["mail_pending"] not in shown()

    # cancel every job the filter still matches: the count first, then the confirm
    _open_confirm(browser, "#bulk-cancel", "bulk-confirm", "the bulk action's confirm page")
    assert "1 job(s) match the filter" in browser.find_element(By.ID, "bulk-count").text
    assert status_of(engine, keys["mail_other"]) == "pending"  # counting changed nothing
    browser.save_screenshot(str(shots / "bulk-confirm.png"))
    assert "cancelled 1 job(s) matching the filter" in _confirmed(browser, "bulk-confirm")
    assert status_of(engine, keys["mail_other"]) == "cancelled"
    assert status_of(engine, keys["sms_pending"]) == "pending"  # another queue: not in the filter
    assert shown() == []

    # requeue the dead letter from the dead-letter page
    page("/email_jobs/dead", "dead-letters")
    assert shown() == [keys["dead"]]
    browser.find_element(By.CSS_SELECTOR, f'input[name="id"][value="{keys["dead"]}"]').click()
    browser.find_element(By.ID, "requeue-selected").click()
    assert "requeued 1 of 1" in _flashed(browser)
    with engine.connect() as conn:
        row = conn.execute(select(JOBS.c.status, JOBS.c.attempts).where(JOBS.c.id == keys["dead"])).one()
    assert (row.status, row.attempts) == ("pending", 0)
    assert shown() == []

    # the job's page: every column, the error in full and escaped
    page(f"/email_jobs/job/{keys['dead']}", "job")
    assert xss in browser.find_element(By.ID, "last-error").text  # shown as text, not run
    assert "SMTPError: 550 refused" in browser.find_element(By.ID, "last-error").text
    names = [dt.text for dt in browser.find_elements(By.CSS_SELECTOR, "dl.kv dt")]
    assert {"recipient", "order_id", "lease_owner", "attempts"} <= set(names)

    page("/tasks/job/1", "job-payload")
    assert browser.find_element(By.CSS_SELECTOR, "a.full-value")

    page("/email_jobs/workers", "workers")
    assert "web-1:4242:1a2b3c4d" in browser.find_element(By.ID, "running").text  # its running jobs' owner
    assert browser.find_element(By.ID, "listening")  # and the live workers' table above it

    # the schedules page: the code's schedule and a row only, run now through its confirm page
    with engine.begin() as conn:
        conn.execute(q.claim_schedule_tick(Task, schedule=f"gone {xss}", tick=datetime(2026, 1, 1, tzinfo=UTC)))
    page("/tasks/schedules", "schedules")
    rows = {row.get_attribute("data-schedule"): row.text
            for row in browser.find_elements(By.CSS_SELECTOR, "#schedules tr[data-schedule]")}
    assert set(rows) == {"beat", f"gone {xss}"} and "every 1s" in rows["beat"]
    _open_confirm(browser, 'tr[data-schedule="beat"] a.run-now', "run-now", "the run now's confirm page")
    assert "ran schedule beat now" in _confirmed(browser, "run-now")
    with engine.connect() as conn:
        (beat,) = conn.execute(select(TASKS).where(TASKS.c.task == "beat")).all()
        last = conn.scalar(select(TASK_SCHEDULES.c.last_tick).where(TASK_SCHEDULES.c.name == "beat"))
    assert last == beat.run_after  # the watermark moved to the run's moment
    browser.save_screenshot(str(shots / "schedules-ran.png"))

    _a_workflow_its_jobs_and_its_cancel(engine, dashboard, browser, shots)


def _a_workflow_its_jobs_and_its_cancel(engine: Engine, dashboard: str, browser: Any, shots: Path) -> None:
    """The workflow page's picture and list, a box's link to its job, the job's links to
    its parents and its workflow, and the workflow's cancel through its confirm page."""
    from selenium.common.exceptions import NoAlertPresentException
    from selenium.webdriver.common.by import By

    flow = Workflow(on_parent_failure="hold")
    fetch = flow.add(StepTask(task="fetch", payload={"url": "https://example.com/feed"}))
    parts = [flow.add(StepTask(task="parse", payload={"part": n}), after=[fetch]) for n in range(4)]
    merge = flow.add(StepTask(task="merge", payload={}), after=parts)
    report = flow.add(StepTask(task="report", payload={}), after=[merge])
    notify = flow.add(StepTask(task="notify", payload={}), after=[merge])
    flow.add(StepTask(task="archive", payload={}), after=[report, notify])
    with Session(engine, expire_on_commit=False) as session:
        enqueue_workflow(session, flow)
        session.commit()
    with engine.begin() as conn:  # fetch done; two parts done, one failed (its error has markup), one running
        (root,) = conn.execute(q.claim(StepTask, owner="web-1:1:a/0", limit=1, lease=60)).all()
        conn.execute(q.complete_if_owner(StepTask, owner="web-1:1:a/0", tokens=[(root.id, root.attempts)]))
    with engine.begin() as conn:
        claimed = {r.id: r for r in conn.execute(q.claim(StepTask, owner="web-1:1:a/0", limit=4, lease=60)).all()}
        done = [(claimed[p.id].id, claimed[p.id].attempts) for p in parts[:2]]
        conn.execute(q.complete_if_owner(StepTask, owner="web-1:1:a/0", tokens=done))
        failed = claimed[parts[2].id]
        conn.execute(q.fail_if_owner(StepTask, owner="web-1:1:a/0", token=(failed.id, failed.attempts),
                                     error="Traceback ...\nValueError: <img src=x onerror=alert('x')>"))
    browser.get(f"{dashboard.rstrip('/')}/step_tasks/workflow/{flow.id}")
    wait_for(lambda: browser.execute_script("return document.readyState") == "complete", what="the workflow page")
    with pytest.raises(NoAlertPresentException):  # no error's markup ran
        browser.switch_to.alert  # noqa: B018 - the property raises when there is none
    browser.save_screenshot(str(shots / "workflow.png"))
    boxes = browser.find_elements(By.CSS_SELECTOR, "#workflow-graph a.box")
    assert len(boxes) == 9 and len(browser.find_elements(By.CSS_SELECTOR, "#workflow-graph path.edge")) == 12
    assert "ValueError: <img src=x" in browser.find_element(By.ID, "workflow-jobs").text
    browser.find_element(By.CSS_SELECTOR, f'#workflow-graph a.box[data-job="{merge.id}"]').click()
    wait_for(lambda: browser.find_elements(By.ID, "workflow-link"), what="the job's page")
    assert browser.find_element(By.ID, "waiting-on").text == "waiting on 2 of 4 job(s)"
    browser.save_screenshot(str(shots / "job-workflow.png"))
    parents = browser.find_element(By.ID, "parents").text
    assert "failed" in parents and "running" in parents and "9999" not in browser.page_source
    browser.find_element(By.CSS_SELECTOR, f'#parents a.parent[data-id="{parts[2].id}"]').click()
    wait_for(lambda: browser.current_url.endswith(f"/step_tasks/job/{parts[2].id}"), what="the parent's page")
    browser.find_element(By.ID, "workflow-link").click()
    wait_for(lambda: browser.find_elements(By.ID, "cancel-workflow"), what="the workflow page")
    _open_confirm(browser, "#cancel-workflow", "cancel-workflow-confirm", "the cancel's confirm page")
    assert "cancelled 5 job(s) of workflow" in _confirmed(browser, "cancel-workflow-confirm")
    with engine.connect() as conn:
        counted = select(STEPS.c.status, func.count()).where(STEPS.c.workflow_id == flow.id).group_by(STEPS.c.status)
        found: dict[str, int] = {row[0]: row[1] for row in conn.execute(counted).all()}
    assert found == {"done": 3, "failed": 1, "cancelled": 5}


def test_pauses_limits_schedules_and_bulk_requeue_and_delete_in_a_real_browser(
    engine: Engine, server: Server, browser: Any, shots: Path
) -> None:
    """The actions the first test leaves out, each clicked in the browser and checked in
    the database: a queue paused and resumed from the overview, a queue's own limit set,
    a schedule paused and resumed, every dead letter a filter matches requeued and every
    job another filter matches deleted, each through its count and confirm. Each kind of
    form, its token removed in the page, is refused and changes nothing."""
    from selenium.webdriver.common.by import By

    with engine.begin() as conn:
        conn.execute(insert(TASKS).values(task="render", queue="pdf"))
        conn.execute(insert(table_of(ShardJob)).values(queue="shards", account="a"))
        dead = [conn.execute(insert(TASKS).values(task="t", queue=queue, status="failed", attempts=3,
                                                  last_error="boom", finished_at=func.now()).returning(TASKS.c.id))
                .scalar_one() for queue in ("mail", "mail", "sms")]
        old = conn.execute(insert(TASKS).values(task="t", queue="old", status="done", finished_at=func.now())
                           .returning(TASKS.c.id)).scalar_one()

    def go(path: str) -> None:
        browser.get(root + path)
        wait_for(lambda: browser.execute_script("return document.readyState") == "complete", what=path)

    def forged(form_selector: str, button_selector: str) -> None:
        """Submit a form of the page with its token taken out: a 400 that says CSRF."""
        browser.execute_script(f"document.querySelector('{form_selector} [name=csrf_token]').remove()")
        browser.find_element(By.CSS_SELECTOR, button_selector).click()
        wait_for(lambda: "CSRF" in browser.page_source, what="the refusal")

    def queue_row(table: Any, queue: str) -> Any:
        with engine.connect() as conn:
            return conn.execute(select(table).where(table.c.queue == queue)).one_or_none()

    def schedule_paused() -> bool:
        with engine.connect() as conn:
            return conn.scalar(select(TASK_SCHEDULES.c.paused_at).where(TASK_SCHEDULES.c.name == "beat")) is not None

    with _dashboard_of(server, "tests.models:ShardJob", "tests.periodic_app:make_worker") as url:
        root = url.rstrip("/")
        # a queue paused and resumed from the overview; the pause's form refused without its token
        go("/")
        forged('section[data-queue="pdf"] form.pause', 'section[data-queue="pdf"] form.pause button')
        assert queue_row(TASK_QUEUES, "pdf") is None
        go("/")
        browser.find_element(By.CSS_SELECTOR, 'section[data-queue="pdf"] form.pause button[value="pause"]').click()
        assert "paused queue pdf" in _flashed(browser)
        assert queue_row(TASK_QUEUES, "pdf").paused_at is not None
        assert browser.find_element(By.CSS_SELECTOR, 'section[data-queue="pdf"] .badge.paused')
        browser.save_screenshot(str(shots / "overview-paused.png"))
        browser.find_element(By.CSS_SELECTOR, 'section[data-queue="pdf"] form.pause button[value="resume"]').click()
        assert "resumed queue pdf" in _flashed(browser)
        assert queue_row(TASK_QUEUES, "pdf").paused_at is None

        # a queue's own limit, then back to the model's
        limits = 'div[data-limits-queue="shards"] form.limit'
        browser.find_element(By.CSS_SELECTOR, f'{limits} input[name="concurrency"]').send_keys("2")
        browser.find_element(By.CSS_SELECTOR, f"{limits} button").click()
        assert "limits of queue shards: concurrency 2" in _flashed(browser)
        assert queue_row(SHARD_QUEUES, "shards").concurrency == 2
        assert "the queue's own; the model's 4" in browser.find_element(
            By.CSS_SELECTOR, 'div[data-limits-queue="shards"]').text
        browser.find_element(By.CSS_SELECTOR, f'{limits} input[name="concurrency"]').clear()
        browser.find_element(By.CSS_SELECTOR, f"{limits} button").click()
        assert "concurrency the model default" in _flashed(browser)
        assert queue_row(SHARD_QUEUES, "shards").concurrency is None

        # a schedule paused and resumed; its form refused without its token
        go("/tasks/schedules")
        forged('tr[data-schedule="beat"] form.pause', 'tr[data-schedule="beat"] .pause-schedule')
        assert not schedule_paused()
        go("/tasks/schedules")
        browser.find_element(By.CSS_SELECTOR, 'tr[data-schedule="beat"] .pause-schedule').click()
        assert "paused schedule beat" in _flashed(browser)
        assert schedule_paused()
        browser.save_screenshot(str(shots / "schedules-paused.png"))
        browser.find_element(By.CSS_SELECTOR, 'tr[data-schedule="beat"] .resume-schedule').click()
        assert "resumed schedule beat" in _flashed(browser)
        assert not schedule_paused()

        # every dead letter of queue mail requeued; the confirm refused without its token first
        go("/tasks/jobs?queue=mail&status=failed")
        _open_confirm(browser, "#bulk-requeue", "bulk-confirm", "the requeue's confirm page")
        assert "2 job(s) match the filter" in browser.find_element(By.ID, "bulk-count").text
        forged("form.actions", "#bulk-confirm")
        assert status_of_task(engine, dead) == ["failed", "failed", "failed"]
        go("/tasks/jobs?queue=mail&status=failed")
        _open_confirm(browser, "#bulk-requeue", "bulk-confirm", "the requeue's confirm page")
        assert "requeued 2 job(s) matching the filter" in _confirmed(browser, "bulk-confirm")
        assert status_of_task(engine, dead) == ["pending", "pending", "failed"]

        # every job of queues sms and old deleted, whatever its status
        go("/tasks/jobs?queue=sms,old")
        _open_confirm(browser, "#bulk-delete", "bulk-confirm", "the delete's confirm page")
        assert "2 job(s) match the filter" in browser.find_element(By.ID, "bulk-count").text
        assert "deleted 2 job(s) matching the filter" in _confirmed(browser, "bulk-confirm")
        assert status_of_task(engine, [dead[2], old]) == []
        assert status_of_task(engine, dead[:2]) == ["pending", "pending"]  # other queues untouched
    refused = [e["message"] for e in browser.get_log("browser") if "Content Security Policy" in e["message"]]
    assert refused == []


def status_of_task(engine: Engine, keys: list[int]) -> list[str]:
    """The statuses of those of ``keys`` still in the task table, in ``keys``' order."""
    with engine.connect() as conn:
        found: dict[int, str] = dict(conn.execute(select(TASKS.c.id, TASKS.c.status).where(TASKS.c.id.in_(keys))).all())
    return [found[k] for k in keys if k in found]


def _recorded_activity(engine: Engine) -> None:
    """An hour of jobs of chart_jobs (two queues, a busy spell, a slow one), recorded in
    its activity table with the workers' statement, and the jobs waiting as its workers
    counted them each minute: the overview's screenshot."""
    with engine.begin() as conn:
        conn.execute(text(
            "INSERT INTO chart_jobs (queue, status, attempts, run_after, created_at, started_at, finished_at) "
            "SELECT queue, CASE WHEN i % 23 = 0 THEN 'failed' ELSE 'done' END, 1, "
            "       fin - ran - waited, fin - ran - waited, fin - ran, fin "
            "FROM (SELECT i, CASE WHEN i % 3 = 0 THEN 'reports' ELSE 'emails' END AS queue, "
            "             now() - (i * 3.1) * interval '1 second' AS fin, "
            "             (0.05 + (i % 7) * 0.04 + CASE WHEN i % 50 = 0 THEN 2.5 ELSE 0 END) "
            "               * interval '1 second' AS ran, "
            "             (0.02 + (i % 5) * 0.01 + CASE WHEN i BETWEEN 300 AND 420 THEN 1.5 ELSE 0 END) "
            "               * interval '1 second' AS waited "
            "      FROM generate_series(1, 1150) AS i) AS jobs"
        ))
        conn.execute(insert(JOBS_OF_CHARTS), [{"queue": "emails"}] * 6)
        now, *marks = conn.execute(q.activity_marks(ChartJob)).one()
        for resolution, mark in zip(RESOLUTIONS, marks, strict=True):
            while (due := due_range(now, mark, resolution)) is not None:
                since, until, sample = due
                conn.execute(q.record_activity(ChartJob, seconds=resolution.seconds), {
                    q.ACTIVITY_SINCE_PARAM: since, q.ACTIVITY_UNTIL_PARAM: until, q.ACTIVITY_SAMPLE_PARAM: sample})
                mark = until - timedelta(seconds=resolution.seconds)
        activity = CHART_ACTIVITY.c
        conn.execute(CHART_ACTIVITY.update().where(activity.queue == "emails", activity.waiting.is_(None)).values(
            waiting=func.round(4 + 3 * func.sin(func.date_part("epoch", activity.bucket) / 400))))


def test_a_missing_browser_fails_in_ci_and_is_skipped_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI must have it, so this fails rather than skips"):
        _need("Debian's chromium")
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception, match=r"apt-get install -y chromium chromium-driver"):
        _need("Debian's chromium")


def test_a_job_s_result_progress_and_attempts_in_a_real_browser(
    engine: Engine, dashboard: str, browser: Any, shots: Path
) -> None:
    from selenium.common.exceptions import NoAlertPresentException
    from selenium.webdriver.common.by import By

    xss = "<img src=x onerror=alert('x')>"
    history = [
        {"attempt": 1, "outcome": "retried", "worker": "web-1:4242:1a2b3c4d/0.0", "started_at": "2026-12-07T10:00:00",
         "seconds": 0.25, "error": f"builtins.ValueError: {xss}\n...\n  File \"app.py\", line 3"},
        {"attempt": 2, "outcome": "done", "worker": "web-1:4242:1a2b3c4d/0.1", "started_at": "2026-12-07T10:00:01",
         "seconds": 1.5, "error": None},
    ]
    results = table_of(ResultTask)
    with engine.begin() as conn:
        key = conn.execute(insert(results).values(
            task="report", payload={}, status="done", attempts=2, finished_at=func.now(),
            result={"total": 42, "note": xss}, progress={"pages": 5}, history=history,
        ).returning(results.c.id)).scalar_one()
    browser.get(f"{dashboard.rstrip('/')}/result_tasks/job/{key}")
    wait_for(lambda: browser.execute_script("return document.readyState") == "complete", what="the job's page")
    with pytest.raises(NoAlertPresentException):  # no value's markup ran
        browser.switch_to.alert  # noqa: B018 - the property raises when there is none
    browser.save_screenshot(str(shots / "job-result.png"))
    assert xss in browser.find_element(By.ID, "result-value").text and '"total": 42' in browser.find_element(
        By.ID, "result-value").text
    assert '"pages": 5' in browser.find_element(By.ID, "progress-value").text
    rows = browser.find_elements(By.CSS_SELECTOR, "#attempts tbody tr")
    assert [r.find_elements(By.TAG_NAME, "td")[1].text for r in rows] == ["done", "retried"]
    assert xss in rows[1].text and "web-1:4242:1a2b3c4d/0.0" in rows[1].text
    assert not browser.find_elements(By.CSS_SELECTOR, "img[src='x']")

    with engine.begin() as conn:  # an idle worker, as the workers table records it
        conn.execute(insert(RESULT_WORKERS).values(
            name="web-2:77:9f9f9f9f", host=xss, pid=77, concurrency=4, runtime="asyncio", version="0.1.0"))
    browser.get(f"{dashboard.rstrip('/')}/result_tasks/workers")
    wait_for(lambda: browser.execute_script("return document.readyState") == "complete", what="the workers page")
    with pytest.raises(NoAlertPresentException):
        browser.switch_to.alert  # noqa: B018 - the property raises when there is none
    browser.save_screenshot(str(shots / "workers-recorded.png"))
    recorded = browser.find_element(By.CSS_SELECTOR, '#recorded tr[data-worker="web-2:77:9f9f9f9f"]').text
    assert "live" in recorded and "asyncio" in recorded and xss in recorded

    # The JSON API: its token, readable by the dashboard's own origin, is out of reach of
    # a page of another origin, even one of the same site (another port of this machine,
    # to which the browser sends the session cookie).
    browser.get(f"{dashboard.rstrip('/')}/api/csrf")
    token = json.loads(browser.find_element(By.TAG_NAME, "body").text)["csrf_token"]
    with _another_origin() as elsewhere:
        browser.get(elsewhere)
        read = browser.execute_async_script(_FETCH, f"{dashboard.rstrip('/')}/api/csrf", "GET", None, None, None)
        assert read.startswith("blocked") and token not in read, read
        # Even a page that knew the token: its JSON POST needs a preflight, which the API
        # refuses; a simple POST carries its own Origin, which the dashboard refuses.
        action = f"{dashboard.rstrip('/')}/api/tables/result_tasks/actions/cancel"
        pending = _pending_result_task(engine)
        for content_type in ("application/json", "text/plain"):
            sent = browser.execute_async_script(_FETCH, action, "POST", content_type, token, {"ids": [pending]})
            assert token not in sent, sent
        assert _status(engine, pending) == "pending"


#: Run in a page by execute_async_script: fetch(url) with the browser's cookies; calls
#: back "read <body>" or "blocked <error>" (a response a page of another origin may not read).
_FETCH = """
const [url, method, type, token, body, done] = arguments;
const init = {method, credentials: "include"};
if (method === "POST") {
  init.body = JSON.stringify(body);
  init.headers = {"Content-Type": type, "X-CSRF-Token": token};
  if (type !== "application/json") { init.mode = "no-cors"; delete init.headers["X-CSRF-Token"]; }
}
fetch(url, init).then(r => r.text()).then(t => done("read " + t), e => done("blocked " + e));
"""


@contextlib.contextmanager
def _another_origin() -> Iterator[str]:
    """A page served by another port of this machine: another origin, the same site."""

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b"<!doctype html><title>elsewhere</title><p>another origin"
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def _pending_result_task(engine: Engine) -> int:
    results = table_of(ResultTask)
    with engine.begin() as conn:
        return int(conn.execute(insert(results).values(task="t", payload={}).returning(results.c.id)).scalar_one())


def _status(engine: Engine, key: int) -> str | None:
    results = table_of(ResultTask)
    with engine.connect() as conn:
        return conn.scalar(select(results.c.status).where(results.c.id == key))
