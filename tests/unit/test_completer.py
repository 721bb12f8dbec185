"""The completer's fallbacks, against the in-memory operations layer (no database, no
threads): lost answers read back, lost leases, errors of one job's text, a completion
sent with the next claim that failed, and a transactional commit that had landed."""

from __future__ import annotations

from typing import Any

import pytest

from sqla_queue import ClaimToken
from sqla_queue.worker.completer import Completer
from sqla_queue.worker.config import WorkerConfig
from sqla_queue.worker.context import WorkerContext
from sqla_queue.worker.executor import CompleteThenClaim
from sqla_queue.worker.hooks import Hooks
from sqla_queue.worker.ledger import Held, Ledger
from sqla_queue.worker.outcome import Kind, Outcome
from sqla_queue.worker.stats import WorkerStats
from sqla_queue.worker.work_signal import WorkSignal

from ..fakes import FakeConn, FakeDriver, FakeOps, Fault, connection_lost, rejected

OWNER = "w/0.0"


class Setup:
    def __init__(self, n: int, **job: Any) -> None:
        self.ops = FakeOps()
        self.ops.add(n, **job)
        request = self.ops.claim_request(OWNER, n)
        claimed = self.ops.fetch_claimed(None, request)
        self.ops.calls.clear()
        self.ledger = Ledger()
        self.held = [Held(c.token, job=c.job, owner=OWNER) for c in claimed]
        self.ledger.add(self.held)
        self.stats = WorkerStats()
        self.connections: list[FakeConn] = []
        config = WorkerConfig(lease=5.0, reconnect_backoff=0.01)
        ctx = WorkerContext(config, self.ledger, FakeDriver(), self.ops, WorkSignal(1), self.stats,  # type: ignore[arg-type]
                            "w", Hooks(self.stats))
        self.completer = Completer(ctx)

    def connect(self) -> Any:
        conn = FakeConn()
        self.connections.append(conn)
        return conn

    def record(self, outcomes: list[Outcome], **kw: Any) -> Any:
        return self.completer.record(self.connect, outcomes, **kw)

    def status(self, held: Held) -> str:
        return self.ops.jobs[held.token.job_id].status


@pytest.mark.parametrize("n", [1, 3])
def test_done_outcomes_are_recorded_in_one_statement(n: int) -> None:
    s = Setup(n)
    s.record([Outcome(h, Kind.DONE) for h in s.held])
    assert s.ops.calls == ["complete"]
    assert [s.status(h) for h in s.held] == ["done"] * n
    assert (s.stats.done, s.stats.lost, len(s.ledger)) == (n, 0, 0)


@pytest.mark.parametrize("lands", [False, True])
def test_a_connection_lost_under_a_completion_is_retried_and_a_landed_one_counts(lands: bool) -> None:
    """The repeat of a statement whose answer was lost moves nothing if the first try had
    landed: the rows are read back, and done by this owner and attempt counts as done."""
    s = Setup(3)
    s.ops.faults["complete"] = [Fault(connection_lost(), lands=lands)]
    s.record([Outcome(h, Kind.DONE) for h in s.held])
    assert s.ops.calls == ["complete", "complete", *(["token_states"] if lands else [])]
    assert s.connections[0].closed, "the connection of the failed try is closed, the repeat makes a new one"
    assert [s.status(h) for h in s.held] == ["done"] * 3
    assert (s.stats.done, s.stats.lost, len(s.ledger)) == (3, 0, 0)


def test_a_token_whose_lease_was_lost_meanwhile_is_counted_lost_not_done() -> None:
    s = Setup(3)
    taken = s.held[1]
    s.ops.jobs[taken.token.job_id].lease_owner = "someone else"  # swept and re-claimed
    s.record([Outcome(h, Kind.DONE) for h in s.held])
    assert (s.stats.done, s.stats.lost) == (2, 1)
    assert taken.lost and s.status(taken) == "running"
    assert len(s.ledger) == 0


def test_a_retry_whose_error_text_the_server_refuses_is_stored_with_a_safe_text() -> None:
    """A batch that fails on one job's text is recorded one job at a time, and that job's
    retry again with a text that can always be stored: no attempt is left unrecorded."""
    s = Setup(3)
    s.ops.rejects = lambda error: "bad" in error
    errors = ["first", "bad \udc80 text", "third"]
    s.record([Outcome(h, Kind.RETRY, e, 0.0) for h, e in zip(s.held, errors, strict=True)])
    assert s.ops.calls == ["retry"] * 5  # the batch, the first, the bad one twice, the third
    stored = [s.ops.jobs[h.token.job_id].last_error for h in s.held]
    assert stored == ["first", "the error text could not be stored", "third"]
    assert [s.status(h) for h in s.held] == ["pending"] * 3
    assert (s.stats.retried, s.stats.lost, len(s.ledger)) == (3, 0, 0)


