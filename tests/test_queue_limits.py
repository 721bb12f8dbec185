"""A queue's own limits, set at run time (``set_queue_limits``), in place of the model's
``Concurrency(…, key="queue")`` and ``RateLimit(…, key="queue")`` for that queue.

``ShardJob``: three running per account, four per queue, six in all; its queues table
is declared. ``RatedJob``: twenty starts per queue in any second (and five per account
in any half second, strictly).
"""

from __future__ import annotations

import asyncio
import re
from collections import Counter
from typing import Any

import pytest
from sqlalchemy import Engine, func, insert, select, update
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Session

from sqla_queue import Concurrency, JobMixin, QueuesTableNotDeclared, WorkerStartError, queues_table, set_queue_limits
from sqla_queue import sql as q
from sqla_queue.cli import main
from sqla_queue.model import flow_rules, notify_channel
from sqla_queue.rules import MAX_CONCURRENCY, check_queue_limits

from .helpers import SENTINEL_CHANNEL, Server, notifications, notifications_until_sentinel, table_of, wait_for
from .models import AccountJob, RatedJob, ShardJob, Task

SHARDS = table_of(ShardJob)
RATED = table_of(RatedJob)


def add(engine: Engine, table: Any, rows: list[dict[str, Any]]) -> list[int]:
    with engine.begin() as conn:
        return list(conn.scalars(insert(table).returning(table.c.id), rows))


def claim(engine: Engine, model: Any, limit: int = 50) -> list[Any]:
    """One claim as the worker makes it: its turn first, then the statement."""
    with engine.begin() as conn:
        conn.execute(q.flow_lock(model))
        return list(conn.execute(q.claim(model, owner="me", limit=limit)))


def limits_now(engine: Engine, model: Any) -> dict[str, tuple[int | None, int | None]]:
    with engine.connect() as conn:
        return {row.queue: (row.concurrency, row.rate) for row in conn.execute(q.queue_limits(model))}


def per_queue(rows: list[Any]) -> Counter[str]:
    return Counter(row.queue for row in rows)


# -- what may be set ---------------------------------------------------------------------


@pytest.mark.parametrize("value", [0, -1, MAX_CONCURRENCY + 1, 2.5, "3", True])
def test_a_limit_is_a_whole_number_from_one(value: object) -> None:
    with pytest.raises(ValueError, match="integer from 1"):
        check_queue_limits("ShardJob", flow_rules(SHARDS), value, None)


def test_a_limit_replaces_a_declared_rule_on_the_queue() -> None:
    check_queue_limits("shard_jobs", flow_rules(SHARDS), 2, None)
    check_queue_limits("rated_jobs", flow_rules(RATED), None, 7)
    check_queue_limits("account_jobs", flow_rules(table_of(AccountJob)), None, None)  # nothing to set
    with pytest.raises(ValueError, match=r"declares no RateLimit\(…, key=\"queue\"\)"):
        check_queue_limits("shard_jobs", flow_rules(SHARDS), None, 5)
    with pytest.raises(ValueError, match=r"declares no Concurrency\(…, key=\"queue\"\)"):
        check_queue_limits("account_jobs", flow_rules(table_of(AccountJob)), 1, None)  # per account, not queue


def test_bad_calls_are_refused_before_anything_is_written(engine: Engine) -> None:
    with Session(engine) as session:
        with pytest.raises(ValueError, match="integer from 1"):
            set_queue_limits(session, ShardJob, "a", concurrency=0)
        with pytest.raises(ValueError, match="declares no RateLimit"):
            set_queue_limits(session, ShardJob, "a", rate=10)
        with pytest.raises(QueuesTableNotDeclared, match=r"queues_table\(AccountJob\)"):
            set_queue_limits(session, AccountJob, "a", concurrency=1)
        with pytest.raises(TypeError, match="needs a Session or a Connection"):
            set_queue_limits(engine, ShardJob, "a", concurrency=1)  # type: ignore[call-overload]
        session.execute(select(1))  # the caller's transaction was left usable
        session.commit()
    assert limits_now(engine, ShardJob) == {}


def test_a_limit_whose_rule_is_gone_is_shown_as_unused() -> None:
    """A model that dropped its rule on the queue: the claims ignore the queue's row, and
    stats says so rather than failing."""
    from sqla_queue.admin import describe_queue_limits
    from sqla_queue.rules import Concurrency, RateLimit

    assert describe_queue_limits(2, 5, [Concurrency(4, key="queue"), RateLimit(9, per=2.0, key="queue")]) == (
        "at most 2 running, at most 5 starts in 2 s")
    assert describe_queue_limits(2, 5, []) == (
        "at most 2 running (unused: no Concurrency on the queue), 5 starts (unused: no RateLimit on the queue)")


