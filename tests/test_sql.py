"""Statement builders against real PostgreSQL: claims, fencing, retries, sweeps, cleanup."""

from __future__ import annotations

import functools
import multiprocessing
import uuid
from concurrent.futures import ProcessPoolExecutor
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import Connection, Engine, bindparam, create_engine, func, insert, select, text, update
from sqlalchemy.dialects import postgresql
from sqlalchemy.pool import NullPool

from sqla_queue import Backoff, ClaimToken, archive_table
from sqla_queue import sql as q

from . import claimers
from .helpers import Server, table_of, wait_for
from .models import Base, EmailJob, ReportJob, UuidJob

JOBS = table_of(EmailJob)


def add_jobs(conn: Connection, n: int, **values: Any) -> list[int]:
    """Insert ``n`` jobs; ``values`` may hold SQL expressions such as ``func.now()``."""
    rows = [{"recipient": f"r{i}@example.com"} for i in range(n)]
    stmt = insert(JOBS).values(**values).returning(JOBS.c.id, sort_by_parameter_order=True)
    return list(conn.scalars(stmt, rows))


def status_of(conn: Connection, job_id: Any, table: Any = JOBS) -> str:
    return str(conn.scalar(select(table.c.status).where(table.c.id == job_id)))


def claim(conn: Connection, owner: str = "w1", limit: int = 10, **kw: Any) -> list[Any]:
    return list(conn.execute(q.claim(EmailJob, owner=owner, limit=limit, **kw)))


# -- claim ---------------------------------------------------------------------------------


def test_claim_sets_owner_lease_and_attempt(engine: Engine) -> None:
    with engine.begin() as conn:
        (job_id,) = add_jobs(conn, 1)
        (row,) = claim(conn, owner="worker-a", lease=60)
        lease_left = conn.scalars(select(JOBS.c.lease_expires_at - func.clock_timestamp())).one()
    assert row.id == job_id and row.status == "running" and row.lease_owner == "worker-a"
    assert row.attempts == 1
    assert timedelta(seconds=55) < lease_left <= timedelta(seconds=60)


def test_concurrent_claimers_get_disjoint_jobs_without_blocking(engine: Engine) -> None:
    with engine.begin() as conn:
        add_jobs(conn, 10)
    with engine.connect() as a, engine.connect() as b:
        a.begin()
        b.begin()
        # b would raise LockNotAvailable if it waited on a's locked rows.
        b.execute(text("SET LOCAL lock_timeout = '1s'"))
        first = {r.id for r in claim(a, owner="a", limit=6)}
        second = {r.id for r in claim(b, owner="b", limit=6)}
        a.commit()
        b.commit()
    assert len(first) == 6 and len(second) == 4 and not first & second


@pytest.mark.system
def test_claimer_processes_split_the_queue_exactly(engine: Engine, server: Server) -> None:
    with engine.begin() as conn:
        ids = set(add_jobs(conn, 1000))
    ctx = multiprocessing.get_context("spawn")
    url = server.url.render_as_string(hide_password=False)
    start_line = ctx.Barrier(4)
    with ProcessPoolExecutor(4, mp_context=ctx, initializer=claimers.wait_at, initargs=(start_line,)) as pool:
        results = list(pool.map(claimers.claim_until_empty, [url] * 4, ["p0", "p1", "p2", "p3"]))
    claimed = [job_id for owner_ids in results for job_id in owner_ids]
    assert len(claimed) == len(set(claimed)) == 1000  # nobody claimed a job twice
    assert set(claimed) == ids
    assert sum(1 for owner_ids in results if owner_ids) >= 2  # the work was really shared


def test_claim_order_priority_then_due_time_then_id(engine: Engine) -> None:
    """The order decides which jobs a claim takes. An UPDATE's RETURNING has no order
    of its own (it follows the plan), so the test claims one job at a time, and checks
    that a claim of two takes the best two."""
    with engine.begin() as conn:
        low = add_jobs(conn, 2, priority=0)
        high = add_jobs(conn, 1, priority=10)
        older = add_jobs(conn, 1, priority=0, run_after=datetime.now(UTC) - timedelta(hours=1))
        trial = conn.begin_nested()
        best_two = {r.id for r in claim(conn, limit=2)}
        trial.rollback()
        order = [job.id for _ in range(4) for job in claim(conn, limit=1)]
    assert best_two == set(high + older)
    assert order == high + older + low


def test_claim_skips_jobs_not_yet_due_and_finished_ones(engine: Engine) -> None:
    with engine.begin() as conn:
        (due,) = add_jobs(conn, 1)
        add_jobs(conn, 1, run_after=func.now() + timedelta(minutes=5))
        add_jobs(conn, 1, status="done")
        add_jobs(conn, 1, status="failed")
        assert [r.id for r in claim(conn)] == [due]


def _next_due(conn: Connection) -> float | None:
    seconds = conn.scalar(q.next_run_after(EmailJob))
    return None if seconds is None else float(seconds)


def test_next_run_after_is_the_soonest_delayed_job(engine: Engine) -> None:
    with engine.begin() as conn:
        assert _next_due(conn) is None
        add_jobs(conn, 1, run_after=func.now() + timedelta(minutes=10))
        add_jobs(conn, 1, run_after=func.now() + timedelta(minutes=5))
        add_jobs(conn, 1, run_after=func.now() + timedelta(minutes=1), status="done")
        assert _next_due(conn) == pytest.approx(300, abs=1)


def test_next_run_after_sees_a_job_that_fell_due_a_moment_ago(engine: Engine) -> None:
    """A job that fell due between a worker's empty claim and this query must not wait
    for the poll: it counts as due now (zero or less)."""
    with engine.begin() as conn:
        add_jobs(conn, 1, run_after=func.now() - timedelta(milliseconds=200))
        add_jobs(conn, 1, run_after=func.now() + timedelta(minutes=5))
        seconds = _next_due(conn)
        assert seconds is not None and -0.3 < seconds <= 0


def test_next_run_after_ignores_long_due_and_isolated_jobs(engine: Engine) -> None:
    """Long-due jobs are the claim's business, and an isolated one may be unclaimable by a
    worker whose isolated slot is taken: neither may keep an idle worker waking."""
    with engine.begin() as conn:
        add_jobs(conn, 1, run_after=func.now() - timedelta(minutes=1))
        add_jobs(conn, 1, run_after=func.now() - timedelta(milliseconds=200), isolated=True)
        assert _next_due(conn) is None
        add_jobs(conn, 1, run_after=func.now() + timedelta(minutes=2), isolated=True)
        assert _next_due(conn) == pytest.approx(120, abs=1)


def test_claim_filters_queues(engine: Engine) -> None:
    with engine.begin() as conn:
        (a,) = add_jobs(conn, 1, queue="a")
        (b,) = add_jobs(conn, 1, queue="b")
        (c,) = add_jobs(conn, 1, queue="c")
        assert [r.id for r in claim(conn, queues=["b"])] == [b]
        assert {r.id for r in claim(conn, queues=["a", "c"])} == {a, c}
    with pytest.raises(TypeError):
        q.claim(EmailJob, owner="w", queues="a")
    with pytest.raises(ValueError):
        q.claim(EmailJob, owner="w", queues=[])


def test_claim_keeps_queue_tables_apart(engine: Engine) -> None:
    with engine.begin() as conn:
        conn.execute(insert(table_of(ReportJob)), [{"report": "x"}])
        assert claim(conn) == []
        assert len(list(conn.execute(q.claim(ReportJob, owner="w")))) == 1


