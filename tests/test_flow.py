"""Concurrency rules (``__queue_flow__``): at most N running jobs per key, per queue and in
the whole table, counted by the claim statement, and strict because the claims of a
table with rules take turns on its advisory lock.

``AccountJob``: one running job per account. ``ShardJob``: three per account, four per
queue, six in all. Jobs without an account are not limited by the per-account rule.
"""

from __future__ import annotations

import re
import threading
import time
from collections import Counter, defaultdict
from typing import Any

import pytest
from sqlalchemy import Engine, func, insert, select, text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from sqla_queue import Concurrency, JobMixin
from sqla_queue import sql as q
from sqla_queue.model import flow_rules

from . import models
from .helpers import run_until_done, table_of, wait_for, wait_for_counts
from .models import AccountJob, EmailJob, FlowRun, ShardJob, TenantJob

ACCOUNTS = table_of(AccountJob)
SHARDS = table_of(ShardJob)


def add(engine: Engine, table: Any, rows: list[dict[str, Any]]) -> list[int]:
    with engine.begin() as conn:
        return list(conn.scalars(insert(table).returning(table.c.id), rows))


def claim(engine: Engine, model: Any, owner: str, limit: int = 10, **options: Any) -> list[Any]:
    """One claim as the worker makes it: its turn first, then the statement."""
    with engine.begin() as conn:
        conn.execute(q.flow_lock(model))
        return list(conn.execute(q.claim(model, owner=owner, limit=limit, **options)))


def finish(engine: Engine, table: Any, ids: list[int]) -> None:
    with engine.begin() as conn:
        conn.execute(table.update().where(table.c.id.in_(ids)).values(status="done", finished_at=func.now()))


# -- the rules, as declared --------------------------------------------------------------


def test_rules_are_read_from_the_model() -> None:
    assert flow_rules(table_of(AccountJob)) == (Concurrency(1, key="account"),)
    assert [r.limit for r in flow_rules(SHARDS) if isinstance(r, Concurrency)] == [3, 4, 6]
    assert flow_rules(table_of(EmailJob)) == ()


@pytest.mark.parametrize(
    ("rules", "error"),
    [
        (Concurrency(1, key="nope"), "'nope' is not a column"),
        ((Concurrency(1, key="queue"), Concurrency(2, key="queue")), "twice"),
        ("queue", "must be a sqla_queue flow rule"),
        ((1,), "not a sqla_queue flow rule"),
    ],
)
def test_a_bad_declaration_is_refused_when_the_model_is_mapped(rules: Any, error: str) -> None:
    class Other(DeclarativeBase):
        pass

    with pytest.raises((TypeError, ValueError), match=error):

        class BadJob(Other, JobMixin):
            __tablename__ = "bad_flow_jobs"
            __queue_flow__ = rules
            note: Mapped[str | None] = mapped_column()


@pytest.mark.parametrize("limit", [0, -1, True, 1.5, "2", 10**7])
def test_a_bad_limit_is_refused(limit: Any) -> None:
    with pytest.raises(ValueError, match="Concurrency limit"):
        Concurrency(limit)
    with pytest.raises(TypeError, match="Concurrency key"):
        Concurrency(1, key="")


def test_each_keyed_rule_gets_a_partial_index_of_running_jobs() -> None:
    indexes = {str(i.name): i for i in SHARDS.indexes}
    for key in ("account", "queue"):
        index = indexes[f"shard_jobs_running_{key}_idx"]
        assert [c.name for c in index.columns] == [key]
        assert "running" in str(index.dialect_options["postgresql"]["where"])


# -- the claim statement -----------------------------------------------------------------


