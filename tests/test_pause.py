"""Pausing a queue: ``pause()``/``resume()`` in the caller's transaction, the claims of
every shape skipping a paused queue, workers of both runtimes and every queue setting,
the command line and the dashboard.

The tasks table has a queues table (``TASK_QUEUES`` in the models); the email table has
none, so its claims are the plain ones and a pause of its queues is refused.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, func, select, text
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.orm import DeclarativeBase, Session, sessionmaker

from sqla_queue import (
    EnqueueError,
    JobMixin,
    QueueSession,
    QueuesTableNotDeclared,
    WorkerStartError,
    pause,
    queues_table,
    resume,
)
from sqla_queue import sql as q
from sqla_queue.cli import main
from sqla_queue.model import notify_channel

from .helpers import SENTINEL_CHANNEL, Server, notifications, notifications_until_sentinel, table_of, wait_for
from .models import TASK_QUEUES, EmailJob, Task
from .workers import TASKS, all_status, job, status_is

SERVED = [None, ("b",), ("b", "c", "d")]
IDS = ["all queues", "one queue", "three queues"]
JOBS = table_of(EmailJob)


def enqueue(engine: Engine, queue: str, n: int = 1, **options: Any) -> list[int]:
    payload = options.pop("payload", {})
    with sessionmaker(engine, class_=QueueSession)() as session:
        jobs = [session.enqueue(Task(task="work", payload=dict(payload)), queue=queue, **options) for _ in range(n)]
        session.commit()
        return [j.id for j in jobs]


def untouched(engine: Engine, ids: list[int]) -> bool:
    with engine.connect() as conn:
        found = conn.execute(select(TASKS.c.status, TASKS.c.attempts).where(TASKS.c.id.in_(ids))).all()
    return len(found) == len(ids) and all(row == ("pending", 0) for row in found)


def paused_now(engine: Engine) -> dict[str, Any]:
    with engine.connect() as conn:
        return dict(conn.execute(q.paused_queues(Task)).all())


# -- pause() and resume() ----------------------------------------------------------------


def test_queues_table_is_one_per_queue_table_in_its_metadata() -> None:
    assert queues_table(Task) is TASK_QUEUES
    assert TASK_QUEUES.name == "tasks_queues" and TASK_QUEUES.metadata is TASKS.metadata
    assert list(TASK_QUEUES.primary_key.columns.keys()) == ["queue"]


def test_pause_and_resume_say_whether_they_changed_anything(engine: Engine) -> None:
    with Session(engine) as session:
        assert pause(session, Task, "b") is True
        assert pause(session, Task, "b") is False  # paused already, in this same transaction
        session.commit()
    assert list(paused_now(engine)) == ["b"]
    with engine.begin() as conn:
        assert resume(conn, Task, "b") is True
        assert resume(conn, Task, "b") is False
        assert resume(conn, Task, "never-paused") is False
    assert paused_now(engine) == {}


def test_a_pause_rolled_back_never_happened(engine: Engine) -> None:
    with Session(engine) as session:
        pause(session, Task, "b")
        session.rollback()
    assert paused_now(engine) == {}


def test_resume_wakes_the_queues_workers_with_the_commit_only(engine: Engine, server: Server, listener: Any) -> None:
    channel = notify_channel(TASKS)
    listener.execute(f'LISTEN "{channel}"')
    listener.execute(f'LISTEN "{SENTINEL_CHANNEL}"')
    with engine.begin() as conn:
        pause(conn, Task, "b")
    with Session(engine) as session:
        resume(session, Task, "b")
        assert notifications_until_sentinel(listener, server.conninfo) == []  # nothing before the commit
        session.rollback()
    assert notifications_until_sentinel(listener, server.conninfo) == []  # nor on a rollback
    with Session(engine) as session:
        resume(session, Task, "b")
        session.commit()
    assert notifications(listener, 5) == [(channel, "b")]


def test_async_pause_and_resume(server: Server, engine: Engine) -> None:
    async def go() -> tuple[bool, bool]:
        async_engine = create_async_engine(server.url)
        try:
            async with async_engine.begin() as conn:
                paused = await pause(conn, Task, "b")
            from sqlalchemy.ext.asyncio import AsyncSession

            async with AsyncSession(async_engine) as session:
                assert list(paused_now(engine)) == ["b"]
                resumed = await resume(session, Task, "b")
                await session.commit()
            return paused, resumed
        finally:
            await async_engine.dispose()

    assert asyncio.run(go()) == (True, True)
    assert paused_now(engine) == {}


def test_bad_calls_are_refused_before_anything_is_written(engine: Engine) -> None:
    with Session(engine) as session:
        with pytest.raises(QueuesTableNotDeclared, match=r"queues_table\(EmailJob\)"):
            pause(session, EmailJob, "mail")
        with pytest.raises(QueuesTableNotDeclared):
            resume(session, EmailJob, "mail")
        for queue in ("", None, 3, "sqla_queue.x"):
            with pytest.raises(EnqueueError):
                pause(session, Task, queue)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="needs a Session or a Connection"):
            pause(engine, Task, "b")  # type: ignore[call-overload]
        assert not session.in_transaction() or session.connection().in_transaction()
        session.commit()  # the caller's transaction was left usable
    assert paused_now(engine) == {}


# -- the claims --------------------------------------------------------------------------


@pytest.mark.parametrize("queues", [None, ("x",), ("b", "x"), ("x", "b")], ids=["all", "one", "two", "two reversed"])
@pytest.mark.parametrize("isolated", [False, True], ids=["batch", "isolated"])
def test_no_claim_takes_a_paused_queues_jobs(engine: Engine, queues: tuple[str, ...] | None, isolated: bool) -> None:
    """Each shape of the claim (the statement the worker runs, values bound): the paused
    queue's jobs, first in priority, are passed over; the others are claimed."""
    paused = enqueue(engine, "x", 3, priority=10)
    others = enqueue(engine, "b", 2)
    with engine.begin() as conn:
        conn.execute(q.pause_queue(Task, "x"))
        conn.execute(TASKS.update().values(isolated=isolated))
    with engine.begin() as conn:
        claim = q.claim(Task, owner="me", limit=10, queues=queues, isolated=isolated)
        claimed = [row.id for row in conn.execute(claim)]
        waiting = conn.scalar(q.isolated_waiting(Task, queues=queues))
    if queues == ("x",):
        assert claimed == [] and not waiting
    else:
        assert set(claimed) <= set(others) and len(claimed) == (1 if isolated else 2)
        assert bool(waiting) == (isolated and len(claimed) < len(others))
    assert untouched(engine, paused)
    with engine.connect() as conn:
        candidates = list(conn.scalars(q.claim_candidates(Task, queues=queues, isolated=isolated), {
            q.LIMIT_PARAM: 10, q.SKIP_PARAM: []}))
    assert not set(candidates) & set(paused)