def test_user_chosen_primary_key(engine: Engine) -> None:
    table = table_of(UuidJob)
    with engine.begin() as conn:
        conn.execute(insert(table), [{}, {}])
        rows = list(conn.execute(q.claim(UuidJob, owner="w", limit=5)))
        assert len(rows) == 2
        tokens = [ClaimToken(r.id, r.attempts) for r in rows]
        done = conn.scalars(q.complete_if_owner(UuidJob, owner="w", tokens=tokens)).all()
        assert set(done) == {r.id for r in rows}


def test_isolated_jobs_are_claimed_alone(engine: Engine) -> None:
    with engine.begin() as conn:
        normal = add_jobs(conn, 3)
        isolated = add_jobs(conn, 3, isolated=True)
        assert {r.id for r in claim(conn, limit=10)} == set(normal)
        assert conn.scalar(q.isolated_waiting(EmailJob)) is True
        first = claim(conn, limit=10, isolated=True)
        assert [r.id for r in first] == isolated[:1]
        claim(conn, isolated=True)
        claim(conn, isolated=True)
        assert conn.scalar(q.isolated_waiting(EmailJob)) is False


# -- fencing -------------------------------------------------------------------------------


def test_fenced_transitions_refuse_a_stale_owner(engine: Engine) -> None:
    with engine.begin() as conn:
        (job_id,) = add_jobs(conn, 1)
        (row,) = claim(conn, owner="old")
        token = ClaimToken(row.id, row.attempts)
        # The lease is lost: swept back to pending and re-claimed by another worker.
        conn.execute(update(JOBS).values(lease_expires_at=func.now() - timedelta(seconds=1)))
        conn.execute(q.sweep_expired(EmailJob))
        (again,) = claim(conn, owner="new", isolated=True)  # swept jobs run alone
        assert again.attempts == 2

        lease = 30
        assert conn.scalars(q.extend_leases_if_owner(EmailJob, owner="old", tokens=[token], lease=lease)).all() == []
        assert conn.scalars(q.complete_if_owner(EmailJob, owner="old", tokens=token)).all() == []
        assert conn.execute(q.retry_if_owner(EmailJob, owner="old", token=token, error="x", delay=0)).all() == []
        assert conn.scalars(q.fail_if_owner(EmailJob, owner="old", token=token, error="x")).all() == []
        assert conn.scalars(q.release_if_owner(EmailJob, owner="old", tokens=[token])).all() == []
        row_now = conn.execute(select(JOBS).where(JOBS.c.id == job_id)).one()
        assert (row_now.status, row_now.lease_owner, row_now.attempts) == ("running", "new", 2)

        new_token = ClaimToken(again.id, again.attempts)
        assert conn.scalars(q.complete_if_owner(EmailJob, owner="new", tokens=new_token)).all() == [job_id]
        assert status_of(conn, job_id) == "done"


def test_fencing_refuses_an_old_attempt_of_the_same_owner(engine: Engine) -> None:
    with engine.begin() as conn:
        (job_id,) = add_jobs(conn, 1)
        (first,) = claim(conn, owner="same")
        conn.execute(update(JOBS).values(lease_expires_at=func.now() - timedelta(seconds=1)))
        conn.execute(q.sweep_expired(EmailJob))
        (second,) = claim(conn, owner="same", isolated=True)
        stale = ClaimToken(job_id, first.attempts)
        assert conn.scalars(q.complete_if_owner(EmailJob, owner="same", tokens=stale)).all() == []
        assert conn.scalars(
            q.extend_leases_if_owner(EmailJob, owner="same", tokens=[stale], lease=30)
        ).all() == []
        current = ClaimToken(job_id, second.attempts)
        assert conn.scalars(q.complete_if_owner(EmailJob, owner="same", tokens=current)).all() == [job_id]


def test_complete_template_is_complete_if_owner_with_late_parameters(engine: Engine) -> None:
    """One statement object, reused with other owners and tokens, fences like the builder."""
    many = q.complete_template(EmailJob)
    one = q.complete_template(EmailJob, single=True)
    dialect = postgresql.dialect()  # type: ignore[no-untyped-call]
    built = q.complete_if_owner(EmailJob, owner="w", tokens=[(1, 1), (2, 1)])
    assert str(many.compile(dialect=dialect)).split(" WHERE ")[0] == str(
        built.compile(dialect=dialect)
    ).split(" WHERE ")[0]
    assert "= ANY (" in str(many.compile(dialect=dialect))  # one text for every batch size
    with engine.begin() as conn:
        add_jobs(conn, 5)
        a = [ClaimToken(r.id, r.attempts) for r in claim(conn, owner="a", limit=3)]
        b = [ClaimToken(r.id, r.attempts) for r in claim(conn, owner="b", limit=2)]
        stale = ClaimToken(a[0].job_id, a[0].attempt - 1)

        def run_many(owner: str, tokens: list[ClaimToken]) -> list[Any]:
            params = {
                q.OWNER_PARAM: owner,
                q.IDS_PARAM: [t.job_id for t in tokens],
                q.ATTEMPTS_PARAM: [t.attempt for t in tokens],
            }
            return sorted(conn.scalars(many, params).all())

        def run_one(owner: str, token: ClaimToken) -> list[Any]:
            params = {q.OWNER_PARAM: owner, q.JOB_PARAM: token.job_id, q.ATTEMPT_PARAM: token.attempt}
            return list(conn.scalars(one, params).all())

        assert run_many("a", b) == []  # not a's jobs
        assert run_many("a", [stale]) == []  # not the current attempt
        assert run_one("b", a[0]) == []
        # A stale and a current token in one call: only the current one completes.
        assert run_many("a", [stale, a[1]]) == [a[1].job_id]
        assert run_many("a", [a[0]]) == [a[0].job_id]
        assert run_one("a", a[2]) == [a[2].job_id]
        assert run_many("b", b) == sorted(t.job_id for t in b)
        assert run_many("b", b) == []  # done already
        assert {status_of(conn, t.job_id) for t in a + b} == {"done"}


def test_complete_template_with_a_uuid_primary_key(engine: Engine) -> None:
    table = table_of(UuidJob)
    with engine.begin() as conn:
        conn.execute(insert(table), [{"id": uuid.uuid4()} for _ in range(3)])
        rows = conn.execute(q.claim(UuidJob, owner="w", limit=3)).all()
        params = {
            q.OWNER_PARAM: "w",
            q.IDS_PARAM: [r.id for r in rows],
            q.ATTEMPTS_PARAM: [r.attempts for r in rows],
        }
        done = conn.scalars(q.complete_template(UuidJob), params).all()
        assert sorted(done) == sorted(r.id for r in rows)


def test_extend_leases_reports_which_it_extended(engine: Engine) -> None:
    with engine.begin() as conn:
        add_jobs(conn, 3)
        rows = claim(conn, owner="w", lease=1)
        tokens = [ClaimToken(r.id, r.attempts) for r in rows]
        conn.execute(q.complete_if_owner(EmailJob, owner="w", tokens=tokens[0]))
        extended = conn.scalars(q.extend_leases_if_owner(EmailJob, owner="w", tokens=tokens, lease=120)).all()
        assert sorted(extended) == sorted(t.job_id for t in tokens[1:])
        left = conn.scalar(
            select(func.min(JOBS.c.lease_expires_at - func.clock_timestamp())).where(
                JOBS.c.status == "running"
            )
        )
        assert left > timedelta(seconds=100)


# -- retries, dead letter, backoff ---------------------------------------------------------