def test_an_outcome_that_cannot_be_recorded_at_all_is_let_go_for_its_lease_to_expire() -> None:
    s = Setup(1)
    s.ops.faults["fail"] = [Fault(rejected())] * 3
    (held,) = s.held
    s.record([Outcome(held, Kind.FAIL, "boom")])
    assert s.ops.calls == ["fail"] * 3  # the batch, then alone as given, then with the safe text
    assert held.lost and s.status(held) == "running" and len(s.ledger) == 0
    assert s.stats.failed == 0


def test_a_retry_of_an_exhausted_job_is_counted_failed() -> None:
    s = Setup(2, max_attempts=1)
    s.record([Outcome(h, Kind.RETRY, "boom", 1.0) for h in s.held])
    assert [s.status(h) for h in s.held] == ["failed", "failed"]
    assert (s.stats.failed, s.stats.retried) == (2, 0)


def test_the_completion_with_the_next_claim_returns_the_claimed_rows() -> None:
    s = Setup(2)
    more = s.ops.add(2)
    combined = CompleteThenClaim(s.ops, s.completer.driver, s.ledger, s.completer)
    done = s.record([Outcome(h, Kind.DONE) for h in s.held], claim_owner=OWNER)
    assert s.ops.calls == []  # left to the executor's statement
    claimed = combined(s.connect, done, s.ops.claim_request(OWNER, 5))
    assert s.ops.calls == ["complete_then_claim"]
    assert claimed is not None
    assert sorted(c.token for c in claimed) == [ClaimToken(i, 1) for i in more]
    assert (s.stats.done, len(s.ledger)) == (2, 0)


def test_done_outcomes_claimed_under_another_owner_than_the_next_claim_are_recorded_apart() -> None:
    s = Setup(2)
    assert s.record([Outcome(h, Kind.DONE) for h in s.held], claim_owner="w/0.1") == []
    assert s.ops.calls == ["complete"]
    assert (s.stats.done, len(s.ledger)) == (2, 0)


@pytest.mark.parametrize("lands", [False, True])
def test_a_completion_with_the_next_claim_lost_with_its_connection(lands: bool) -> None:
    """Not retried as one (the claim may have committed unseen: the owner's claim is
    marked unknown, for recovery); the completion is recorded on its own and, if the lost
    try had landed, read back."""
    s = Setup(2)
    s.ops.add(2)
    s.ops.faults["complete_then_claim"] = [Fault(connection_lost(), lands=lands)]
    combined = CompleteThenClaim(s.ops, s.completer.driver, s.ledger, s.completer)
    done = s.record([Outcome(h, Kind.DONE) for h in s.held], claim_owner=OWNER)
    assert combined(s.connect, done, s.ops.claim_request(OWNER, 5)) is None
    assert s.ledger.unknown_claims("w/0.") == [OWNER]
    assert s.ops.calls == ["complete_then_claim", "complete", *(["token_states"] if lands else [])]
    assert (s.stats.done, s.stats.lost, len(s.ledger)) == (2, 0, 0)


def test_a_transactional_commit_that_landed_after_all_counts_as_done() -> None:
    """The handler's transaction committed the completion, but its answer was lost: the
    release the completer makes matches nothing, and the row, done by this owner and
    attempt, says the job is done."""
    s = Setup(1)
    (held,) = s.held
    s.ops.complete_in_transaction(None, OWNER, held.token)  # the commit that landed unseen
    outcome = Outcome(held, Kind.RELEASE, "connection lost")
    outcome.unsure = True
    s.record([outcome])
    assert s.ops.calls == ["release", "token_states"]
    assert (s.stats.done, s.stats.released, s.stats.lost, len(s.ledger)) == (1, 0, 0, 0)


def test_an_unsure_release_whose_commit_did_not_land_releases_the_job() -> None:
    s = Setup(1)
    (held,) = s.held
    outcome = Outcome(held, Kind.RELEASE, "connection lost")
    outcome.unsure = True
    s.record([outcome])
    assert s.ops.calls == ["release"]
    job = s.ops.jobs[held.token.job_id]
    # The attempt is not counted (max_attempts grows) and never handed out again.
    assert (job.status, job.attempts, job.max_attempts) == ("pending", 1, 6)
    assert (job.last_error, s.stats.released, s.stats.done) == ("connection lost", 1, 0)