def test_a_paused_queues_backlog_is_not_read_by_a_claim_of_named_queues(engine: Engine) -> None:
    """With the queue known before the scan, the pause is tested once (a one-time
    filter): the paused queue's index range is never scanned."""
    enqueue(engine, "x", 50)
    enqueue(engine, "b", 1)
    with engine.begin() as conn:
        conn.execute(q.pause_queue(Task, "x"))
    for queues in (("x",), ("b", "x")):
        compiled = q.claim(Task, owner="me", limit=5, queues=queues).compile(dialect=engine.dialect)
        with engine.connect() as conn:
            plan = "\n".join(conn.exec_driver_sql(
                "EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF) " + compiled.string, compiled.construct_params()
            ).scalars())
            conn.rollback()
        assert "One-Time Filter" in plan, plan
        scanned = [int(n) for n in re.findall(r"Index Scan using tasks_claim_queue_idx .*actual rows=(\d+)", plan)]
        assert sum(scanned) <= 1, plan  # the one job of "b" at most, none of the 50 of "x"


def test_next_run_after_leaves_out_paused_queues(engine: Engine) -> None:
    enqueue(engine, "x", 1, delay=30)
    (soon,) = enqueue(engine, "b", 1, delay=60)
    with engine.begin() as conn:
        conn.execute(q.pause_queue(Task, "x"))
    with engine.connect() as conn:
        seconds = conn.scalar(q.next_run_after(Task))
        assert seconds is not None and 40 < seconds <= 60
        assert conn.scalar(q.next_run_after(Task, queues=["x"])) is None
    assert job(engine, soon).status == "pending"


def test_a_table_without_a_queues_table_claims_as_before() -> None:
    assert "_queues" not in str(q.claim(EmailJob, owner="me", queues=("a", "b")))
    assert "tasks_queues" in str(q.claim(Task, owner="me", queues=("a", "b")))


# -- workers -----------------------------------------------------------------------------


def _served(queues: tuple[str, ...] | None) -> tuple[str, ...]:
    return queues if queues is not None else ("b", "x")