def test_retry_schedules_within_the_backoff_delay(engine: Engine) -> None:
    backoff = Backoff(base=10, factor=3, cap=1000, jitter=0.2)
    with engine.begin() as conn:
        (job_id,) = add_jobs(conn, 1)
        for attempt in (1, 2, 3):
            conn.execute(update(JOBS).values(run_after=func.now() - timedelta(seconds=1)))
            (row,) = claim(conn)
            assert row.attempts == attempt
            delay = backoff.delay(row.attempts)
            low, high = backoff.bounds(row.attempts)
            assert low <= delay.total_seconds() <= high
            before = conn.scalars(select(func.clock_timestamp())).one()
            result = conn.execute(
                q.retry_if_owner(
                    EmailJob, owner="w1", token=(row.id, row.attempts), error=f"boom {attempt}", delay=delay
                )
            ).one()
            assert result.status == "pending"
            after = conn.scalars(select(func.clock_timestamp())).one()
            job = conn.execute(select(JOBS).where(JOBS.c.id == job_id)).one()
            assert before + delay <= job.run_after <= after + delay
            assert job.last_error == f"boom {attempt}" and job.lease_owner is None


def test_retry_after_the_last_attempt_dead_letters(engine: Engine) -> None:
    with engine.begin() as conn:
        (job_id,) = add_jobs(conn, 1, max_attempts=2)
        for expected in ("pending", "failed"):
            conn.execute(update(JOBS).values(run_after=func.now() - timedelta(seconds=1)))
            (row,) = claim(conn)
            moved = conn.execute(
                q.retry_if_owner(EmailJob, owner="w1", token=(row.id, row.attempts), error="nope", delay=60)
            ).one()
            assert (moved.id, moved.attempt, moved.status) == (job_id, row.attempts, expected)
        job = conn.execute(select(JOBS).where(JOBS.c.id == job_id)).one()
        assert job.finished_at is not None and job.attempts == 2 and job.last_error == "nope"
        assert claim(conn) == []


def test_fail_dead_letters_at_once(engine: Engine) -> None:
    with engine.begin() as conn:
        add_jobs(conn, 1, max_attempts=5)
        (row,) = claim(conn)
        assert conn.scalars(q.fail_if_owner(EmailJob, owner="w1", token=(row.id, 1), error="bad input")).all()
        assert status_of(conn, row.id) == "failed"


@pytest.mark.parametrize("attempt", [1, 2, 5, 10, 30, 2000])
def test_backoff_grows_and_stays_within_jitter_and_cap(attempt: int) -> None:
    backoff = Backoff(base=2, factor=2, cap=600, jitter=0.25)
    low, high = backoff.bounds(attempt)
    raw = min(2 * 2 ** (attempt - 1), 600)
    assert low == pytest.approx(raw * 0.75) and high == pytest.approx(min(raw * 1.25, 600))
    assert backoff.delay(attempt, rand=lambda: 0.0).total_seconds() == pytest.approx(low)
    assert backoff.delay(attempt, rand=lambda: 0.999999).total_seconds() == pytest.approx(high, rel=1e-5)
    assert high <= 600


def test_backoff_delays_grow_until_the_cap() -> None:
    backoff = Backoff(base=1, factor=2, cap=100, jitter=0)
    delays = [backoff.delay(n).total_seconds() for n in range(1, 12)]
    assert delays[:7] == [1, 2, 4, 8, 16, 32, 64] and set(delays[7:]) == {100}
    with pytest.raises(ValueError):
        Backoff(jitter=1.5)


# -- sweep, release ------------------------------------------------------------------------


def test_sweep_returns_expired_work_and_dead_letters_exhausted(engine: Engine) -> None:
    with engine.begin() as conn:
        add_jobs(conn, 1, max_attempts=3)
        add_jobs(conn, 1, max_attempts=1)
        add_jobs(conn, 1)
        rows = {r.id: r for r in claim(conn, owner="dead-worker", lease=60)}
        expired = sorted(rows)[:2]
        conn.execute(
            update(JOBS).where(JOBS.c.id.in_(expired)).values(lease_expires_at=func.now() - timedelta(seconds=1))
        )
        swept: dict[int, str] = {row[0]: row[1] for row in list[Any](conn.execute(q.sweep_expired(EmailJob)))}
        assert swept == {expired[0]: "pending", expired[1]: "failed"}
        back = conn.execute(select(JOBS).where(JOBS.c.id == expired[0])).one()
        assert back.isolated and back.lease_owner is None and back.lease_expires_at is None
        assert back.last_error == "lease expired: worker dead-worker did not finish attempt 1 of 3"
        dead = conn.execute(select(JOBS).where(JOBS.c.id == expired[1])).one()
        assert dead.finished_at is not None and "attempt 1 of 1" in dead.last_error
        live = sorted(rows)[2]
        assert status_of(conn, live) == "running"  # its lease has not expired
        assert conn.execute(q.sweep_expired(EmailJob)).all() == []


def test_sweep_returns_the_jobs_of_a_worker_whose_session_ended_once_its_lease_missed_beats(
    engine: Engine, server: Server
) -> None:
    """Given the workers' lease and heartbeat, a sweep also returns a job before its lease
    expires when its owner marks a session lock, no session holds that lock, and the lease
    missed 1.5 heartbeats; never a fresh lease (a live worker whose listener reconnects),
    a held lock, an unmarked owner (lease only), nor from a session younger than a lease
    (after a restart every session is new)."""
    lease, beat = 3.0, 0.8  # a job swept early has a lease_expires_at before now + 1.8 s
    mark = q.SESSION_MARK
    owners = {
        "ended": f"h:1:aaaaaaaa{mark}/0.0",
        "held": f"h:2:bbbbbbbb{mark}/1.3",
        "beating": f"h:3:cccccccc{mark}/0.0",
        "unmarked": "h:4:dddddddd/0.0",
        "expired": f"h:5:eeeeeeee{mark}/0.0",
    }
    #: Seconds from now each lease runs out: "beating" was extended 0.05 s ago, the
    #: others missed 2.5 beats ("expired": its lease is over).
    left = {"ended": 1.0, "held": 1.0, "beating": 2.95, "unmarked": 1.0, "expired": -1.0}
    with engine.begin() as conn:
        ids = dict(zip(owners, add_jobs(conn, len(owners)), strict=True))
        for name, job_id in ids.items():
            claim(conn, owner=owners[name], limit=1)  # the lowest pending id: job_id
            assert status_of(conn, job_id) == "running"

    def set_leases(conn: Connection) -> None:
        for name, job_id in ids.items():
            conn.execute(update(JOBS).where(JOBS.c.id == job_id).values(
                lease_expires_at=func.clock_timestamp() + timedelta(seconds=left[name])))

    fresh = create_engine(server.url, poolclass=NullPool)  # new sessions, ended when closed
    holder = fresh.connect()
    try:
        assert holder.scalar(q.hold_worker_lock(), {q.OWNER_PARAM: owners["held"].rsplit("/", 1)[0]})
        holder.commit()
        with fresh.connect() as sweeper:
            set_leases(sweeper)
            young = {row[0] for row in sweeper.execute(q.sweep_expired(EmailJob, lease=lease, heartbeat=beat))}
            sweeper.commit()
            assert young == {ids["expired"]}  # a session younger than a lease: expired leases only
            wait_for(lambda: sweeper.scalar(text(
                "SELECT backend_start < clock_timestamp() - make_interval(secs => :s) "
                "FROM pg_stat_activity WHERE pid = pg_backend_pid()"), {"s": lease}), timeout=10,
                what="the sweeping session a lease old")
            set_leases(sweeper)
            plain = sweeper.execute(q.sweep_expired(EmailJob)).all()
            assert plain == []  # without the workers' settings: expired leases only
            swept = {row[0]: row for row in sweeper.execute(q.sweep_expired(EmailJob, lease=lease, heartbeat=beat))}
            sweeper.commit()
            assert set(swept) == {ids["ended"]}, {n: status_of(sweeper, i) for n, i in ids.items()}
            assert tuple(swept[ids["ended"]])[1:4] == ("pending", "default", 1)
            back = sweeper.execute(select(JOBS).where(JOBS.c.id == ids["ended"])).one()
            assert back.isolated and back.lease_owner is None
            assert back.last_error == f"lease expired: worker {owners['ended']} did not finish attempt 1 of 20"
            assert {n: status_of(sweeper, i) for n, i in ids.items() if n not in ("ended", "expired")} == dict.fromkeys(
                ("held", "beating", "unmarked"), "running")
    finally:
        holder.close()  # its session lock with it
        fresh.dispose()


