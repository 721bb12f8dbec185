"""Rate limits (``RateLimit`` in ``__queue_flow__``): at most N starts in any period, per
key, per queue or in the table, counted over the rows' own start times.

``RatedJob``: five starts per account in any half second (strict), twenty per queue in
any second (default mode).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, func, insert, select, text, update

from sqla_queue import JobMixin, RateLimit
from sqla_queue import sql as q
from sqla_queue.rules import takes_turns

from .helpers import table_of, wait_for
from .models import RatedJob

RATED = table_of(RatedJob)


def add(engine: Engine, rows: list[dict[str, Any]]) -> list[int]:
    with engine.begin() as conn:
        return list(conn.scalars(insert(RATED).returning(RATED.c.id), rows))


def claim(engine: Engine, owner: str, limit: int = 50, **options: Any) -> list[Any]:
    with engine.begin() as conn:
        conn.execute(q.flow_lock(RatedJob))
        return list(conn.execute(q.claim(RatedJob, owner=owner, limit=limit, **options)))


def hold(engine: Engine, ids: list[int]) -> None:
    """Move these jobs' starts an hour ahead, so their window cannot pass while the test
    runs however slow the machine is (a start counts from its time on)."""
    backdate(engine, ids, -HOUR)


HOUR = 3600.0


def backdate(engine: Engine, ids: list[int], seconds: float) -> None:
    """Move these jobs' starts ``seconds`` into the past (as if time had passed)."""
    with engine.begin() as conn:
        conn.execute(update(RATED).where(RATED.c.id.in_(ids)).values(
            started_at=RATED.c.started_at - text(f"interval '{seconds} seconds'")))


def test_a_rate_limit_is_a_checked_value() -> None:
    rule = RateLimit(10, per=timedelta(minutes=1), key="queue")
    assert rule.seconds == 60.0 and not rule.strict
    for bad in (0, True, 2.5):
        with pytest.raises(ValueError, match="RateLimit limit"):
            RateLimit(bad, per=1)  # type: ignore[arg-type]
    for per in (0, -1, float("nan"), 10**6, "1s"):
        with pytest.raises(ValueError, match="RateLimit per"):
            RateLimit(1, per=per)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="strict"):
        RateLimit(1, per=1, strict=1)  # type: ignore[arg-type]
    assert not takes_turns([rule]) and takes_turns([RateLimit(1, per=1, strict=True)])


def test_each_rate_limit_gets_an_index_of_starts() -> None:
    names = {str(i.name): [c.name for c in i.columns] for i in RATED.indexes}
    assert names["rated_jobs_starts_account_idx"] == ["started_at", "account"]
    assert names["rated_jobs_starts_queue_idx"] == ["started_at", "queue"]


def test_a_claim_takes_what_is_left_in_the_window(engine: Engine) -> None:
    add(engine, [{"account": "a"}] * 8 + [{"account": "b"}] * 2 + [{"account": None}] * 3)
    first = claim(engine, "w1")
    assert sorted((r.account or "-") for r in first) == ["-", "-", "-", "a", "a", "a", "a", "a", "b", "b"]
    hold(engine, [r.id for r in first])
    assert claim(engine, "w2") == []  # a's five starts fill its half second
    # Finished, the jobs still count: a start is a start.
    with engine.begin() as conn:
        conn.execute(update(RATED).values(status="done", finished_at=func.now()).where(RATED.c.status == "running"))
    assert claim(engine, "w3") == []
    backdate(engine, [r.id for r in first], HOUR + 0.6)  # the half second went by
    assert [r.account for r in claim(engine, "w4")] == ["a"] * 3


def test_the_per_queue_limit_holds_across_keys(engine: Engine) -> None:
    add(engine, [{"account": f"k{i}"} for i in range(30)])
    first = claim(engine, "w1")
    assert len(first) == 20
    hold(engine, [r.id for r in first])
    assert claim(engine, "w2") == []