@pytest.mark.parametrize("queues", SERVED, ids=IDS)
def test_a_worker_runs_nothing_of_a_paused_queue_until_it_is_resumed(
    engine: Engine, start_worker: Any, queues: tuple[str, ...] | None
) -> None:
    """A paused served queue's jobs, ahead in priority and enqueued first, stay pending
    while a later job of another served queue runs; resumed, they run at once: the
    worker polls once a minute, so the resume's wake-up is what starts them."""
    served = _served(queues)
    held, other = served[-1], served[0] if len(served) > 1 else None
    with engine.begin() as conn:
        pause(conn, Task, held)
    start_worker(queues=queues, poll_interval=60.0)
    paused_ids = enqueue(engine, held, 3, priority=10)
    if other is not None:
        ran = enqueue(engine, other, 2)
        wait_for(all_status(engine, ran, "done"), what="the other queue's jobs done")
        more = enqueue(engine, held, 1, priority=10) + enqueue(engine, other, 1)  # claimed by the cursor now
        wait_for(status_is(engine, more[-1], "done"), what="the other queue's next job done")
        paused_ids += more[:1]
    assert untouched(engine, paused_ids)
    with engine.begin() as conn:
        resume(conn, Task, held)
    wait_for(all_status(engine, paused_ids, "done"), timeout=20, what="the resumed queue's jobs done")


@pytest.mark.parametrize("queues", SERVED, ids=IDS)
def test_a_pause_stops_a_busy_worker_and_lets_its_running_job_finish(
    engine: Engine, start_worker: Any, queues: tuple[str, ...] | None, tmp_path: Path
) -> None:
    served = _served(queues)
    held = served[-1]
    start_worker(queues=queues)
    started = tmp_path / "started"
    (running,) = enqueue(engine, held, payload={"started": str(started), "sleep": 1.0})
    wait_for(started.exists, what="the job running")
    with engine.begin() as conn:
        pause(conn, Task, held)
    later = enqueue(engine, held, 2, priority=10)
    wait_for(status_is(engine, running, "done"), what="the running job done")
    # The worker asked again since: the sentinel of another queue (or of the same one
    # once resumed) runs after the paused jobs had every chance.
    if len(served) > 1:
        (sentinel,) = enqueue(engine, served[0])
        wait_for(status_is(engine, sentinel, "done"), what="another queue's job done")
        assert untouched(engine, later)
    with engine.begin() as conn:
        resume(conn, Task, held)
    wait_for(all_status(engine, later, "done"), what="the resumed jobs done")


def test_until_idle_returns_with_a_paused_queues_jobs_left(engine: Engine, make_worker: Any) -> None:
    from .worker_app import tasks as app_tasks

    with engine.begin() as conn:
        pause(conn, Task, "x")
    waiting = enqueue(engine, "x", 2)
    ran = enqueue(engine, "b", 2)
    worker = make_worker(engine, Task, app_tasks, poll_interval=0.2)
    worker.run(until_idle=True)
    assert all_status(engine, ran, "done")() and untouched(engine, waiting)


# -- command line and dashboard ----------------------------------------------------------


@pytest.fixture
def url(server: Server) -> str:
    return server.url.render_as_string(hide_password=False)