def test_sweep_refuses_half_the_workers_settings() -> None:
    with pytest.raises(ValueError, match="both lease and heartbeat"):
        q.sweep_expired(EmailJob, lease=30)


def test_a_second_expiry_in_a_row_marks_the_job_solitary(engine: Engine) -> None:
    """A job isolated already when its lease expires again gets the reason that makes the
    worker run it alone in the whole worker; a retry in between clears it."""
    with engine.begin() as conn:
        (job_id,) = add_jobs(conn, 1)

        def expire_and_sweep(owner: str) -> Any:
            assert len(claim(conn, owner=owner, isolated=conn.scalar(select(JOBS.c.isolated)))) == 1
            conn.execute(update(JOBS).values(lease_expires_at=func.now() - timedelta(seconds=1)))
            conn.execute(q.sweep_expired(EmailJob))
            return conn.execute(select(JOBS).where(JOBS.c.id == job_id)).one()

        once = expire_and_sweep("a")
        assert once.isolated and not q.is_solitary(once.isolated, once.last_error)
        twice = expire_and_sweep("b")
        assert twice.last_error == f"{q.SOLITARY_REASON}: worker b did not finish attempt 2 of 20"
        assert q.is_solitary(twice.isolated, twice.last_error)
        thrice = expire_and_sweep("c")
        assert q.is_solitary(thrice.isolated, thrice.last_error)
        (row,) = claim(conn, owner="d", isolated=True)
        conn.execute(q.retry_if_owner(EmailJob, owner="d", token=(job_id, row.attempts), error="boom", delay=0))
        after = conn.execute(select(JOBS).where(JOBS.c.id == job_id)).one()
        assert not q.is_solitary(after.isolated, after.last_error)
    assert not q.is_solitary(True, None) and not q.is_solitary(False, f"{q.SOLITARY_REASON}: worker x")


def _compiled(engine: Engine, stmt: Any) -> Any:
    from sqla_queue.driver import compile_statement

    return compile_statement(stmt, engine.dialect)


def _raw(engine: Engine) -> Any:
    import psycopg

    return psycopg.connect(engine.url.set(drivername="postgresql").render_as_string(hide_password=False),
                           autocommit=True)


def test_release_lost_claims_gives_back_the_unheld_rows_of_one_owner(engine: Engine) -> None:
    """Compiled once and run on the psycopg cursor, as the worker runs it."""
    from sqla_queue.ops import token_values as tokens_params

    with engine.begin() as conn:
        add_jobs(conn, 6)
        mine = [r.id for r in claim(conn, owner="w/0.0", limit=4)]
        theirs = [r.id for r in claim(conn, owner="w/1.0", limit=2)]
    stmt = _compiled(engine, q.release_lost_claims(EmailJob))
    with _raw(engine) as raw:
        # The first two are kept: one as held (attempt 1), one on an older attempt (0),
        # as if a lost claim had claimed again a job let go on that attempt.
        keep = [(mine[0], 1), (mine[1], 0)]
        values = {**tokens_params("w/0.0", keep), q.FRESH_PARAM: 60.0}
        back = raw.execute(stmt.sql, stmt.params(values)).fetchall()
        assert sorted(r[0] for r in back) == sorted(mine[1:]) and {r[1] for r in back} == {1}
    with engine.connect() as conn:
        found = {r.id: (r.status, r.attempts, r.max_attempts, r.lease_owner) for r in conn.execute(select(JOBS))}
        default = found[mine[0]][2]
    # Not counted, and never handed out again: max_attempts grows, attempts stays.
    assert {i: found[i] for i in mine[1:]} == dict.fromkeys(mine[1:], ("pending", 1, default + 1, None))
    assert {i: found[i][0] for i in [mine[0], *theirs]} == dict.fromkeys([mine[0], *theirs], "running")


def test_a_claim_can_pass_over_keys_and_list_its_candidates(engine: Engine) -> None:
    with engine.begin() as conn:
        ids = add_jobs(conn, 5)
    values = {q.OWNER_PARAM: "w", q.LIMIT_PARAM: 10, q.LEASE_PARAM: 30.0, q.SKIP_PARAM: ids[:2]}
    candidates = _compiled(engine, q.claim_candidates(EmailJob, queues=("default",)))
    skipping = _compiled(engine, q.claim_template(EmailJob, queues=("default",), skip=True))
    by_key = _compiled(engine, q.claim_template(EmailJob, by_key=True))
    with _raw(engine) as raw:
        listed = raw.execute(candidates.sql, candidates.params({q.LIMIT_PARAM: 2, q.SKIP_PARAM: ids[:2]})).fetchall()
        assert [r[0] for r in listed] == ids[2:4]
        pk = list(JOBS.c).index(JOBS.c.id)
        one = raw.execute(by_key.sql, by_key.params({**values, q.KEY_PARAM: ids[4]})).fetchall()
        assert [r[pk] for r in one] == [ids[4]]
        claimed = raw.execute(skipping.sql, skipping.params(values)).fetchall()
        assert sorted(r[pk] for r in claimed) == ids[2:4]
    with engine.connect() as conn:
        assert [status_of(conn, i) for i in ids[:2]] == ["pending", "pending"]


@pytest.mark.parametrize(("fresh_for", "claimed"), [(0.3, 0), (60.0, 2)], ids=["stale", "fresh"])
def test_a_fresh_claim_that_waited_too_long_behind_a_lock_claims_nothing(
    engine: Engine, fresh_for: float, claimed: int
) -> None:
    """A claim its sender gave up on (it dropped the connection after its deadline) may
    still wait in the server behind a lock and run when the lock goes: guarded with
    ``fresh``, it then claims nothing, so no row is left claimed for no one."""
    import threading
    import time

    from .helpers import wait_for

    with engine.begin() as conn:
        ids = add_jobs(conn, 2)
    stmt = _compiled(engine, q.claim_template(EmailJob, fresh=True))
    values = {q.OWNER_PARAM: "w", q.LIMIT_PARAM: 10, q.LEASE_PARAM: 30.0, q.FRESH_PARAM: fresh_for}
    got: list[Any] = []
    with _raw(engine) as locker, _raw(engine) as claimer:
        pid = claimer.info.backend_pid
        locker.execute("BEGIN")
        locker.execute("LOCK TABLE email_jobs IN ACCESS EXCLUSIVE MODE")
        thread = threading.Thread(target=lambda: got.extend(claimer.execute(stmt.sql, stmt.params(values)).fetchall()))
        thread.start()
        waiting = "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = %s"
        wait_for(lambda: locker.execute(waiting, (pid,)).fetchone() == (True,), what="the claim waiting on the lock")
        began = time.monotonic()
        wait_for(lambda: time.monotonic() - began > 0.5, what="the claim to wait longer than 0.3 s")
        locker.execute("ROLLBACK")
        thread.join(10)
    assert len(got) == claimed
    with engine.connect() as conn:
        statuses = sorted(status_of(conn, i) for i in ids)
    assert statuses == (["running", "running"] if claimed else ["pending", "pending"])


