"""The ledger's rules, as pure logic (no database): lost claims and solitary jobs."""

from __future__ import annotations

import threading

from sqla_queue import ClaimToken
from sqla_queue.worker.ledger import Held, Ledger, Start


def _held(job_id: int, owner: str = "w/0.0", *, solitary: bool = False) -> Held:
    return Held(ClaimToken(job_id, 1), owner=owner, isolated=solitary, solitary=solitary)


def test_a_lost_claim_is_recovered_keeping_every_held_job() -> None:
    ledger = Ledger()
    ledger.add([_held(1), _held(2, "w/1.0")])
    ledger.claim_unknown("w/0.0", ledger.generation)
    assert ledger.unknown_claims("w/0.") == ["w/0.0"] and ledger.unknown_claims("w/1.") == []
    assert sorted(ledger.recovery("w/0.0") or []) == [1, 2]
    ledger.recovered("w/0.0")
    assert ledger.unknown_claims("w/0.") == []


def test_a_job_let_go_unsettled_makes_recovery_unsafe_and_moves_the_generation() -> None:
    ledger = Ledger()
    first, second = _held(1), _held(2)
    ledger.add([first, second])
    ledger.claim_unknown("w/0.0", 0)
    ledger.lose([first], settled=True)  # the database said its row is not ours: no doubt
    assert ledger.generation == 0 and ledger.recovery("w/0.0") == [2]
    ledger.lose([second])  # its row may still be running under w/0.0
    assert ledger.generation == 1
    assert ledger.recovery("w/0.0") is None
    assert ledger.unknown_claims("w/") == []  # given up: the rows return after their lease


def test_a_solitary_job_waits_for_the_worker_to_hold_nothing_else() -> None:
    ledger = Ledger()
    running, waiting = _held(1), _held(2)
    ledger.add([running, waiting])
    assert ledger.start(running) is Start.RUN
    assert ledger.begin_claim()
    solitary = _held(3, solitary=True)
    ledger.add([solitary])
    ledger.end_claim()
    assert ledger.solitary and not ledger.begin_claim()  # no claim while it is held
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
    assert not ledger.solitary and ledger.begin_claim()


def test_a_lost_job_that_never_started_is_forgotten() -> None:
    ledger = Ledger()
    held = _held(1)
    ledger.add([held])
    ledger.mark_lost(held.token)
    assert ledger.start(held) is Start.SKIP
    assert len(ledger) == 0