def test_a_claim_takes_one_job_per_free_key_and_every_job_without_a_key(engine: Engine) -> None:
    add(engine, ACCOUNTS, [{"account": f"a{i % 3}"} for i in range(9)] + [{"account": None}] * 2)
    first = claim(engine, AccountJob, "w1")
    assert sorted(r.account or "-" for r in first) == ["-", "-", "a0", "a1", "a2"]
    assert claim(engine, AccountJob, "w2") == []  # every account has its job running
    finish(engine, ACCOUNTS, [r.id for r in first if r.account == "a1"])
    second = claim(engine, AccountJob, "w3")
    assert [r.account for r in second] == ["a1"]
    # The oldest of a1's jobs: the claim's order within a key.
    with engine.connect() as conn:
        oldest = conn.scalar(select(func.min(ACCOUNTS.c.id)).where(ACCOUNTS.c.account == "a1",
                                                                    ACCOUNTS.c.status == "pending"))
    assert oldest is not None and second[0].id < oldest


def test_the_scan_passes_over_a_full_keys_backlog(engine: Engine) -> None:
    """A key at its limit with a backlog at the head of the order does not hide the
    other keys' jobs behind it (the claim reads past it, within the same statement)."""
    add(engine, ACCOUNTS, [{"account": "busy", "priority": 10}] * 200 + [{"account": "quiet", "priority": 0}] * 3)
    assert [r.account for r in claim(engine, AccountJob, "w1", limit=1)] == ["busy"]
    assert [r.account for r in claim(engine, AccountJob, "w2", limit=5)] == ["quiet"]


@pytest.mark.parametrize("queues", [None, ("a",), ("a", "b")], ids=["all", "one", "two"])
@pytest.mark.parametrize("isolated", [False, True], ids=["batch", "isolated"])
def test_every_rule_holds_in_every_claim_shape(engine: Engine, queues: Any, isolated: bool) -> None:
    rows = [{"account": f"x{i % 2}", "queue": "ab"[i % 2 if queues != ("a",) else 0], "isolated": isolated}
            for i in range(40)]
    add(engine, SHARDS, rows)
    taken: list[Any] = []
    for n in range(12):
        taken += claim(engine, ShardJob, f"w{n}", queues=queues, isolated=isolated)
    per_account = Counter(r.account for r in taken)
    per_queue = Counter(r.queue for r in taken)
    assert max(per_account.values()) <= 3 and max(per_queue.values()) <= 4 and len(taken) <= 6
    # As much as the rules allow: six in all when two queues are served, four in one.
    assert len(taken) == (4 if queues == ("a",) else 6)


def test_the_worker_claims_take_turns(engine: Engine) -> None:
    """The lock is the table's, the same number in every process, and a claim that holds
    it makes another wait (tried here with pg_try_advisory_xact_lock)."""
    key = q.flow_lock_key(SHARDS)
    assert key == q.flow_lock_key(SHARDS) and key != q.flow_lock_key(ACCOUNTS)
    assert key != q.flow_lock_key(SHARDS, {None: "tenant_1"})
    with engine.begin() as holder, engine.begin() as other:
        holder.execute(q.flow_lock(ShardJob))
        assert other.scalar(select(func.pg_try_advisory_xact_lock(key))) is False
    with engine.begin() as conn:
        assert conn.scalar(select(func.pg_try_advisory_xact_lock(key))) is True


def test_the_operations_say_which_tables_claims_take_turns(engine: Engine) -> None:
    """The worker's batches may grow larger where claims take turns (see WorkerConfig.max_batch)."""
    from sqla_queue.driver import Driver
    from sqla_queue.ops import QueueOps

    from .models import OrderedJob, RatedJob

    driver = Driver(engine)
    turns = {model.__name__: QueueOps(driver, model).claims_take_turns
             for model in (AccountJob, ShardJob, TenantJob, RatedJob, OrderedJob, EmailJob)}
    # A sequence and a default-mode rate limit count nothing a claim must see committed.
    assert turns == {"AccountJob": True, "ShardJob": True, "TenantJob": True, "RatedJob": True,
                     "OrderedJob": False, "EmailJob": False}