# -- the claims --------------------------------------------------------------------------


def claim_all(engine: Engine, model: Any) -> Counter[str]:
    """Claim until a claim takes nothing (a claim ranks its candidates against each rule
    apart, so one claim may take fewer than the rules allow); the running jobs per queue."""
    while claim(engine, model):
        pass
    table = table_of(model)
    with engine.connect() as conn:
        return Counter(dict(conn.execute(select(table.c.queue, func.count()).where(table.c.status == "running")
                                         .group_by(table.c.queue)).all()))


def test_a_queues_own_concurrency_replaces_the_models_for_that_queue(engine: Engine) -> None:
    add(engine, SHARDS, [{"account": f"k{i}", "queue": "ab"[i % 2]} for i in range(20)])
    with engine.begin() as conn:
        assert set_queue_limits(conn, ShardJob, "a", concurrency=1) is True
    assert limits_now(engine, ShardJob) == {"a": (1, None)}
    assert claim_all(engine, ShardJob) == {"a": 1, "b": 4}  # a: its own limit; b: the model's 4
    with engine.begin() as conn:
        conn.execute(update(SHARDS).where(SHARDS.c.status == "running").values(status="done"))
        set_queue_limits(conn, ShardJob, "a")  # back to the model's
    assert limits_now(engine, ShardJob) == {}
    running = claim_all(engine, ShardJob)
    assert running["a"] == 4 and running.total() == 6  # six in all still holds


def test_a_queues_own_concurrency_may_be_above_the_models(engine: Engine) -> None:
    add(engine, SHARDS, [{"account": f"k{i}", "queue": "a"} for i in range(10)])
    with engine.begin() as conn:
        set_queue_limits(conn, ShardJob, "a", concurrency=5)
    assert claim_all(engine, ShardJob) == {"a": 5}  # the table's six in all is untouched


def test_a_queues_own_rate_replaces_the_models_for_that_queue(engine: Engine) -> None:
    add(engine, RATED, [{"queue": "ab"[i % 2]} for i in range(60)])
    with engine.begin() as conn:
        set_queue_limits(conn, RatedJob, "a", rate=3)
    first = per_queue(claim(engine, RatedJob))
    assert first == {"a": 3, "b": 20}
    assert per_queue(claim(engine, RatedJob)) == {}  # both windows are full for a second


def test_limits_set_in_a_transaction_hold_from_its_commit_only(engine: Engine) -> None:
    add(engine, SHARDS, [{"account": f"k{i}", "queue": "a"} for i in range(10)])
    with Session(engine) as session:
        set_queue_limits(session, ShardJob, "a", concurrency=1)
        assert limits_now(engine, ShardJob) == {}  # not before the commit
        session.rollback()
    assert per_queue(claim(engine, ShardJob, limit=2)) == {"a": 2}


def test_setting_limits_wakes_the_queues_workers_with_the_commit_only(
    engine: Engine, server: Server, listener: Any
) -> None:
    channel = notify_channel(SHARDS)
    listener.execute(f'LISTEN "{channel}"')
    listener.execute(f'LISTEN "{SENTINEL_CHANNEL}"')
    with Session(engine) as session:
        set_queue_limits(session, ShardJob, "a", concurrency=9)
        assert notifications_until_sentinel(listener, server.conninfo) == []
        session.rollback()
    assert notifications_until_sentinel(listener, server.conninfo) == []
    with Session(engine) as session:
        set_queue_limits(session, ShardJob, "a", concurrency=9)
        session.commit()
    assert notifications(listener, 5) == [(channel, "a")]


def test_async_set_queue_limits(server: Server, engine: Engine) -> None:
    async def go() -> None:
        async_engine = create_async_engine(server.url)
        try:
            async with AsyncSession(async_engine) as session:
                assert await set_queue_limits(session, ShardJob, "a", concurrency=2) is True
                await session.commit()
            async with async_engine.begin() as conn:
                with pytest.raises(ValueError, match="declares no RateLimit"):
                    await set_queue_limits(conn, ShardJob, "b", rate=2)
                await set_queue_limits(conn, ShardJob, "b", concurrency=3)
        finally:
            await async_engine.dispose()

    asyncio.run(go())
    assert limits_now(engine, ShardJob) == {"a": (2, None), "b": (3, None)}


# -- workers -----------------------------------------------------------------------------