def test_fail_unclaimable_dead_letters_a_pending_job_without_spending_an_attempt(engine: Engine) -> None:
    with engine.begin() as conn:
        add_jobs(conn, 2)
        (running,) = [r.id for r in claim(conn, limit=1)]
        (pending,) = conn.scalars(select(JOBS.c.id).where(JOBS.c.status == "pending"))
    stmt = _compiled(engine, q.fail_unclaimable(EmailJob))
    with _raw(engine) as raw:
        assert raw.execute(stmt.sql, stmt.params({q.KEY_PARAM: running, q.ERROR_PARAM: "no"})).fetchall() == []
        assert raw.execute(stmt.sql, stmt.params({q.KEY_PARAM: pending, q.ERROR_PARAM: "x"})).fetchall() == [
            (pending,)
        ]
    with engine.connect() as conn:
        row = conn.execute(select(JOBS).where(JOBS.c.id == pending)).one()
        assert status_of(conn, running) == "running"
    assert (row.status, row.attempts, row.last_error) == ("failed", 0, "x")


def test_the_heartbeat_with_an_owner_prefix_extends_every_executors_tokens(engine: Engine) -> None:
    with engine.begin() as conn:
        add_jobs(conn, 3)
        a = [(r.id, r.attempts) for r in claim(conn, owner="w:1/0.0", limit=2)]
        b = [(r.id, r.attempts) for r in claim(conn, owner="w:1/1.3", limit=1)]
    from sqla_queue.ops import token_values as tokens_params

    stmt = _compiled(engine, q.extend_unlocked_leases_if_owner(EmailJob, owner_prefix=True))
    owned = _compiled(engine, q.owned_tokens(EmailJob, owner_prefix=True))
    with _raw(engine) as raw:
        extended = raw.execute(stmt.sql, stmt.params({**tokens_params("w:1/", a + b), q.LEASE_PARAM: 30.0}))
        assert sorted(extended.fetchall()) == sorted(a + b)
        other = stmt.params({**tokens_params("w:10/", a + b), q.LEASE_PARAM: 30.0})  # another worker
        assert raw.execute(stmt.sql, other).fetchall() == []
        assert sorted(raw.execute(owned.sql, owned.params(tokens_params("w:1/", a + b))).fetchall()) == sorted(a + b)


def test_concurrent_sweeps_move_each_job_once(engine: Engine) -> None:
    with engine.begin() as conn:
        add_jobs(conn, 20)
        claim(conn, owner="gone", limit=20)
        conn.execute(update(JOBS).values(lease_expires_at=func.now() - timedelta(seconds=1)))
    with engine.connect() as a, engine.connect() as b:
        a.begin()
        b.begin()
        b.execute(text("SET LOCAL lock_timeout = '1s'"))
        first = a.execute(q.sweep_expired(EmailJob, limit=12)).all()
        second = b.execute(q.sweep_expired(EmailJob, limit=12)).all()
        a.commit()
        b.commit()
    ids = [r[0] for r in [*first, *second]]
    assert len(ids) == len(set(ids)) == 20


def test_release_hands_jobs_back_without_counting_the_attempt(engine: Engine) -> None:
    """A refund never gives the attempt number back (the next claim's token is a new
    one): ``max_attempts`` grows by one instead."""
    with engine.begin() as conn:
        add_jobs(conn, 2)
        rows = claim(conn, owner="leaving")
        tokens = [ClaimToken(r.id, r.attempts) for r in rows]
        (default,) = conn.execute(select(JOBS.c.max_attempts).distinct()).scalars().all()
        released = conn.scalars(q.release_if_owner(EmailJob, owner="leaving", tokens=tokens)).all()
        assert sorted(released) == sorted(t.job_id for t in tokens)
        assert conn.execute(select(JOBS.c.status, JOBS.c.attempts, JOBS.c.max_attempts).distinct()).all() == [
            ("pending", 1, default + 1)]
        assert {r.attempts for r in claim(conn, owner="next")} == {2}


# -- requeue, cancel, prune, archive, stats ------------------------------------------------


def test_requeue_failed_gives_fresh_attempts(engine: Engine) -> None:
    with engine.begin() as conn:
        (dead,) = add_jobs(conn, 1, status="failed", attempts=3, last_error="boom", finished_at=func.now())
        (other,) = add_jobs(conn, 1, status="failed", attempts=3, queue="other", finished_at=func.now())
        (done,) = add_jobs(conn, 1, status="done", finished_at=func.now())
        assert conn.scalars(q.requeue_failed(EmailJob, queues=["default"])).all() == [dead]
        job = conn.execute(select(JOBS).where(JOBS.c.id == dead)).one()
        assert (job.status, job.attempts, job.finished_at, job.last_error) == ("pending", 0, None, "boom")
        assert conn.scalars(q.requeue_failed(EmailJob, ids=[other, done])).all() == [other]


def test_cancel_only_touches_pending_jobs(engine: Engine) -> None:
    with engine.begin() as conn:
        pending, running = add_jobs(conn, 2)
        claim(conn, limit=1)
        assert conn.scalars(q.cancel_pending(EmailJob, ids=[pending, running])).all() == [running]
        assert status_of(conn, pending) == "running" and status_of(conn, running) == "cancelled"


def test_prune_deletes_old_finished_jobs_and_keeps_dead_letters(engine: Engine) -> None:
    old = func.now() - timedelta(days=10)
    with engine.begin() as conn:
        old_done = add_jobs(conn, 3, status="done", finished_at=old)
        (old_failed,) = add_jobs(conn, 1, status="failed", finished_at=old)
        (recent,) = add_jobs(conn, 1, status="done", finished_at=func.now())
        (pending,) = add_jobs(conn, 1)
        result = conn.execute(q.prune_finished(EmailJob, older_than=timedelta(days=7), limit=2))
        assert result.rowcount == 2
        conn.execute(q.prune_finished(EmailJob, older_than=timedelta(days=7)))
        left = set(conn.scalars(select(JOBS.c.id)))
        assert left == {old_failed, recent, pending} and not left & set(old_done)
        conn.execute(q.prune_finished(EmailJob, older_than=timedelta(days=7), statuses=["failed"]))
        assert set(conn.scalars(select(JOBS.c.id))) == {recent, pending}
    with pytest.raises(ValueError, match="only finished jobs"):
        q.prune_finished(EmailJob, older_than=1, statuses=["running"])


def test_archive_moves_finished_jobs_in_one_statement(engine: Engine) -> None:
    archive = archive_table(EmailJob, "email_jobs_archive")
    archive.create(engine)
    try:
        with engine.begin() as conn:
            old = func.now() - timedelta(days=2)
            moved = add_jobs(conn, 2, status="done", finished_at=old)
            (kept,) = add_jobs(conn, 1)
            stmt = q.archive_finished(EmailJob, archive, older_than=timedelta(days=1))
            assert sorted(conn.scalars(stmt)) == moved
            assert list(conn.scalars(select(JOBS.c.id))) == [kept]
            rows = conn.execute(select(archive)).all()
            assert sorted(r.id for r in rows) == moved
            assert all(r.recipient.startswith("r") and r.archived_at is not None for r in rows)
    finally:
        archive.drop(engine)
        Base.metadata.remove(archive)


def test_queue_stats(engine: Engine) -> None:
    with engine.begin() as conn:
        add_jobs(conn, 2, run_after=func.now() - timedelta(minutes=5))
        add_jobs(conn, 1, queue="other", status="failed")
        stats = {(r.queue, r.status): r for r in conn.execute(q.queue_stats(EmailJob))}
    assert stats[("default", "pending")].jobs == 2
    assert stats[("default", "pending")].oldest_runnable_age >= timedelta(minutes=5)
    assert stats[("other", "failed")].jobs == 1 and stats[("other", "failed")].oldest_runnable_age is None


# -- plans and printed SQL -----------------------------------------------------------------