def test_a_limit_of_one_ranks_without_counting_each_candidates_key() -> None:
    """At a limit of 1 a key with room has nothing running (room(), in the same
    snapshot): the claim counts the full keys once, and no candidate's key again. At a
    limit of 3 (ShardJob's accounts), each candidate's running jobs are counted."""
    from sqlalchemy.dialects import postgresql

    dialect = postgresql.dialect()  # type: ignore[no-untyped-call]

    def counts(model: Any) -> int:
        return str(q.claim(model, owner="me", limit=5).compile(dialect=dialect)).count("count(*)")

    assert counts(AccountJob) == 1  # the full keys' HAVING count(*) >= 1
    assert counts(ShardJob) > 3  # three rules' full keys, and the correlated counts


def test_cursor_claims_do_not_apply_to_a_table_with_rules() -> None:
    with pytest.raises(ValueError, match="claimed from the head"):
        q.claim_template(ShardJob, after=True)


# -- workers -----------------------------------------------------------------------------


class Overlap:
    """What the handlers count: the most jobs of one key (and of each rule's scope)
    running in handlers at once, from each handler's start and end."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._now: Counter[tuple[str, Any]] = Counter()
        self.most: Counter[tuple[str, Any]] = Counter()
        self.ran: list[int] = []

    def enter(self, scopes: list[tuple[str, Any]]) -> None:
        with self._lock:
            for scope in scopes:
                self._now[scope] += 1
                self.most[scope] = max(self.most[scope], self._now[scope])

    def leave(self, scopes: list[tuple[str, Any]], job_id: int) -> None:
        with self._lock:
            for scope in scopes:
                self._now[scope] -= 1
            self.ran.append(job_id)


class Sampler:
    """What the table says: the most running rows per key, sampled until stopped."""

    def __init__(self, engine: Engine, table: Any) -> None:
        self.engine, self.table = engine, table
        self.most: dict[tuple[str, Any], int] = defaultdict(int)
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        t = self.table
        while not self._stop.is_set():
            with self.engine.connect() as conn:
                rows = conn.execute(select(t.c.account, t.c.queue).where(t.c.status == "running")).all()
            counts: Counter[tuple[str, Any]] = Counter()
            for account, queue in rows:
                if account is not None:
                    counts["account", account] += 1
                counts["queue", queue] += 1
                counts["all", None] += 1
            for scope, n in counts.items():
                self.most[scope] = max(self.most[scope], n)
            self.samples += 1

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


@pytest.fixture
def overlap() -> Overlap:
    return Overlap()


def _handler(overlap: Overlap) -> Any:
    def run(job: Any) -> None:
        scopes = [("queue", job.queue), ("all", None)] + ([("account", job.account)] if job.account else [])
        overlap.enter(scopes)
        try:
            time.sleep(0.02)  # the job's work: long enough for runs to overlap
        finally:
            overlap.leave(scopes, job.id)

    return run


@pytest.mark.parametrize(("model", "limits"), [(AccountJob, {"account": 1}),
                                               (ShardJob, {"account": 3, "queue": 4, "all": 6})],
                         ids=["one per account", "three per account, four per queue, six in all"])
def test_a_worker_of_eight_executors_never_runs_more_than_the_limits(
    engine: Engine, start_worker: Any, overlap: Overlap, model: Any, limits: dict[str, int]
) -> None:
    table = table_of(model)
    ids = add(engine, table, [{"account": f"k{i % 4}", "queue": "ab"[i % 2]} for i in range(120)])
    with Sampler(engine, table) as sampler:
        start_worker(handler=_handler(overlap), model=model, concurrency=8, batch_size=5)
        wait_for(lambda: len(overlap.ran) >= len(ids), timeout=60, what="every job run")
    assert sorted(overlap.ran) == ids
    for scope, limit in limits.items():
        handled = max(n for (kind, _), n in overlap.most.items() if kind == scope)
        sampled = max(n for (kind, _), n in sampler.most.items() if kind == scope)
        assert handled <= limit and sampled <= limit, (scope, handled, sampled, limit)
    # A limit was reached in the table (an executor runs its batch one job at a time, so
    # the handlers may count fewer): the rules, not a lack of jobs, held the claims back.
    assert any(max(n for (kind, _), n in sampler.most.items() if kind == scope) == limit
               for scope, limit in limits.items()), sampler.most
    assert sampler.samples > 5


# -- worker processes, some killed -------------------------------------------------------


def _handler_overlap(engine: Engine, deaths: dict[int, float]) -> dict[tuple[str, Any], int]:
    """The most runs of one scope in handlers at once, from ``flow_runs`` (server clock);
    a run its process's SIGKILL cut short ends at that process's death."""
    runs = table_of(FlowRun)
    with engine.connect() as conn:
        rows = conn.execute(select(runs.c.account, runs.c.queue, runs.c.pid, func.extract("epoch", runs.c.started_at),
                                   func.extract("epoch", runs.c.ended_at))).all()
    events: list[tuple[float, int, list[tuple[str, Any]]]] = []
    for account, queue, pid, started, ended in rows:
        end = float(ended) if ended is not None else deaths[pid]
        scopes = [("queue", queue), ("all", None)] + ([("account", account)] if account else [])
        events += [(float(started), 1, scopes), (end, -1, scopes)]
    now: Counter[tuple[str, Any]] = Counter()
    most: Counter[tuple[str, Any]] = Counter()
    for _, step, scopes in sorted(events, key=lambda e: (e[0], e[1])):  # an end before a start at one moment
        for scope in scopes:
            now[scope] += step
            most[scope] = max(most[scope], now[scope])
    return most


@pytest.mark.system
@pytest.mark.parametrize(("model", "limits"), [("AccountJob", {"account": 1}),
                                               ("ShardJob", {"account": 3, "queue": 4, "all": 6})],
                         ids=["one per account", "three per account, four per queue, six in all"])
@pytest.mark.xdist_group("many_connections")  # with the benchmark tests: see test_benchmarks.py
def test_eight_processes_killed_now_and_then_never_run_more_than_the_limits(
    engine: Engine, worker_processes: Any, monkeypatch: pytest.MonkeyPatch, model: str, limits: dict[str, int]
) -> None:
    """Eight worker processes of two executors; two jobs SIGKILL their process on their
    first attempt (restarted at once), so their rows stay running until the sweeper
    returns them. The table, sampled throughout, and the handlers' own log never show
    more running jobs of a scope than its limit, and every job ends done."""
    monkeypatch.setenv("SQLA_QUEUE_TEST_FLOW_MODEL", model)
    table = table_of(getattr(models, model))
    flags = ("--concurrency", "2", "--batch-size", "2", "--lease", "2s", "--heartbeat", "0.5s",
             "--sweep-interval", "0.5s", "--poll-interval", "0.5s")
    processes = [worker_processes(*flags, target="tests.flow_app:make_worker") for _ in range(8)]
    rows = [{"account": f"k{i % 5}", "queue": "ab"[i % 2], "work_seconds": 0.05, "kill": i in (7, 23)}
            for i in range(60)]
    with Sampler(engine, table) as sampler:
        ids = add(engine, table, rows)
        deaths = run_until_done(engine, table, ids, processes,
                                lambda: worker_processes(*flags, target="tests.flow_app:make_worker"), timeout=120)
    assert len(deaths) >= 2, deaths
    handled = _handler_overlap(engine, deaths)
    for scope, limit in limits.items():
        assert max(n for (kind, _), n in sampler.most.items() if kind == scope) <= limit, (scope, sampler.most)
        assert max(n for (kind, _), n in handled.items() if kind == scope) <= limit, (scope, handled)


def test_a_claim_waits_for_its_turn_a_bounded_time(engine: Engine, server: Any) -> None:
    """A claim's turn waits for the lock at most its ``lock_timeout``, and a failed turn
    is rolled back: the connection claims again at once."""
    import psycopg

    from sqla_queue.driver import Driver, take_turn

    driver = Driver(engine)
    conn = driver.connect("test")
    try:
        stmt = driver.compile(q.claim_template(AccountJob))
        values = {q.OWNER_PARAM: "me", q.LIMIT_PARAM: 5, q.LEASE_PARAM: 30.0}
        turn = take_turn(q.flow_lock_key(ACCOUNTS), deadline=1.0)
        assert turn.lock_timeout_ms == 500 and take_turn(1, deadline=60).lock_timeout_ms == 5000
        with engine.begin() as holder:
            holder.execute(q.flow_lock(AccountJob))
            with pytest.raises(psycopg.errors.LockNotAvailable):
                conn.fetch_claimed(stmt, values, 0, 1, turn)
        assert conn.raw.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        add(engine, ACCOUNTS, [{"account": "a"}])
        assert len(conn.fetch_claimed(stmt, values, 0, 1, turn)) == 1
    finally:
        conn.close()


def test_a_claimer_frozen_in_its_turn_loses_it(server: Any) -> None:
    """A claimer stopped inside its turn's transaction (SIGSTOP, a paused VM) has it
    ended by the server after the turn's idle timeout, which frees the lock."""
    import psycopg

    from sqla_queue.driver import _TURN, Turn, _turn_params

    key = q.flow_lock_key(ACCOUNTS)
    frozen = psycopg.connect(server.conninfo, autocommit=True)
    frozen.execute("BEGIN")
    frozen.execute(_TURN, _turn_params(Turn(key, 1000, 300)))  # then it stops talking
    with psycopg.connect(server.conninfo, autocommit=True) as other:
        other.execute("SET lock_timeout = '20s'")
        other.execute("BEGIN")
        other.execute("SELECT pg_advisory_xact_lock(%s)", (key,))  # granted once the server ends the other
        other.execute("COMMIT")
    with pytest.raises(psycopg.Error, match="idle-in-transaction timeout"):
        frozen.execute("SELECT 1")
    frozen.close()


