"""The claim cursor's rules (:mod:`sqla_queue.worker.cursor`), as pure logic: no database.

Where the worker's ordinary claims start: after the last job claimed, until a claim from
the head of the pending index is due (the rescan, spaced by its cost), owed (a cursor
claim found nothing), or needed again (a claim from the head found jobs behind the
cursor). The statements that start after a key are tested in ``tests/test_claim_cursor.py``.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from sqla_queue.worker.cursor import ClaimCursor

T0 = datetime(2026, 1, 1, tzinfo=UTC)
Q = "default"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now



def test_a_cursor_starts_after_the_last_key_a_claim_from_the_head_took_until_the_rescan() -> None:
    clock = Clock()
    cursor = ClaimCursor(1.0, clock, slack=0)
    assert cursor.start() is None  # nothing claimed yet: from the head
    cursor.claimed([(0, T0, 1, Q), (0, T0, 2, Q)], from_head=True)
    assert cursor.start() == {None: (0, T0, 2)}
    clock.now = 0.99
    assert cursor.start() == {None: (0, T0, 2)}
    clock.now = 1.0
    assert cursor.start() is None  # the rescan is due


def test_a_cursor_starts_its_slack_before_the_last_run_after_claimed() -> None:
    """A job committed a moment after a later-starting one sorts just behind the last
    key claimed: the cursor claim starts the slack (seconds of run_after) earlier."""
    clock = Clock()
    cursor = ClaimCursor(1.0, clock, slack=1.5)
    cursor.claimed([(0, T0, 7, Q)], from_head=True)
    assert cursor.start() == {None: (0, T0 - timedelta(seconds=1.5), 7)}
    clock.now = 1.0  # a claim from the head finds a job inside the slack: not behind
    cursor.claimed([(0, T0 - timedelta(seconds=1), 5, Q)], from_head=True)
    assert cursor.start() == {None: (0, T0 - timedelta(seconds=1.5), 7)}
    clock.now = 2.0  # one before it: behind, the next claim is from the head too
    cursor.claimed([(0, T0 - timedelta(seconds=2), 4, Q)], from_head=True)
    assert cursor.start() is None


def test_the_cursor_is_the_last_key_in_the_claims_order_and_only_moves_forward() -> None:
    cursor = ClaimCursor(60.0, Clock(), slack=0)
    later = T0 + timedelta(seconds=1)
    # Priority 5 sorts before priority 0; within one, run_after then the key.
    cursor.claimed([(0, T0, 3, Q), (5, later, 9, Q), (0, T0, 2, Q)], from_head=True)
    assert cursor.start() == {None: (0, T0, 3)}
    cursor.claimed([(0, T0, 1, Q)], from_head=False)  # a straggler behind it: no step back
    assert cursor.start() == {None: (0, T0, 3)}
    cursor.claimed([(-1, T0, 1, Q)], from_head=False)  # a lower priority: after it
    assert cursor.start() == {None: (-1, T0, 1)}


def test_claims_stay_at_the_head_while_they_find_jobs_behind_the_cursor() -> None:
    clock = Clock()
    cursor = ClaimCursor(1.0, clock, slack=0)
    cursor.claimed([(0, T0, 10, Q)], from_head=True)
    clock.now = 1.0  # the rescan finds jobs a long transaction committed late
    assert cursor.start() is None
    cursor.claimed([(0, T0 - timedelta(seconds=5), 4, Q)], from_head=True)
    assert cursor.start() is None  # more may wait there: the next claim too
    cursor.claimed([(0, T0 + timedelta(seconds=1), 11, Q)], from_head=True)
    assert cursor.start() == {None: (0, T0 + timedelta(seconds=1), 11)}
    cursor.claimed([], from_head=True)  # nothing: the cursor stays, the rescan waits
    assert cursor.start() == {None: (0, T0 + timedelta(seconds=1), 11)}


def test_a_cursor_claim_that_finds_nothing_owes_a_claim_from_the_head_at_the_next_rescan() -> None:
    clock = Clock()
    cursor = ClaimCursor(1.0, clock, slack=0)
    cursor.claimed([(0, T0, 10, Q)], from_head=True)
    assert cursor.head_claim_at() is None
    cursor.claimed([(0, T0, 11, Q)], from_head=False)
    assert cursor.head_claim_at() is None  # it found jobs: none owed
    cursor.claimed([], from_head=False)
    assert cursor.head_claim_at() == 1.0
    clock.now = 1.0
    assert cursor.start() is None
    cursor.claimed([], from_head=True)  # paid: nothing anywhere, the worker may idle
    assert cursor.head_claim_at() is None


def test_one_claim_from_the_head_at_a_time_the_claims_meanwhile_keep_to_the_cursor() -> None:
    """Under a held snapshot a claim from the head takes tens of milliseconds: the claims
    made while it runs (the other executors', woken for new jobs) must not each become
    one too."""
    clock = Clock()
    cursor = ClaimCursor(1.0, clock, slack=0)
    cursor.claimed([(0, T0, 2, Q)], from_head=True)
    clock.now = 1.0
    assert cursor.start() is None  # the rescan, handed to this claim
    assert cursor.start() == {None: (0, T0, 2)}  # not to the next, while it runs
    clock.now = 1.5
    cursor.claimed([], from_head=True, took=0.001)
    assert cursor.start() == {None: (0, T0, 2)}
    clock.now = 2.5
    assert cursor.start() is None


def test_a_claim_from_the_head_that_never_reports_back_does_not_stop_the_rescans() -> None:
    clock = Clock()
    cursor = ClaimCursor(1.0, clock, slack=0)
    cursor.claimed([(0, T0, 2, Q)], from_head=True)
    clock.now = 1.0
    assert cursor.start() is None  # its statement fails: claimed() is never called
    clock.now = 1.99
    assert cursor.start() == {None: (0, T0, 2)}
    clock.now = 2.0
    assert cursor.start() is None


@pytest.mark.parametrize(
    ("took", "interval"), [(0.0, 0.25), (0.004, 0.25), (0.02, 0.8), (0.05, 2.0), (0.5, 2.0)]
)
def test_the_rescan_waits_in_proportion_to_what_the_last_claim_from_the_head_cost(
    took: float, interval: float
) -> None:
    """A claim from the head costs in proportion to the dead entries before the cursor:
    the rescans are spaced so that they take a fortieth of the time, between the
    interval and the longest wait."""
    clock = Clock()
    cursor = ClaimCursor(0.25, clock, slack=0, max_rescan_interval=2.0)
    cursor.claimed([(0, T0, 2, Q)], from_head=True, took=took)
    assert cursor.interval == pytest.approx(interval)
    clock.now = interval - 0.001
    assert cursor.start() == {None: (0, T0, 2)}
    clock.now = interval
    assert cursor.start() is None
    cursor.claimed([], from_head=True, took=0.001)  # cheap again: back to the interval
    assert cursor.interval == pytest.approx(0.25)


def test_a_worker_serving_several_queues_keeps_a_cursor_for_each() -> None:
    """Each queue is an index range of its own (``<table>_claim_queue_idx``): its claims
    start after the last job claimed from it, whatever other queues' cursors say."""
    clock = Clock()
    cursor = ClaimCursor(1.0, clock, slack=0, per_queue=True)
    later = T0 + timedelta(seconds=1)
    cursor.claimed([(0, T0, 3, "a"), (0, later, 9, "b"), (0, T0, 2, "a")], from_head=True)
    assert cursor.start() == {"a": (0, T0, 3), "b": (0, later, 9)}
    cursor.claimed([(0, T0, 5, "b")], from_head=False)  # behind b's cursor, after a's: b's stays
    assert cursor.start() == {"a": (0, T0, 3), "b": (0, later, 9)}
    cursor.claimed([(0, later, 4, "a")], from_head=False)
    assert cursor.start() == {"a": (0, later, 4), "b": (0, later, 9)}
    clock.now = 1.0  # the rescan finds a job of b behind b's cursor (though after a's)
    assert cursor.start() is None
    cursor.claimed([(0, T0, 6, "b")], from_head=True)
    assert cursor.start() is None  # behind: the next claim is from the head too