def test_a_worker_holds_a_queue_to_its_own_limit(engine: Engine, start_worker: Any) -> None:
    """Eight executors; queue a limited to one running job, b to the model's four. The
    most running jobs of each queue, sampled from the table, never passes its limit, and
    b reaches its own (the limits, not a lack of jobs, held the claims back)."""
    from .test_flow import Overlap, Sampler, _handler

    overlap = Overlap()
    with engine.begin() as conn:
        set_queue_limits(conn, ShardJob, "a", concurrency=1)
    ids = add(engine, SHARDS, [{"account": f"k{i % 8}", "queue": "ab"[i % 2]} for i in range(60)])
    with Sampler(engine, SHARDS) as sampler:
        start_worker(handler=_handler(overlap), model=ShardJob, concurrency=8, batch_size=5)
        wait_for(lambda: len(overlap.ran) >= len(ids), timeout=60, what="every job run")
    assert sorted(overlap.ran) == ids
    assert sampler.most["queue", "a"] == 1 and overlap.most["queue", "a"] <= 1
    assert sampler.most["queue", "b"] <= 4 and overlap.most["queue", "b"] <= 4
    assert sampler.most["queue", "b"] > 1


# -- the command line and the dashboard --------------------------------------------------


@pytest.fixture
def url(server: Server) -> str:
    return server.url.render_as_string(hide_password=False)