def test_cli_pauses_and_resumes_queues_by_repeated_flags(engine: Engine, url: str, capsys: Any) -> None:
    assert main(["pause", "tests.models:Task", "--url", url, "--queue", "b", "--queue", "c"]) == 0
    assert capsys.readouterr().out.splitlines() == ["paused b", "paused c"]
    assert list(paused_now(engine)) == ["b", "c"]
    assert main(["pause", "tests.models:Task", "--url", url, "--queue", "b"]) == 0
    assert capsys.readouterr().out.splitlines() == ["b was paused already"]
    enqueue(engine, "b")
    assert main(["stats", "tests.models:Task", "--url", url]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^paused: b \(since .+\)$", out, re.M) and re.search(r"^paused: c ", out, re.M)
    assert main(["resume", "tests.models:Task", "--url", url, "--queue", "b", "--queue", "c", "--queue", "d"]) == 0
    assert capsys.readouterr().out.splitlines() == ["resumed b", "resumed c", "d was not paused"]
    assert paused_now(engine) == {}


def test_cli_refuses_a_pause_it_cannot_honour(engine: Engine, url: str, capsys: Any) -> None:
    assert main(["pause", "tests.models:EmailJob", "--url", url, "--queue", "mail"]) == 1
    assert "queues_table(EmailJob)" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        main(["pause", "tests.models:Task", "--url", url])  # --queue is required
    assert exited.value.code == 2


def test_dashboard_pauses_and_resumes_a_queue(engine: Engine) -> None:
    pytest.importorskip("flask")
    from sqla_queue.dashboard import create_app

    enqueue(engine, "b")
    app = create_app(engine, [EmailJob, Task])
    app.testing = True
    with app.test_client() as client:
        client.environ_base["HTTP_ORIGIN"] = "http://localhost"
        page = client.get("/").get_data(as_text=True)
        token = re.search(r'name="csrf_token" value="([^"]+)"', page)
        assert token and 'value="pause"' in page
        assert client.post("/tasks/action", data={"action": "pause", "queue": "b"}).status_code == 400  # no token
        assert paused_now(engine) == {}
        response = client.post("/tasks/action", data={"csrf_token": token.group(1), "action": "pause", "queue": "b"})
        assert response.status_code == 302
        assert list(paused_now(engine)) == ["b"]
        page = client.get("/").get_data(as_text=True)
        assert ">paused</span>" in page and 'value="resume"' in page
        # A paused queue without jobs is still shown, with its resume button.
        client.post("/tasks/action", data={"csrf_token": token.group(1), "action": "pause", "queue": "<empty>"})
        page = client.get("/").get_data(as_text=True)
        assert 'data-paused-queue="&lt;empty&gt;"' in page and "<empty>" not in page
        # The email table has no queues table: no button, and the action is refused.
        assert client.post("/email_jobs/action", data={"csrf_token": token.group(1), "action": "pause",
                                                       "queue": "mail"}).status_code == 400
        for queue in ("b", "<empty>"):
            client.post("/tasks/action", data={"csrf_token": token.group(1), "action": "resume", "queue": queue})
        assert paused_now(engine) == {}
    read_only = create_app(engine, [Task], read_only=True)
    with read_only.test_client() as client:
        client.environ_base["HTTP_ORIGIN"] = "http://localhost"
        assert 'value="pause"' not in client.get("/").get_data(as_text=True)
        assert client.post("/tasks/action", data={"action": "pause", "queue": "b"}).status_code == 403
    assert paused_now(engine) == {}


class _Other(DeclarativeBase):
    pass


class UnpausedJob(_Other, JobMixin):
    """A queue table whose queues table is declared but was never created."""

    __tablename__ = "pause_missing_jobs"


queues_table(UnpausedJob)


def test_a_worker_needs_the_declared_queues_table(engine: Engine, make_worker: Any) -> None:
    table_of(UnpausedJob).create(engine)
    try:
        worker = make_worker(engine, UnpausedJob, lambda job: None)
        with pytest.raises(WorkerStartError, match="'pause_missing_jobs_queues' does not exist"):
            worker.start()
        queues_table(UnpausedJob).create(engine)
        worker = make_worker(engine, UnpausedJob, lambda job: None)
        worker.start()
        worker.stop(grace=1)
    finally:
        _Other.metadata.drop_all(engine)


def test_the_queues_table_is_created_with_the_metadata(engine: Engine) -> None:
    with engine.connect() as conn:
        assert conn.scalar(text("SELECT to_regclass('tasks_queues') IS NOT NULL"))
        assert conn.scalar(select(func.count()).select_from(TASK_QUEUES)) == 0


@pytest.mark.system
def test_a_pause_stops_every_worker_process(engine: Engine, worker_processes: Any) -> None:
    """Four worker processes run a queue's backlog; once the pause commits, the jobs they
    run finish and no process starts another of that queue, while the workers go on with
    another queue's jobs."""
    for _ in range(4):
        worker_processes("--concurrency", "2", "--batch-size", "2", "--poll-interval", "0.5s")
    backlog = enqueue(engine, "x", 200, payload={"sleep": 0.02})
    wait_for(lambda: _count(engine, backlog, "done") >= 20, timeout=60, what="the backlog under way")
    with engine.begin() as conn:
        pause(conn, Task, "x")
    wait_for(lambda: _count(engine, backlog, "running") == 0, timeout=30, what="the running jobs of x finished")
    started = _count(engine, backlog, "done", "failed", "running")
    others = enqueue(engine, "b", 40, payload={"sleep": 0.02})
    wait_for(all_status(engine, others, "done"), timeout=60, what="the other queue's jobs done")
    assert _count(engine, backlog, "done", "failed", "running") == started
    assert _count(engine, backlog, "pending") == len(backlog) - started > 0


def _count(engine: Engine, ids: list[int], *statuses: str) -> int:
    with engine.connect() as conn:
        return conn.scalar(select(func.count()).where(TASKS.c.id.in_(ids), TASKS.c.status.in_(statuses))) or 0