def test_a_strict_limit_starts_no_job_again_within_its_period(engine: Engine) -> None:
    """A retry's start would replace its first in the count: it waits out the period."""
    (job_id,) = add(engine, [{"account": "a"}])
    (claimed,) = claim(engine, "w1")
    hold(engine, [job_id])
    with engine.begin() as conn:  # failed at once, retried with no backoff
        conn.execute(update(RATED).where(RATED.c.id == job_id).values(status="pending", run_after=func.now()))
    assert claim(engine, "w2") == []
    backdate(engine, [job_id], HOUR + 0.6)
    assert [r.id for r in claim(engine, "w3")] == [claimed.id]


def test_a_retention_shorter_than_a_period_is_refused(engine: Engine, make_worker: Any) -> None:
    with pytest.raises(ValueError, match="shorter than the 1 s period"):
        make_worker(engine, RatedJob, lambda job: None, retention={"done": 0.5})
    make_worker(engine, RatedJob, lambda job: None, retention=timedelta(days=1))


def _windows(starts: list[float], per: float) -> int:
    """The most starts in any window of ``per`` seconds."""
    starts = sorted(starts)
    most, first = 0, 0
    for last, moment in enumerate(starts):
        while moment - starts[first] >= per:
            first += 1
        most = max(most, last - first + 1)
    return most


def test_a_worker_never_starts_more_than_the_strict_rate(engine: Engine, start_worker: Any) -> None:
    """Eight executors, forty jobs of two accounts: every half second of the rows' start
    times holds at most five of one account, and the worker, idle between windows, wakes
    when the next start is allowed (its poll is a minute)."""
    ids = add(engine, [{"account": "ab"[i % 2]} for i in range(40)])
    start_worker(handler=lambda job: None, model=RatedJob, concurrency=8, poll_interval=60.0)
    wait_for(lambda: _done(engine, ids), timeout=30, what="every job done")
    with engine.connect() as conn:
        rows = conn.execute(select(RATED.c.account, func.extract("epoch", RATED.c.started_at))).all()
    for account in "ab":
        starts = [float(t) for a, t in rows if a == account]
        assert len(starts) == 20 and _windows(starts, 0.5) <= 5
    # The rule held the starts back: the work took at least three windows per account.
    spread = max(float(t) for _, t in rows) - min(float(t) for _, t in rows)
    assert spread >= 1.5, spread


def _done(engine: Engine, ids: list[int]) -> bool:
    with engine.connect() as conn:
        return conn.scalar(select(func.count()).where(RATED.c.id.in_(ids), RATED.c.status == "done")) == len(ids)


def test_until_idle_waits_out_the_windows_and_returns(engine: Engine, make_worker: Any) -> None:
    ids = add(engine, [{"account": "a"}] * 12)
    make_worker(engine, RatedJob, lambda job: None, poll_interval=0.2).run(until_idle=True)
    assert _done(engine, ids)


def test_a_model_without_started_at_cannot_declare_a_rate_limit() -> None:
    from sqlalchemy.orm import DeclarativeBase

    class Other(DeclarativeBase):
        pass

    with pytest.raises(ValueError, match="lacks"):

        class Old(Other, JobMixin):
            __tablename__ = "old_rated_jobs"
            __queue_flow__ = RateLimit(1, per=1)
            started_at = None


@pytest.mark.system
@pytest.mark.xdist_group("many_connections")  # with the benchmark tests: see test_benchmarks.py
def test_eight_processes_never_start_more_than_the_strict_rate(engine: Engine, worker_processes: Any,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Eight worker processes of two executors, sixty jobs of two accounts: in the rows'
    start times (the server's clock), no half second holds more than five starts of one
    account, and no second more than twenty of the queue (the default mode: its claims
    take their turns with the strict rule's)."""
    monkeypatch.setenv("SQLA_QUEUE_TEST_FLOW_MODEL", "RatedJob")
    flags = ("--concurrency", "2", "--poll-interval", "0.5s")
    for _ in range(8):
        worker_processes(*flags, target="tests.flow_app:make_worker")
    ids = add(engine, [{"account": "ab"[i % 2]} for i in range(60)])
    wait_for(lambda: _done(engine, ids), timeout=60, what="every job done")
    with engine.connect() as conn:
        rows = conn.execute(select(RATED.c.account, func.extract("epoch", RATED.c.started_at))).all()
    for account in "ab":
        assert _windows([float(t) for a, t in rows if a == account], 0.5) <= 5
    assert _windows([float(t) for _, t in rows], 1.0) <= 20