def _plan(conn: Connection, stmt: Any) -> str:
    compiled = stmt.compile(dialect=conn.dialect)
    rows = conn.exec_driver_sql("EXPLAIN " + str(compiled), compiled.params)
    return "\n".join(r[0] for r in rows)


def _generic_plan(conn: Connection, stmt: Any) -> str:
    """The plan of ``stmt`` prepared with its parameters unknown (a generic plan).

    psycopg prepares statements it runs repeatedly and PostgreSQL may then plan them
    without looking at the values: a bound ``status = $1`` could not use a partial index.
    """
    from psycopg import sql as pgsql
    from sqlalchemy.dialects.postgresql import asyncpg  # compiles to $n placeholders

    compiled = stmt.compile(dialect=asyncpg.dialect())  # type: ignore[no-untyped-call]
    values = [compiled.params[name] for name in compiled.positiontup or []]
    raw = conn.connection.driver_connection
    assert raw is not None
    raw.execute("SET plan_cache_mode = force_generic_plan")
    raw.execute(f"PREPARE sqla_queue_plan AS {compiled}")
    explain = pgsql.SQL("EXPLAIN EXECUTE sqla_queue_plan({})").format(
        pgsql.SQL(", ").join(pgsql.Literal(v) for v in values)
    )
    plan = "\n".join(str(r[0]) for r in raw.execute(explain))
    raw.execute("DEALLOCATE sqla_queue_plan")
    raw.execute("RESET plan_cache_mode")
    return plan


@pytest.mark.timeout(300)
def test_claim_plans_use_the_partial_indexes_among_many_finished_rows(engine: Engine) -> None:
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO email_jobs (recipient, status, queue, finished_at) "
                "SELECT 'x', 'done', 'q' || (i % 5), now() FROM generate_series(1, 100000) i"
            )
        )
        add_jobs(conn, 200, queue="q1")
        conn.execute(text("ANALYZE email_jobs"))
    with engine.connect() as conn:
        everywhere = _plan(conn, q.claim(EmailJob, owner="w", limit=10))
        one_queue = _plan(conn, q.claim(EmailJob, owner="w", limit=10, queues=["q1"]))
        sweep = _plan(conn, q.sweep_expired(EmailJob))
        session_sweep = _plan(conn, q.sweep_expired(EmailJob, lease=30, heartbeat=1))
        generic_session_sweep = _generic_plan(conn, q.sweep_expired(EmailJob, lease=30, heartbeat=1))
        generic_everywhere = _generic_plan(conn, q.claim(EmailJob, owner="w", limit=10))
        generic_one_queue = _generic_plan(conn, q.claim(EmailJob, owner="w", limit=10, queues=["q1"]))
    assert "email_jobs_claim_idx" in generic_everywhere, generic_everywhere
    assert "email_jobs_claim_queue_idx" in generic_one_queue, generic_one_queue
    assert "email_jobs_claim_idx" in everywhere and "Sort" not in everywhere, everywhere
    assert "email_jobs_claim_queue_idx" in one_queue and "Sort" not in one_queue, one_queue
    assert "email_jobs_lease_idx" in sweep, sweep
    for plan in (session_sweep, generic_session_sweep):  # one range of running leases, whatever the owners
        assert "email_jobs_lease_idx" in plan and "Seq Scan on email_jobs" not in plan, plan
    assert "Seq Scan" not in everywhere + one_queue


def test_builders_print_readable_sql() -> None:
    dialect = postgresql.dialect()  # type: ignore[no-untyped-call]
    claim_sql = str(q.claim(EmailJob, owner="w", limit=5).compile(dialect=dialect))
    assert "FOR UPDATE SKIP LOCKED" in claim_sql
    assert "email_jobs.status = 'pending'" in claim_sql  # a literal: the partial index matches
    assert "RETURNING" in claim_sql
    complete = str(q.complete_if_owner(EmailJob, owner="w", tokens=[(1, 1), (2, 1)]).compile(dialect=dialect))
    # The fence's status, as no partial index on status matches it: found by key.
    assert "(email_jobs.status || '') = 'running'" in complete and "lease_owner" in complete
    assert "email_jobs.id = ANY (" in complete and "unnest(" in complete  # arrays: no IN list


def test_builders_compose_with_the_callers_statements(engine: Engine) -> None:
    """A builder is a plain Core statement: add filters or returned columns to it."""
    with engine.begin() as conn:
        add_jobs(conn, 3)
        stmt = q.claim(EmailJob, owner="w", limit=3).where(JOBS.c.recipient != "r1@example.com")
        assert {r.recipient for r in conn.execute(stmt)} == {"r0@example.com", "r2@example.com"}




# -- intervals are seconds; empty id lists mean none ---------------------------------------


def test_intervals_are_seconds_across_a_daylight_saving_change(engine: Engine) -> None:
    """A one-day delay is 86400 s even when the session's clocks go forward that night."""
    from zoneinfo import ZoneInfo

    from sqlalchemy import DateTime, Interval, literal

    start = datetime(2026, 3, 28, 12, 0, tzinfo=ZoneInfo("Europe/Paris"))  # DST begins 29 March
    at = literal(start, DateTime(timezone=True))
    with engine.connect() as conn:
        conn.execute(text("SET TIME ZONE 'Europe/Paris'"))
        calendar = conn.scalar(select(at + literal(timedelta(days=1), Interval())))
        exact = conn.scalar(select(at + q.seconds_interval(timedelta(days=1).total_seconds())))
        conn.rollback()
    utc_start = start.astimezone(UTC)
    assert calendar is not None and exact is not None
    assert calendar.astimezone(UTC) - utc_start == timedelta(hours=23)  # the trap
    assert exact.astimezone(UTC) - utc_start == timedelta(seconds=86400)


def test_every_builder_sends_its_durations_as_seconds() -> None:
    dialect = postgresql.dialect()  # type: ignore[no-untyped-call]
    day = timedelta(days=1)
    token = ClaimToken(1, 1)
    statements = [
        q.claim(EmailJob, owner="w", lease=day),
        q.extend_leases_if_owner(EmailJob, owner="w", tokens=[token], lease=day),
        q.retry_if_owner(EmailJob, owner="w", token=token, error="e", delay=day),
        q.requeue_failed(EmailJob, delay=day),
        q.prune_finished(EmailJob, older_than=day),
        q.archive_finished(EmailJob, archive_table(EmailJob, "email_jobs_archive_sql", Base.metadata), older_than=day),
    ]
    Base.metadata.remove(Base.metadata.tables["email_jobs_archive_sql"])
    for stmt in statements:
        compiled = stmt.compile(dialect=dialect)
        assert "* interval '1 second'" in str(compiled)
        # A retry's delays travel as an array, one per token.
        values = [v for value in compiled.params.values() for v in (value if isinstance(value, list) else [value])]
        assert 86400.0 in values
        assert not any(isinstance(v, timedelta) for v in values)


def test_requeue_and_retry_delays_count_from_the_statement(engine: Engine) -> None:
    with engine.begin() as conn:
        (dead,) = add_jobs(conn, 1, status="failed", attempts=3, finished_at=func.now())
        conn.execute(select(func.pg_sleep(0.5)))
        before = conn.scalar(select(func.clock_timestamp()))
        conn.execute(q.requeue_failed(EmailJob, ids=[dead], delay=10))
        run_after = conn.scalar(select(JOBS.c.run_after).where(JOBS.c.id == dead))
        assert before is not None and run_after is not None
        assert run_after >= before + timedelta(seconds=10)