def test_every_end_of_a_job_passes_settle_once() -> None:
    """done (by statement and by the handler's transaction), retried, dead-lettered,
    handed back and lost: each job's end reaches ``settle``, the one place hooks attach."""
    s = Setup(6)
    ends: list[tuple[int, str]] = []
    settle = s.completer.settle

    def spy(results: Any, **kw: Any) -> None:
        ends.extend((r.held.token.job_id, r.status) for r in results)
        settle(results, **kw)

    s.completer.settle = spy  # type: ignore[method-assign]
    done, committed, retried, failed, released, lost = s.held
    s.ops.jobs[committed.token.job_id].status = "done"  # the handler's transaction did it
    s.record([
        Outcome(done, Kind.DONE),
        Outcome(committed, Kind.COMMITTED),
        Outcome(retried, Kind.RETRY, "boom", 1.0),
        Outcome(failed, Kind.FAIL, "bad"),
        Outcome(released, Kind.RELEASE),
        Outcome(lost, Kind.LOST),
    ])
    assert sorted(ends) == sorted([
        (done.token.job_id, "done"), (committed.token.job_id, "done"), (retried.token.job_id, "retried"),
        (failed.token.job_id, "failed"), (released.token.job_id, "released"), (lost.token.job_id, "lost"),
    ])
    assert (s.stats.done, s.stats.retried, s.stats.failed, s.stats.released, s.stats.lost) == (2, 1, 1, 1, 1)
    assert len(s.ledger) == 0


def _with_progress(held: Held, value: Any) -> Held:
    held.progress_encoder = FakeOps().progress_encoder(100)
    held.job_context(running=False).progress(value)
    return held


@pytest.mark.parametrize("kind", [Kind.DONE, Kind.RETRY, Kind.FAIL, Kind.SNOOZE, Kind.RELEASE])
def test_every_outcome_records_its_handler_s_progress_and_only_done_a_result(kind: Kind) -> None:
    """Each kind's statement takes the jobs' progress (None: unchanged) and, on a table
    that keeps results, ``done`` the results, one value per token."""
    s = Setup(3)
    s.ops.stores_results = s.ops.stores_progress = True
    s.ops.jobs[s.held[1].token.job_id].progress = '"before"'
    _with_progress(s.held[0], {"step": 1})
    _with_progress(s.held[2], [3])
    s.record([Outcome(h, kind, "E" if kind in (Kind.RETRY, Kind.FAIL) else "", result=f"{n}") for n, h in
              enumerate(s.held)])
    jobs = [s.ops.jobs[h.token.job_id] for h in s.held]
    assert [j.progress for j in jobs] == ['{"step": 1}', '"before"', "[3]"]
    assert [j.result for j in jobs] == (["0", "1", "2"] if kind is Kind.DONE else [None] * 3)


def test_the_completion_sent_with_the_next_claim_takes_results_and_progress() -> None:
    s = Setup(2)
    s.ops.stores_results = s.ops.stores_progress = True
    _with_progress(s.held[1], 50)
    s.ops.add(1)
    left = s.record([Outcome(h, Kind.DONE, result=f'"r{n}"') for n, h in enumerate(s.held)], claim_owner=OWNER)
    claimed = CompleteThenClaim(s.ops, FakeDriver(), s.ledger, s.completer)(  # type: ignore[arg-type]
        s.connect, left, s.ops.claim_request(OWNER, 5))
    assert claimed is not None and len(claimed) == 1
    jobs = [s.ops.jobs[h.token.job_id] for h in s.held]
    assert [(j.status, j.result, j.progress) for j in jobs] == [("done", '"r0"', None), ("done", '"r1"', "50")]


def test_progress_is_checked_where_the_handler_records_it() -> None:
    from sqla_queue import ResultNotStorable
    from sqla_queue.current import JobContext

    context = JobContext(None, ClaimToken(1, 1), None, None)
    with pytest.raises(TypeError, match=r"keeps no progress: mix sqla_queue\.ResultMixin"):
        context.progress(1)
    held = _with_progress(Held(ClaimToken(1, 1), owner=OWNER), {"ok": True})
    context = held.job_context()
    assert held.progress == '{"ok": true}'
    with pytest.raises(ResultNotStorable, match="the job's progress is 102 characters of JSON, over the progress"):
        context.progress("x" * 100)
    with pytest.raises(ResultNotStorable, match="the job's progress is not JSON-serialisable"):
        context.progress({1, 2})
    assert held.progress == '{"ok": true}', "a refused value leaves the last one"
