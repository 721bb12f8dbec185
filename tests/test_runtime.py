"""The asyncio runtime's pool for plain handlers: bounded, reused, and never in the way of exit."""

from __future__ import annotations

import concurrent.futures
import threading

import pytest

from sqla_queue.runtime import _DaemonThreadPool

from .helpers import wait_for


def test_pool_runs_at_most_size_at_once_on_daemon_threads_it_reuses() -> None:
    pool = _DaemonThreadPool(2, "test-pool")
    release = threading.Event()
    lock = threading.Lock()
    running: list[str] = []
    peak = [0]

    def work(n: int) -> str:
        with lock:
            running.append(threading.current_thread().name)
            peak[0] = max(peak[0], len(running))
        release.wait(10)
        with lock:
            running.remove(threading.current_thread().name)
        assert threading.current_thread().daemon
        return f"done {n}"

    futures = [pool.submit(work, n) for n in range(5)]
    wait_for(lambda: len(running) == 2, what="two handlers running")
    release.set()
    assert [f.result(10) for f in futures] == [f"done {n}" for n in range(5)]
    assert peak[0] == 2
    assert {t.name for t in pool._threads} == {"test-pool_0", "test-pool_1"}
    more = [pool.submit(work, n) for n in range(3)]
    assert [f.result(10) for f in more] == [f"done {n}" for n in range(3)]
    assert len(pool._threads) == 2  # the idle threads took the new work
    pool.shutdown(wait=True)


def test_pool_hands_errors_to_the_future_and_cancels_queued_work_on_shutdown() -> None:
    pool = _DaemonThreadPool(1, "test-pool")
    gate = threading.Event()

    def fail() -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        pool.submit(fail).result(10)
    blocked = pool.submit(gate.wait, 10)
    queued = pool.submit(lambda: "never")
    wait_for(blocked.running, what="the first call to run")
    pool.shutdown(wait=False, cancel_futures=True)
    assert queued.cancelled()
    with pytest.raises(RuntimeError, match="the worker stopped"):
        pool.submit(lambda: None)
    gate.set()
    assert blocked.result(10) is True
    assert isinstance(blocked, concurrent.futures.Future)


def test_a_plain_handler_still_running_when_the_thread_worker_closes_is_named_with_its_thread(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``ThreadRuntime.call_plain`` keeps the handlers running by thread: a close while one
    runs names its handler, its job and the thread it runs in; one that returned is gone."""
    from types import SimpleNamespace

    from sqla_queue.runtime import ThreadRuntime

    runtime = ThreadRuntime()
    inside, release = threading.Event(), threading.Event()

    def slow_handler(job: object) -> None:
        inside.set()
        release.wait(10)

    assert runtime.call_plain(lambda job: job.id, SimpleNamespace(id=7)) == 7  # returned: not kept
    thread = threading.Thread(
        target=runtime.call_plain, args=(slow_handler, SimpleNamespace(id=41)), name="executor-under-test"
    )
    thread.start()
    try:
        assert inside.wait(10)
        with caplog.at_level("WARNING", logger="sqla_queue.worker"):
            runtime.close()
    finally:
        release.set()
        thread.join(10)
    lines = [r.getMessage() for r in caplog.records if "still running" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "slow_handler" in lines[0] and "job 41" in lines[0] and "executor-under-test" in lines[0]