def test_cli_sets_a_queues_limits_and_stats_shows_them(engine: Engine, url: str, capsys: Any) -> None:
    target = ["tests.models:ShardJob", "--url", url]
    assert main(["limit", *target, "--queue", "a", "--queue", "c", "--concurrency", "2"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "limits of a: concurrency 2, rate the model's", "limits of c: concurrency 2, rate the model's"]
    assert limits_now(engine, ShardJob) == {"a": (2, None), "c": (2, None)}
    add(engine, SHARDS, [{"queue": "a"}])
    assert main(["stats", *target]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^limits of queue a: at most 2 running$", out, re.M), out
    assert main(["limit", *target, "--queue", "c"]) == 0  # no limit given: the model's again
    capsys.readouterr()
    assert limits_now(engine, ShardJob) == {"a": (2, None)}
    assert main(["limit", "tests.models:RatedJob", "--url", url, "--queue", "a", "--rate", "5"]) == 0
    capsys.readouterr()
    assert main(["stats", "tests.models:RatedJob", "--url", url]) == 0
    assert re.search(r"^limits of queue a: at most 5 starts in 1 s$", capsys.readouterr().out, re.M)


def test_cli_refuses_limits_it_cannot_honour(engine: Engine, url: str, capsys: Any) -> None:
    assert main(["limit", "tests.models:ShardJob", "--url", url, "--queue", "a", "--rate", "5"]) == 2
    assert "ShardJob.__queue_flow__ declares no RateLimit" in capsys.readouterr().err
    assert main(["limit", "tests.models:AccountJob", "--url", url, "--queue", "a", "--concurrency", "1"]) == 1
    assert "queues_table(AccountJob)" in capsys.readouterr().err
    for bad in ("0", "x", "-2"):
        with pytest.raises(SystemExit) as exited:
            main(["limit", "tests.models:ShardJob", "--url", url, "--queue", "a", "--concurrency", bad])
        assert exited.value.code == 2
    capsys.readouterr()
    assert limits_now(engine, ShardJob) == {}


def test_dashboard_shows_and_sets_a_queues_limits(engine: Engine) -> None:
    pytest.importorskip("flask")
    from sqla_queue.dashboard import create_app

    add(engine, SHARDS, [{"queue": "a"}, {"queue": "<i>q</i>"}])
    app = create_app(engine, [ShardJob, Task])
    app.testing = True
    with app.test_client() as client:
        client.environ_base["HTTP_ORIGIN"] = "http://localhost"
        page = client.get("/").get_data(as_text=True)
        token = re.search(r'name="csrf_token" value="([^"]+)"', page)
        assert token and 'data-limits-queue="a"' in page and 'value="limit"' in page
        assert 'data-limits-queue="&lt;i&gt;q&lt;/i&gt;"' in page and "<i>q</i>" not in page
        assert "at most <b>4</b> running" in page  # the model's
        form = {"action": "limit", "queue": "a", "concurrency": "2", "rate": ""}
        assert client.post("/shard_jobs/action", data=form).status_code == 400  # no token
        assert limits_now(engine, ShardJob) == {}
        assert client.post("/shard_jobs/action", data={**form, "csrf_token": token.group(1)}).status_code == 302
        assert limits_now(engine, ShardJob) == {"a": (2, None)}
        page = client.get("/").get_data(as_text=True)
        assert "at most <b>2</b> running (the queue's own; the model's 4)" in page
        for bad in ({"concurrency": "0"}, {"concurrency": "two"}, {"rate": "5"}):
            refused = client.post("/shard_jobs/action", data={**form, **bad, "csrf_token": token.group(1)})
            assert refused.status_code == 400
        blank = {**form, "concurrency": "", "csrf_token": token.group(1)}
        assert client.post("/shard_jobs/action", data=blank).status_code == 302
        assert limits_now(engine, ShardJob) == {}
        # The task table declares no rule on the queue: no form.
        assert 'data-limits-queue' not in client.get("/").get_data(as_text=True).split("<h2>tasks</h2>")[-1]
    read_only = create_app(engine, [ShardJob], read_only=True)
    with read_only.test_client() as client:
        client.environ_base["HTTP_ORIGIN"] = "http://localhost"
        page = client.get("/").get_data(as_text=True)
        assert 'data-limits-queue="a"' in page and 'value="limit"' not in page
        assert client.post("/shard_jobs/action", data={"action": "limit", "queue": "a"}).status_code == 403
    assert limits_now(engine, ShardJob) == {}


class _Other(DeclarativeBase):
    pass


class UnmigratedJob(_Other, JobMixin):
    """A queue table whose queues table predates the limits' columns."""

    __tablename__ = "limits_unmigrated_jobs"
    __queue_flow__ = Concurrency(2, key="queue")


queues_table(UnmigratedJob)


def test_a_worker_refuses_a_queues_table_without_the_limits_columns(engine: Engine, make_worker: Any) -> None:
    """Its claims would fail on the missing columns, each time: the worker says to
    migrate instead, before it starts."""
    table_of(UnmigratedJob).create(engine)
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql(
                "CREATE TABLE limits_unmigrated_jobs_queues (queue VARCHAR(200) PRIMARY KEY, "
                "paused_at TIMESTAMPTZ, updated_at TIMESTAMPTZ NOT NULL DEFAULT now())")
        worker = make_worker(engine, UnmigratedJob, lambda job: None)
        with pytest.raises(WorkerStartError, match=r"lacks the column\(s\) concurrency, rate, .*migrate"):
            worker.start()
        with engine.begin() as conn:
            conn.exec_driver_sql("ALTER TABLE limits_unmigrated_jobs_queues ADD concurrency INTEGER, ADD rate INTEGER")
        worker = make_worker(engine, UnmigratedJob, lambda job: None)
        worker.start()
        worker.stop(grace=1)
    finally:
        _Other.metadata.drop_all(engine)


def test_flask_queue_pauses_resumes_and_limits_queues(engine: Engine, server: Server) -> None:
    """``flask queue pause|resume|limit``: the flags of ``sqla-queue``, one queue and
    several, and the same refusals."""
    pytest.importorskip("flask_sqlalchemy")
    from flask import Flask
    from flask_sqlalchemy import SQLAlchemy

    from sqla_queue.flask import FlaskQueue

    app = Flask("queue_controls")
    app.config["SQLALCHEMY_DATABASE_URI"] = server.url.render_as_string(hide_password=False)
    db = SQLAlchemy(app)
    queue = FlaskQueue(app, db)
    queue.add_worker(ShardJob, lambda job: None, name="shards")
    queue.add_worker(AccountJob, lambda job: None, name="accounts")
    runner = app.test_cli_runner()
    try:
        paused = runner.invoke(args=["queue", "pause", "shards", "--queue", "a", "--queue", "b"])
        assert paused.exit_code == 0 and paused.output.splitlines() == ["paused a", "paused b"], paused.output
        with engine.connect() as conn:
            assert [row.queue for row in conn.execute(q.paused_queues(ShardJob))] == ["a", "b"]
        resumed = runner.invoke(args=["queue", "resume", "shards", "--queue", "a", "--queue", "c"])
        assert resumed.output.splitlines() == ["resumed a", "c was not paused"], resumed.output
        limited = runner.invoke(args=["queue", "limit", "shards", "--queue", "a", "--concurrency", "2"])
        assert limited.exit_code == 0 and limited.output.strip() == "limits of a: concurrency 2, rate the model's"
        assert limits_now(engine, ShardJob) == {"a": (2, None)}
        refused = runner.invoke(args=["queue", "limit", "shards", "--queue", "a", "--rate", "5"])
        assert refused.exit_code == 2 and "declares no RateLimit" in refused.output, refused.output
        undeclared = runner.invoke(args=["queue", "pause", "accounts", "--queue", "a"])
        assert undeclared.exit_code == 1 and "queues_table(AccountJob)" in undeclared.output, undeclared.output
        assert runner.invoke(args=["queue", "limit", "shards", "--queue", "a", "--concurrency", "0"]).exit_code == 2
        assert runner.invoke(args=["queue", "pause", "shards"]).exit_code == 2  # --queue is required
        assert limits_now(engine, ShardJob) == {"a": (2, None)}
    finally:
        with app.app_context():
            db.engine.dispose()