def test_empty_ids_mean_no_jobs(engine: Engine) -> None:
    from sqla_queue import admin

    with engine.begin() as conn:
        dead = add_jobs(conn, 2, status="failed", attempts=3, finished_at=func.now())
        pending = add_jobs(conn, 2)
        assert conn.scalars(q.requeue_failed(EmailJob, ids=[])).all() == []
        assert conn.scalars(q.cancel_pending(EmailJob, ids=[])).all() == []
        assert conn.scalars(q.cancel_pending(EmailJob, ids=iter(()))).all() == []
        assert {status_of(conn, i) for i in pending} == {"pending"}
    assert admin.requeue(engine, EmailJob, ids=[]) == 0
    with engine.connect() as conn:
        assert {status_of(conn, i) for i in dead} == {"failed"}
    assert admin.requeue(engine, EmailJob, ids=None) == 2
    with pytest.raises(TypeError, match="single string"):
        q.cancel_pending(EmailJob, ids="12")


# -- statements compiled once, several queues, many tokens ---------------------------------


def _sorts_over_the_table(node: dict[str, Any], limited: bool = False) -> list[str]:
    """Sort nodes of a JSON plan that sort rows read from a table with no LIMIT between
    (a sort of every matching pending row), as opposed to a sort of limited subresults."""
    found: list[str] = []
    kind = node["Node Type"]
    if kind == "Sort" and not limited and _reads_the_table(node):
        found.append(f"Sort {node.get('Sort Key')}")
    below_limit = limited or kind == "Limit"
    if kind == "Sort":
        below_limit = False  # what the sort consumes is not limited by a LIMIT above it
    for child in node.get("Plans", []):
        found += _sorts_over_the_table(child, below_limit)
    return found


def _reads_the_table(node: dict[str, Any]) -> bool:
    if node["Node Type"] == "Limit":
        return False
    if "Relation Name" in node:
        return True
    return any(_reads_the_table(child) for child in node.get("Plans", []))


def _json_plan(conn: Connection, stmt: Any, *, analyze: bool) -> dict[str, Any]:
    compiled = stmt.compile(dialect=conn.dialect)
    options = "ANALYZE, FORMAT JSON" if analyze else "FORMAT JSON"
    (plan,) = conn.exec_driver_sql(f"EXPLAIN ({options}) " + str(compiled), compiled.params).scalar_one()
    root: dict[str, Any] = plan["Plan"]
    return root


def _generic_json_plan(conn: Connection, stmt: Any) -> dict[str, Any]:
    from psycopg import sql as pgsql
    from sqlalchemy.dialects.postgresql import asyncpg

    compiled = stmt.compile(dialect=asyncpg.dialect())  # type: ignore[no-untyped-call]
    values = [compiled.params[name] for name in compiled.positiontup or []]
    raw = conn.connection.driver_connection
    assert raw is not None
    raw.execute("SET plan_cache_mode = force_generic_plan")
    raw.execute(f"PREPARE sqla_queue_plan AS {compiled}")
    explain = pgsql.SQL("EXPLAIN (FORMAT JSON) EXECUTE sqla_queue_plan({})").format(
        pgsql.SQL(", ").join(pgsql.Literal(v) for v in values)
    )
    (row,) = raw.execute(explain).fetchall()
    raw.execute("DEALLOCATE sqla_queue_plan")
    raw.execute("RESET plan_cache_mode")
    root: dict[str, Any] = row[0][0]["Plan"]
    return root


def _nodes(node: dict[str, Any]) -> list[dict[str, Any]]:
    return [node, *(n for child in node.get("Plans", []) for n in _nodes(child))]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("queues", [["q1"], ["q1", "q2", "q3"]], ids=["one queue", "three queues"])
def test_claim_of_several_queues_reads_the_queue_index_in_order(engine: Engine, queues: list[str]) -> None:
    """A backlog of 40,000 pending jobs in five queues: the claim reads each served
    queue's index in claim order and stops after ``limit`` rows per queue; it never
    sorts every pending row of the queues it serves (``queue IN (...)`` did)."""
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO email_jobs (recipient, queue, priority, run_after) "
                "SELECT 'x', 'q' || (i % 5), i % 3, now() - interval '1 hour' + (i % 997) * interval '1 ms' "
                "FROM generate_series(1, 40000) i"
            )
        )
        conn.execute(text("ANALYZE email_jobs"))
    limit = 10
    stmt = q.claim(EmailJob, owner="w", limit=limit, queues=queues)
    with engine.connect() as conn:
        with conn.begin() as tx:  # EXPLAIN ANALYZE runs the claim: roll it back
            executed = _json_plan(conn, stmt, analyze=True)
            tx.rollback()
        generic = _generic_json_plan(conn, stmt)
    for plan in (executed, generic):
        assert _sorts_over_the_table(plan) == [], plan
        scans = [n for n in _nodes(plan) if n.get("Relation Name") == "email_jobs" and "Index Name" in n]
        assert {n["Index Name"] for n in scans} >= {"email_jobs_claim_queue_idx"}, plan
        assert not [n for n in _nodes(plan) if n["Node Type"] == "Bitmap Heap Scan"], plan
    assert not [n for n in _nodes(executed) if n["Node Type"] == "Seq Scan"], executed
    read = sum(
        n["Actual Rows"] * n["Actual Loops"]
        for n in _nodes(executed)
        if n.get("Index Name") == "email_jobs_claim_queue_idx"
    )
    assert read <= limit * len(queues), executed  # 8,000 pending rows per queue, 10 read from each


def test_claim_of_several_queues_keeps_claim_order_and_the_other_queues(engine: Engine) -> None:
    with engine.begin() as conn:
        low_b = add_jobs(conn, 2, queue="b", priority=0)
        high_c = add_jobs(conn, 2, queue="c", priority=5)
        mid_d = add_jobs(conn, 2, queue="d", priority=3)
        add_jobs(conn, 3, queue="a", priority=9)
        claimed = {r.id for r in claim(conn, limit=5, queues=["b", "c", "d"])}
        assert claimed == {*high_c, *mid_d, low_b[0]}
        assert [r.id for r in claim(conn, limit=5, queues=("b", "c", "d"))] == low_b[1:]
        assert claim(conn, queues=["b", "c", "d", "c"]) == []
        assert conn.scalar(select(func.count()).where(JOBS.c.queue == "a", JOBS.c.status == "pending")) == 3


def test_compile_statement_refuses_placeholders_only_sqlalchemy_fills_in() -> None:
    from sqla_queue.driver import CompileOnceError, compile_statement

    dialect = postgresql.psycopg.dialect()  # type: ignore[no-untyped-call]
    with pytest.raises(CompileOnceError, match="ANY"):
        compile_statement(select(JOBS.c.id).where(JOBS.c.queue.in_(["a", "b"])), dialect)
    with pytest.raises(CompileOnceError):
        compile_statement(select(JOBS.c.id).limit(bindparam("n", 5, literal_execute=True)), dialect)


#: Every builder a statement can be compiled once from, with lists of several values.
_COMPILED_ONCE: list[Any] = [
    lambda: q.claim_template(EmailJob, queues=["a", "b", "c"]),
    lambda: q.claim_template(EmailJob, queues=["a", "b", "c"], isolated=True),
    lambda: q.complete_many_if_owner_then_claim(EmailJob, queues=["a", "b", "c"]),
    lambda: q.complete_many_if_owner_then_claim(EmailJob, queues=["a", "b"], isolated=True),
    lambda: q.next_run_after(EmailJob, queues=["a", "b", "c"]),
    lambda: q.isolated_waiting(EmailJob, queues=["a", "b", "c"]),
    lambda: q.claim(EmailJob, owner="w", queues=["a", "b", "c"]),
    lambda: q.requeue_failed(EmailJob, ids=[1, 2, 3], queues=["a", "b"]),
    lambda: q.cancel_pending(EmailJob, ids=[1, 2, 3]),
    lambda: q.complete_if_owner(EmailJob, owner="w", tokens=[(1, 1), (2, 1)]),
    lambda: q.extend_leases_if_owner(EmailJob, owner="w", tokens=[(1, 1), (2, 1)], lease=5),
    lambda: q.release_if_owner(EmailJob, owner="w", tokens=[(1, 1), (2, 1)]),
    lambda: q.prune_finished(EmailJob, older_than=5, statuses=["done", "failed"]),
]