def test_a_worker_behind_a_held_turn_claims_once_it_is_free(engine: Engine, start_worker: Any) -> None:
    ids = add(engine, ACCOUNTS, [{"account": f"k{i}"} for i in range(3)])
    with engine.begin() as holder:
        holder.execute(q.flow_lock(AccountJob))
        worker = start_worker(handler=lambda job: None, model=AccountJob, lease=2.0)

        def waiting_for_the_turn() -> bool:
            with engine.connect() as conn:
                waiting = "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
                return bool(conn.scalar(text(waiting)))

        wait_for(waiting_for_the_turn, what="a claim waiting for its turn")
        assert all(r.status == "pending" for r in _rows(engine, ids))
    wait_for(lambda: all(r.status == "done" for r in _rows(engine, ids)), what="the jobs done once the turn is free")
    wait_for_counts(worker, done=3)  # the counters follow the rows, a moment later


def _rows(engine: Engine, ids: list[int]) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(select(ACCOUNTS).where(ACCOUNTS.c.id.in_(ids))))


# -- what operators see ------------------------------------------------------------------


def test_stats_and_the_dashboard_show_each_rule_and_its_busiest_keys(engine: Engine, server: Any, capsys: Any) -> None:
    from sqla_queue.cli import main

    add(engine, SHARDS, [{"account": "<b>x</b>", "status": "running"}] * 2 + [{"account": "y", "status": "running"}])
    url = server.url.render_as_string(hide_password=False)
    assert main(["stats", "tests.models:ShardJob", "--url", url]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "rule: at most 3 running per account (busiest now: <b>x</b> 2, y 1)" in out
    assert "rule: at most 4 running per queue (busiest now: default 3)" in out
    assert "rule: at most 6 running in the table (busiest now: 3)" in out
    pytest.importorskip("flask")
    from sqla_queue.dashboard import create_app

    app = create_app(engine, [ShardJob, EmailJob])
    with app.test_client() as client:
        page = client.get("/").get_data(as_text=True)
    assert "at most 3 running per account: busiest now" in page and "<b>&lt;b&gt;x&lt;/b&gt;</b> 2" in page
    assert page.count('class="rules"') == 1  # the email table has no rules


# -- fair claims -------------------------------------------------------------------------


def test_a_fair_rule_needs_a_key_and_is_one_per_table() -> None:
    with pytest.raises(ValueError, match="needs a key"):
        Concurrency(2, fair=True)
    with pytest.raises(TypeError, match="fair must be a bool"):
        Concurrency(2, key="x", fair=1)  # type: ignore[arg-type]

    class Other(DeclarativeBase):
        pass

    with pytest.raises(ValueError, match="two fair"):

        class TwoFair(Other, JobMixin):
            __tablename__ = "two_fair_jobs"
            __queue_flow__ = (Concurrency(1, key="a", fair=True), Concurrency(1, key="b", fair=True))
            a: Mapped[str | None] = mapped_column()
            b: Mapped[str | None] = mapped_column()


TENANTS = table_of(TenantJob)


def load_tenants(engine: Engine, jobs: dict[str | None, int]) -> None:
    with engine.begin() as conn:
        for tenant, n in jobs.items():
            conn.execute(text("INSERT INTO tenant_jobs (tenant) SELECT :t FROM generate_series(1, :n)"),
                         {"t": tenant, "n": n})
        conn.execute(text("ANALYZE tenant_jobs"))


@pytest.mark.parametrize("queues", [None, ("default",), ("default", "other")], ids=["all", "one", "two"])
def test_a_fair_claim_takes_up_to_the_limit_of_every_tenant(engine: Engine, queues: Any) -> None:
    load_tenants(engine, {"big": 500, "small": 3, "tiny": 1, None: 2})
    taken = Counter(r.tenant for r in claim(engine, TenantJob, "w1", limit=20, queues=queues))
    assert taken == {"big": 2, "small": 2, "tiny": 1, None: 2}
    second = Counter(r.tenant for r in claim(engine, TenantJob, "w2", limit=20, queues=queues))
    assert second == {None: 0} or second == Counter()  # every tenant is at its limit; NULL ones are all taken


def test_a_fair_claim_reads_a_few_rows_per_tenant_however_long_a_backlog(engine: Engine) -> None:
    """The big tenant's 20,000 jobs ahead in the order are not read: its key is walked
    once, and at most its limit of rows fetched."""
    load_tenants(engine, {"big": 20_000, "small": 5})
    compiled = q.claim(TenantJob, owner="me", limit=10).compile(dialect=engine.dialect)
    with engine.connect() as conn:
        conn.execute(q.flow_lock(TenantJob))
        plan = "\n".join(conn.exec_driver_sql(
            "EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF) " + compiled.string, compiled.construct_params()).scalars())
        conn.rollback()
    scans = [line for line in plan.splitlines() if "tenant_jobs_fair_tenant_idx on tenant_jobs " in line]
    assert scans, plan
    counts = re.findall(r"actual rows=([\d.]+) loops=(\d+)", "\n".join(scans))
    read = sum(float(n) * float(loops) for n, loops in counts)
    assert read <= 10, plan


def test_a_small_tenant_beside_a_big_one_finishes_first(engine: Engine, start_worker: Any) -> None:
    """100 jobs of one tenant, enqueued after 5,000 of another: two of each run at once,
    so the small tenant's jobs are done while most of the big one's wait."""
    load_tenants(engine, {"big": 5_000})
    load_tenants(engine, {"small": 100})
    start_worker(handler=lambda job: None, model=TenantJob, concurrency=4, batch_size=4)

    def small_done() -> bool:
        with engine.connect() as conn:
            done = select(func.count()).where(TENANTS.c.tenant == "small", TENANTS.c.status == "done")
            return conn.scalar(done) == 100

    wait_for(small_done, timeout=60, what="the small tenant's jobs done")
    with engine.connect() as conn:
        waiting = select(func.count()).where(TENANTS.c.tenant == "big", TENANTS.c.status == "pending")
        big_left = conn.scalar(waiting) or 0
    assert big_left >= 4_000, big_left
