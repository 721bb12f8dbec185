"""The work signal, as pure logic: no database, no worker."""

from __future__ import annotations

import threading
import time

from sqla_queue.worker.work_signal import WorkSignal


def test_a_wake_up_lets_one_waiter_through_at_once() -> None:
    signal = WorkSignal(threads=2)
    signal.wake()
    before = signal.generation
    started = time.monotonic()
    signal.wait(poll=60)  # returns on the token, not at the poll
    assert time.monotonic() - started < 30
    assert signal.generation == before  # a token is consumed, not counted again


def test_wake_ups_never_pile_up_beyond_the_threads() -> None:
    signal = WorkSignal(threads=2)
    signal.wake(10)
    signal.wait(poll=60)
    signal.wait(poll=60)
    # Both tokens spent: a third wait ends only at its poll (a token would end it
    # without counting a new generation).
    generation = signal.generation
    signal.wait(poll=0)
    assert signal.generation == generation + 1  # ended by the poll


def test_a_due_time_in_the_past_ends_the_wait_and_is_consumed() -> None:
    signal = WorkSignal(threads=1)
    signal.wake_at(time.monotonic() - 1)
    assert signal.next_due() is not None
    signal.wait(poll=60)
    assert signal.next_due() is None


def test_close_due_times_are_kept_once_and_the_heap_stays_bounded() -> None:
    signal = WorkSignal(threads=1)
    now = time.monotonic() + 1000
    signal.wake_at(now)
    signal.wake_at(now + 0.001)  # within 5 ms of the first: the same wake-up
    assert signal.next_due() == now
    for n in range(5000):
        signal.wake_at(now + 10 + n)
    assert len(signal._due) <= 1025
    assert signal.next_due() == now  # the soonest is never dropped


def test_quiet_means_every_thread_idle_no_token_and_nothing_due_soon() -> None:
    signal = WorkSignal(threads=1)
    assert not signal.quiet(threads=1, within=0.05)  # nobody is waiting yet
    entered = threading.Event()
    release = threading.Event()

    def waiter() -> None:
        entered.set()
        signal.wait(poll=60)
        release.set()

    thread = threading.Thread(target=waiter)
    thread.start()
    entered.wait(10)
    deadline = time.monotonic() + 10
    while signal.idle != 1 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert signal.quiet(threads=1, within=0.05)
    signal.wake_at(time.monotonic() + 0.01)  # due within the window: not quiet
    assert not signal.quiet(threads=1, within=60)
    signal.stop()
    thread.join(10)
    assert release.is_set() and not thread.is_alive()


def test_stop_releases_every_waiter() -> None:
    signal = WorkSignal(threads=3)
    threads = [threading.Thread(target=signal.wait, args=(600,)) for _ in range(3)]
    for thread in threads:
        thread.start()
    signal.stop()
    for thread in threads:
        thread.join(10)
    assert not any(thread.is_alive() for thread in threads)
    signal.wait(poll=600)  # a wait after stop returns at once
