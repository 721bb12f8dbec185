"""The ledger's rules, as pure logic (no database): lost claims and solitary jobs."""

from __future__ import annotations

import threading

import pytest

from sqla_queue import ClaimToken, JobCancelled, JobContext
from sqla_queue.worker.ledger import Held, Ledger, Start


def _held(job_id: int, owner: str = "w/0.0", *, solitary: bool = False) -> Held:
    return Held(ClaimToken(job_id, 1), owner=owner, isolated=solitary, solitary=solitary)


def test_a_lost_claim_is_recovered_keeping_the_jobs_held_under_its_name() -> None:
    ledger = Ledger()
    assert ledger.lane_owner("w/0.") == "w/0.0"
    ledger.add([_held(1), _held(2, "w/1.0")])
    ledger.claim_unknown("w/0.0")
    assert ledger.unknown_claims("w/0.") == ["w/0.0"] and ledger.unknown_claims("w/1.") == []
    assert ledger.recovery("w/0.0") == [ClaimToken(1, 1)]
    ledger.recovered("w/0.0")
    assert ledger.unknown_claims("w/0.") == []
    assert ledger.lane_owner("w/0.") == "w/0.0"  # nothing was let go: the name stays


def test_a_job_let_go_unsettled_is_kept_by_recovery_and_retires_its_name() -> None:
    """A job let go while its row may still be running under its name must not be given
    back as a lost claim's: it is remembered while a recovery may need it, and the
    executor claims under a new name from then on."""
    ledger = Ledger()
    name = ledger.lane_owner("w/0.")
    first, second = _held(1, name), _held(2, name)
    ledger.add([first, second])
    ledger.claim_unknown(name)
    ledger.lose([first], settled=True)  # the database said its row is not ours: no doubt
    assert ledger.recovery(name) == [second.token]
    ledger.lose([second])  # its row may still be running under the name
    assert ledger.recovery(name) == [second.token]
    assert ledger.lane_owner("w/0.") == "w/0.1"
    assert ledger.recovery(name) == [second.token]  # still needed: its recovery is pending
    ledger.recovered(name)
    assert ledger.recovery(name) == []  # forgotten once no recovery can need it
    third = _held(3, "w/0.1")
    ledger.add([third])
    ledger.lose([third])  # no recovery pending for w/0.1: forgotten when the name moves on
    assert ledger.lane_owner("w/0.") == "w/0.2" and ledger.recovery("w/0.1") == []


def test_a_solitary_job_waits_for_the_worker_to_hold_nothing_else() -> None:
    ledger = Ledger()
    running, waiting = _held(1), _held(2)
    ledger.add([running, waiting])
    assert ledger.start(running) is Start.RUN
    mark = ledger.begin_claim()
    assert mark is not None
    solitary = _held(3, solitary=True)
    ledger.add([solitary])
    ledger.end_claim(mark)
    assert ledger.solitary and ledger.begin_claim() is None  # no claim while it is held
    assert ledger.start(waiting) is Start.DEFER  # handed back unstarted, to make room
    verdict: list[Start] = []
    starter = threading.Thread(target=lambda: verdict.append(ledger.start(solitary)))
    starter.start()
    ledger.remove([waiting])
    starter.join(0.3)
    assert starter.is_alive(), "the solitary job started beside a running one"
    ledger.remove([running])
    starter.join(5)
    assert verdict == [Start.RUN]
    ledger.remove([solitary])
    assert not ledger.solitary and ledger.begin_claim() is not None


def test_a_lost_job_that_never_started_is_forgotten() -> None:
    ledger = Ledger()
    held = _held(1)
    ledger.add([held])
    ledger.mark_lost(held)
    assert ledger.start(held) is Start.SKIP
    assert len(ledger) == 0


def test_a_stopping_worker_begins_no_claim_and_waits_for_those_in_flight() -> None:
    ledger = Ledger()
    mark = ledger.begin_claim()
    assert mark is not None
    closed: list[bool] = []
    closer = threading.Thread(target=lambda: closed.append(ledger.close_claims(10)))
    closer.start()
    closer.join(0.3)
    assert closer.is_alive(), "close_claims returned while a claim was in flight"
    assert ledger.begin_claim() is None  # none begins once the stop began
    claimed = _held(1)
    ledger.add([claimed])
    ledger.end_claim(mark)
    closer.join(5)
    assert closed == [True]
    assert ledger.take_unstarted() == [claimed]  # the claim's rows are there for the hand-back
    assert ledger.close_claims(0) is True and ledger.begin_claim() is None


def test_a_claim_still_out_at_the_stop_is_reported() -> None:
    ledger = Ledger()
    assert ledger.begin_claim() is not None
    assert ledger.close_claims(0.05) is False


def test_a_job_is_taken_for_hand_back_once() -> None:
    ledger = Ledger()
    first, second = _held(1), _held(2)
    ledger.add([first, second])
    assert ledger.take_unstarted() == [first, second]
    assert ledger.take([first, second]) == []  # the stop has them: the executor gives back none
    third = _held(3)
    ledger.add([third])
    assert ledger.take([third]) == [third]
    assert ledger.take([third]) == [] and ledger.take_unstarted() == []


def test_a_job_told_to_stop_before_its_context_exists_hands_the_reason_to_it() -> None:
    held = Held(ClaimToken(1, 1))
    assert held.tell("cancelled", "by the operator")
    context = held.job_context()
    assert context.cancelled and context.running
    with pytest.raises(JobCancelled, match="by the operator"):
        context.check()
    assert held.job_context() is context
    assert not held.tell("timed out")  # once


def test_a_context_made_before_the_handler_starts_is_not_running_until_it_does() -> None:
    held = Held(ClaimToken(1, 1))
    context = held.job_context(running=False)
    assert not context.running and not context.should_stop
    assert held.tell("timed out", "timed out after 1 s")
    assert context.timed_out and context.wait(0)


def test_a_context_made_while_the_job_is_told_to_stop_always_learns_it() -> None:
    """The handler's first ``current_job()`` and a cancel on another thread, at once, many
    times: whichever comes first, the context ends up stopped, with one context per job."""
    for n in range(500):
        held = Held(ClaimToken(n, 1))
        barrier = threading.Barrier(3)
        made: list[JobContext] = []

        def make(held: Held = held, barrier: threading.Barrier = barrier, made: list[JobContext] = made) -> None:
            barrier.wait()
            made.append(held.job_context())

        def tell(held: Held = held, barrier: threading.Barrier = barrier) -> None:
            barrier.wait()
            held.tell("cancelled")

        threads = [threading.Thread(target=make), threading.Thread(target=make), threading.Thread(target=tell)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert made[0] is made[1] is held.context
        assert held.context.cancelled