@pytest.mark.parametrize("build", _COMPILED_ONCE)
def test_builders_with_several_values_run_as_compiled_once(engine: Engine, build: Any) -> None:
    """Compiled once and sent as text to the psycopg cursor, as the worker and
    ``enqueue_values`` do: no expanding parameter is left for SQLAlchemy to fill in."""
    from sqla_queue.driver import compile_statement
    from sqla_queue.sql import LEASE_PARAM, LIMIT_PARAM, OWNER_PARAM

    with engine.begin() as conn:
        add_jobs(conn, 3, queue="b")
        statement = compile_statement(build(), conn.dialect)
        params = {OWNER_PARAM: "w", LIMIT_PARAM: 5, LEASE_PARAM: 30.0, "sqla_queue_ids": [], "sqla_queue_attempts": []}
        cursor = conn.connection.driver_connection.cursor()  # type: ignore[union-attr]
        cursor.execute(statement.sql, statement.params(params))  # raised UndefinedColumn "__"


@pytest.mark.timeout(300)
def test_public_token_builders_take_ten_thousand_tokens(engine: Engine) -> None:
    n = 10_001
    with engine.begin() as conn:
        conn.execute(text(f"INSERT INTO email_jobs (recipient) SELECT 'x' FROM generate_series(1, {n})"))
        tokens = [ClaimToken(r.id, r.attempts) for r in claim(conn, owner="w", limit=n)]
        assert len(tokens) == n
        extended = conn.scalars(q.extend_leases_if_owner(EmailJob, owner="w", tokens=tokens, lease=300)).all()
        assert len(extended) == n
        stale = [ClaimToken(t.job_id, t.attempt + 1) for t in tokens]
        assert conn.scalars(q.release_if_owner(EmailJob, owner="w", tokens=stale)).all() == []
        released = conn.scalars(q.release_if_owner(EmailJob, owner="w", tokens=tokens)).all()
        assert sorted(released) == sorted(t.job_id for t in tokens)
        tokens = [ClaimToken(r.id, r.attempts) for r in claim(conn, owner="w", limit=n)]
        done = conn.scalars(q.complete_if_owner(EmailJob, owner="w", tokens=[*tokens, *tokens])).all()
        assert len(done) == n
        assert conn.scalar(select(func.count()).where(JOBS.c.status == "done")) == n


def test_token_fence_matches_each_id_with_its_own_attempt(engine: Engine) -> None:
    with engine.begin() as conn:
        add_jobs(conn, 3)
        a, b, c = [ClaimToken(r.id, r.attempts) for r in claim(conn, owner="w")]
        mixed = [(a.job_id, b.attempt + 1), (b.job_id, b.attempt), (c.job_id, a.attempt + 7)]
        assert conn.scalars(q.complete_if_owner(EmailJob, owner="w", tokens=mixed)).all() == [b.job_id]


_FACTORS = [1, 1.0001, 1.5, 2, 10, 1e6, 1e300, float("inf")]
_ATTEMPTS = [-5, 0, 1, 2, 3, 10, 64, 1000, 1024, 1075, 10**6, 10**18, 10**100]


@pytest.mark.parametrize("cap", [0, 0.5, 3600, 1e12, float("inf")])
def test_backoff_gives_a_delay_for_every_attempt_and_factor(cap: float) -> None:
    for factor in _FACTORS:
        for base in (0, 0.001, 1, 1e300, float("inf")):
            for jitter in (0, 0.25, 1):
                backoff = Backoff(base=base, factor=factor, cap=cap, jitter=jitter)
                previous = 0.0
                for attempt in _ATTEMPTS:
                    low, high = backoff.bounds(attempt)
                    assert 0 <= low <= high <= min(cap, q.MAX_BACKOFF_SECONDS), (backoff, attempt)
                    for rand in (0.0, 0.5, 0.999999):
                        seconds = backoff.delay(attempt, rand=functools.partial(float, rand)).total_seconds()
                        assert low - 1e-6 <= seconds <= high + 1e-6, (backoff, attempt)
                    if jitter == 0:
                        assert low >= previous, (backoff, attempt)  # never shrinks
                        previous = low


def test_backoff_with_an_infinite_cap_reaches_its_ceiling() -> None:
    backoff = Backoff(cap=float("inf"), jitter=0)
    assert backoff.delay(1000).total_seconds() == q.MAX_BACKOFF_SECONDS
    assert backoff.delay(3).total_seconds() == 4
    for bad in (float("nan"), "1"):
        with pytest.raises(ValueError):
            Backoff(cap=bad)  # type: ignore[arg-type]


def test_next_due_and_isolated_waiting_with_several_queues_run_as_compiled_once(engine: Engine) -> None:
    from sqla_queue.driver import compile_statement

    with engine.begin() as conn:
        add_jobs(conn, 1, queue="x", run_after=func.now() + timedelta(seconds=30))
        add_jobs(conn, 1, queue="x", isolated=True)
        cursor = conn.connection.driver_connection.cursor()  # type: ignore[union-attr]

        def run(stmt: Any) -> Any:
            statement = compile_statement(stmt, conn.dialect)
            return cursor.execute(statement.sql, statement.params({})).fetchone()[0]

        assert run(q.next_run_after(EmailJob, queues=["b", "c"])) is None
        assert run(q.isolated_waiting(EmailJob, queues=["b", "c"])) is False
        add_jobs(conn, 1, queue="c", run_after=func.now() + timedelta(seconds=120))
        add_jobs(conn, 1, queue="b", isolated=True)
        assert float(run(q.next_run_after(EmailJob, queues=["b", "c"]))) == pytest.approx(120, abs=2)
        assert float(run(q.next_run_after(EmailJob, queues=["x", "c"]))) == pytest.approx(30, abs=2)
        assert run(q.isolated_waiting(EmailJob, queues=["b", "c"])) is True


@pytest.mark.timeout(300)
def test_a_bulk_batch_reads_the_key_index_from_where_the_last_one_ended(engine: Engine) -> None:
    """A batch of an action by filter walks the primary key down from ``before``: it
    reads about its ``limit`` rows wherever the walk is, never the whole table sorted;
    a requeue's guard of unique keys reads the unique index, not the table."""
    with engine.begin() as conn:
        conn.execute(text(
            "INSERT INTO email_jobs (recipient, status, queue, finished_at, last_error) "
            "SELECT 'x', CASE WHEN i % 2 = 0 THEN 'failed' ELSE 'pending' END, 'q' || (i % 5), now(), 'boom' "
            "FROM generate_series(1, 100000) i"
        ))
        conn.execute(text("ANALYZE email_jobs"))
    moment = datetime.now(UTC)
    batches = {
        "requeue": q.requeue_batch(EmailJob, queues=["q1"], created_before=moment, before=50_000),
        "cancel": q.cancel_batch(EmailJob, queues=["q1"], statuses=["failed", "pending"], before=50_000),
        "delete": q.delete_batch(EmailJob, queues=["q1"], error_contains="boo", created_before=moment, before=50_000),
    }
    with engine.connect() as conn:
        plans = {name: _generic_plan(conn, stmt) for name, stmt in batches.items()}
    for name, plan in plans.items():
        assert "Index Scan Backward using email_jobs_pkey" in plan, (name, plan)
        assert "Sort" not in plan and "Seq Scan" not in plan, (name, plan)

