"""Several workers in one process, with one start and one shutdown: one worker per queue
table (``sqla-queue worker app:Tasks app:Emails``).

:class:`Workers` groups thread :class:`~sqla_queue.Worker` s, :class:`AsyncWorkers`
groups :class:`~sqla_queue.AsyncWorker` s on one event loop. A signal (SIGTERM, SIGINT)
reaches every worker of the group: the first asks each for a graceful stop, a second
hands everything back at once. Their stops run side by side, so the group stops within
one ``shutdown_grace``, not one per worker. Each worker keeps its own table, options,
connections and services: a group adds no coupling between them.
"""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Sequence
from types import FrameType
from typing import Any

from .worker import Worker
from .worker.aio import AsyncWorker

__all__ = ["AsyncWorkers", "Workers"]


def _checked(workers: Sequence[Any], kind: type[Any]) -> tuple[Any, ...]:
    found = tuple(workers)
    if not found:
        raise ValueError("a group needs at least one worker")
    for worker in found:
        if not isinstance(worker, kind):
            raise TypeError(f"{type(worker).__qualname__} in a group of {kind.__qualname__}s: "
                            f"group thread Workers with Workers, AsyncWorkers with AsyncWorkers")
    if len({id(w) for w in found}) != len(found):
        raise ValueError("the same worker is in the group twice")
    return found


class _Group:
    """What both groups do to every worker at once: ask it to stop, pass it a signal."""

    workers: tuple[Worker, ...] | tuple[AsyncWorker, ...]

    def request_stop(self) -> None:
        """Ask every worker to stop gracefully (from any thread; returns at once)."""
        for worker in self.workers:
            worker.request_stop()

    def on_signal(self, signum: int) -> None:
        """A signal for every worker: the first asks for a graceful stop, a second for an abort."""
        for worker in self.workers:
            worker.on_signal(signum)


class Workers(_Group):
    """Thread workers run together: ``Workers([Worker(engine, Task, tasks), Worker(engine,
    Email, send)]).run()``."""

    workers: tuple[Worker, ...]

    def __init__(self, workers: Sequence[Worker]) -> None:
        self.workers = _checked(workers, Worker)

    def start(self) -> None:
        """Start every worker; if one cannot start, stop those started and raise its error."""
        started: list[Worker] = []
        try:
            for worker in self.workers:
                worker.start()
                started.append(worker)
        except BaseException:
            self._stop_all(started, 0.0)
            raise

    def wait(self, *, until_idle: bool = False) -> None:
        """Until a stop is asked of the group (:meth:`request_stop`, a signal) or, with
        ``until_idle``, until every worker is idle."""
        for worker in self.workers:
            worker.wait(until_idle=until_idle)

    def stop(self, grace: float | None = None) -> None:
        """Stop every worker, side by side: within one grace (and a few seconds)."""
        self._stop_all(list(self.workers), grace)

    @staticmethod
    def _stop_all(workers: list[Worker], grace: float | None) -> None:
        threads = [threading.Thread(target=w.stop, args=(grace,), name=f"sqla_queue-stop-{n}", daemon=True)
                   for n, w in enumerate(workers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    def run(self, *, install_signal_handlers: bool = True, until_idle: bool = False) -> None:
        """Start every worker, run until a signal or :meth:`request_stop` (or, with
        ``until_idle``, until all are idle), then stop them all, as
        :meth:`Worker.run <sqla_queue.Worker.run>` does for one."""
        previous: dict[signal.Signals, Any] = {}
        if install_signal_handlers and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                previous[sig] = signal.signal(sig, self._on_signal)
        try:
            self.start()
            self.wait(until_idle=until_idle)
            self.stop()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.on_signal(signum)


class AsyncWorkers(_Group):
    """Asyncio workers run together on the running loop: ``await AsyncWorkers([...]).run()``."""

    workers: tuple[AsyncWorker, ...]

    def __init__(self, workers: Sequence[AsyncWorker]) -> None:
        self.workers = _checked(workers, AsyncWorker)

    async def run(self, *, install_signal_handlers: bool = True, until_idle: bool = False) -> None:
        """Run every worker until a signal or :meth:`request_stop` (or, with
        ``until_idle``, until each is idle), each then stopping as
        :meth:`AsyncWorker.run <sqla_queue.AsyncWorker.run>` does; a worker that fails to
        start stops the others. Cancelling the task that awaits it aborts them all."""
        loop = asyncio.get_running_loop()
        installed: list[signal.Signals] = []
        if install_signal_handlers and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.on_signal, sig)
                installed.append(sig)
        try:
            runs = [asyncio.ensure_future(w.run(install_signal_handlers=False, until_idle=until_idle))
                    for w in self.workers]
            try:
                done, _ = await asyncio.wait(runs, return_when=asyncio.FIRST_EXCEPTION)
            except asyncio.CancelledError:
                for run in runs:
                    run.cancel()
                await asyncio.gather(*runs, return_exceptions=True)
                raise
            failed = [r for r in done if not r.cancelled() and r.exception() is not None]
            if failed:  # one could not start (or broke): the others stop too
                self.request_stop()
                await asyncio.gather(*runs, return_exceptions=True)
                raise failed[0].exception()  # type: ignore[misc]
        finally:
            for sig in installed:
                loop.remove_signal_handler(sig)
