"""Threads or asyncio tasks: what a worker's services run on.

The services are written once, as plain blocking code. :class:`ThreadRuntime` runs each
on a thread of its own. :class:`AsyncRuntime` runs each in a greenlet on the event loop,
as SQLAlchemy's asyncio extension runs its synchronous core: every wait underneath (a
database call, an event, a sleep) is awaited, so the loop stays free. The primitives here
work from threads and from such greenlets alike: a test thread can wait on a service of
an asyncio worker, and a greenlet can wake a thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
import inspect
import logging
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Coroutine
from typing import Any, ParamSpec, Protocol, TypeVar

from sqlalchemy.util.concurrency import await_only, greenlet_spawn, in_greenlet

__all__ = [
    "AsyncRuntime",
    "Condition",
    "Event",
    "Runtime",
    "Semaphore",
    "Strand",
    "ThreadRuntime",
    "is_async_callable",
    "sleep",
]

log = logging.getLogger("sqla_queue.worker")

P = ParamSpec("P")
T = TypeVar("T")


# -- primitives for threads and greenlets --------------------------------------------------


class _Waiter(Protocol):
    def wait(self, timeout: float | None) -> bool: ...

    def wake(self) -> None: ...


class _ThreadWaiter:
    __slots__ = ("_lock",)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()

    def wait(self, timeout: float | None) -> bool:
        return self._lock.acquire(timeout=-1 if timeout is None else max(timeout, 0.0))

    def wake(self) -> None:
        self._lock.release()


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


async def _until(future: asyncio.Future[None]) -> None:
    await future


class _GreenletWaiter:
    __slots__ = ("_future", "_loop", "_thread")

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.get_ident()
        self._future: asyncio.Future[None] = self._loop.create_future()

    def wait(self, timeout: float | None) -> bool:
        await_only(asyncio.wait({self._future}, timeout=timeout))
        return self._future.done()

    def wake(self) -> None:
        if threading.get_ident() == self._thread:
            _resolve(self._future)
        else:
            self._loop.call_soon_threadsafe(_resolve, self._future)


class Condition:
    """``threading.Condition``, except that ``wait()`` awaits when called in a greenlet
    on an event loop instead of blocking the loop's thread.

    The lock is only ever held for a few plain statements, never across a wait, so a
    greenlet never blocks another greenlet of its loop on it.
    """

    def __init__(self, lock: threading.Lock | None = None) -> None:
        self._lock = lock if lock is not None else threading.Lock()
        self._waiters: deque[_Waiter] = deque()

    def __enter__(self) -> Condition:
        self._lock.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self._lock.release()

    def wait(self, timeout: float | None = None) -> bool:
        """With the lock held: release it, wait for a notify (or ``timeout``), retake it."""
        waiter: _Waiter = _GreenletWaiter() if in_greenlet() else _ThreadWaiter()
        self._waiters.append(waiter)
        self._lock.release()
        notified = False
        try:
            notified = waiter.wait(timeout)
        finally:
            self._lock.acquire()
            if not notified:
                try:
                    self._waiters.remove(waiter)
                except ValueError:
                    notified = True  # woken just as the wait ended
        return notified

    def wait_for(self, predicate: Callable[[], bool], timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        result = predicate()
        while not result:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            self.wait(left)
            result = predicate()
        return result

    def notify(self, n: int = 1) -> None:
        """With the lock held: wake up to ``n`` waiters."""
        while n > 0 and self._waiters:
            self._waiters.popleft().wake()
            n -= 1

    def notify_all(self) -> None:
        self.notify(len(self._waiters))


class Event:
    """``threading.Event`` on :class:`Condition`."""

    def __init__(self) -> None:
        self._cond = Condition()
        self._flag = False

    def is_set(self) -> bool:
        return self._flag

    def set(self) -> None:
        with self._cond:
            self._flag = True
            self._cond.notify_all()

    def clear(self) -> None:
        with self._cond:
            self._flag = False

    def wait(self, timeout: float | None = None) -> bool:
        with self._cond:
            if not self._flag:
                self._cond.wait_for(lambda: self._flag, timeout)
            return self._flag


class Semaphore:
    """``threading.BoundedSemaphore`` on :class:`Condition`."""

    def __init__(self, value: int) -> None:
        self._cond = Condition()
        self._value = self._limit = value

    def acquire(self, blocking: bool = True) -> bool:
        with self._cond:
            if not blocking and not self._value:
                return False
            self._cond.wait_for(lambda: self._value > 0)
            self._value -= 1
            return True

    def release(self) -> None:
        with self._cond:
            if self._value >= self._limit:
                raise ValueError("semaphore released too many times")
            self._value += 1
            self._cond.notify()

    def __enter__(self) -> Semaphore:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def sleep(seconds: float) -> None:
    """``time.sleep``, awaited in a greenlet on an event loop."""
    if in_greenlet():
        await_only(asyncio.sleep(seconds))
    else:
        time.sleep(seconds)


def is_async_callable(fn: Any) -> bool:
    """``async def`` functions, callables with an ``async def __call__``, and partials of them."""
    target = getattr(fn, "func", fn)  # functools.partial
    call = type(target).__dict__.get("__call__") if not inspect.isroutine(target) else None
    return inspect.iscoroutinefunction(target) or inspect.iscoroutinefunction(call)


# -- runtimes --------------------------------------------------------------------------


class Strand:
    """A running service loop (a thread or a task): ``join(timeout)``, ``is_alive()``."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._done = Event()
        #: Tells whether the caller runs in this strand (a service never joins itself).
        self.is_current: Callable[[], bool] = lambda: False

    def finished(self) -> None:
        self._done.set()

    def join(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    def is_alive(self) -> bool:
        return not self._done.is_set()


class Runtime(Protocol):
    """How services run and how handlers are called."""

    name: str

    def spawn(self, target: Callable[..., None], name: str, *args: Any, own_thread: bool = False) -> Strand:
        """Run ``target(*args)``; ``own_thread``: out of reach of a blocked event loop."""
        ...

    def call(
        self, fn: Callable[..., Any], *args: Any, on_loop: bool = False,
        around: Callable[[Any], Any] | None = None,
    ) -> Any:
        """Call a handler; ``on_loop``: a synchronous handler that must run here;
        ``around``: wraps the awaitable of an ``async def`` one before it is awaited."""
        ...

    #: ``call(fn, *args)`` for a function :meth:`is_async` said is plain, off the loop:
    #: the path of every job of a plain handler, with no choice left to make per call.
    call_plain: Callable[..., Any]

    def is_async(self, fn: Callable[..., Any]) -> bool:
        """Whether this runtime awaits ``fn`` (decided once per function)."""
        ...

    def run_awaitable(self, awaitable: Any, what: str) -> Any:
        """Await ``awaitable`` (``what`` made it) where this runtime can; raise TypeError,
        naming it, where it cannot."""
        ...

    def interrupt(self, wait: float = 0.0) -> bool:
        """Shutdown gave up waiting: cut short the handlers that can be, and wait up to
        ``wait`` seconds for them to have ended (their ``except`` and ``finally`` clauses
        run), so that a stop does not return while their clean-up is still to come.
        False if one had not ended by then."""
        ...

    def cancelled(self) -> bool:
        """The service calling this is itself being cancelled (not its handler)."""
        ...

    def close(self) -> None:
        """The worker stopped: release what the runtime holds."""
        ...


class ThreadRuntime:
    """Every service and every executor on a daemon thread; handlers called directly."""

    name = "thread"

    def __init__(self) -> None:
        self._running = _Running()
        self.call_plain: Callable[..., Any] = self._running.run

    def spawn(self, target: Callable[..., None], name: str, *args: Any, own_thread: bool = False) -> Strand:
        return _on_thread(target, name, *args)

    def call(
        self, fn: Callable[..., Any], *args: Any, on_loop: bool = False,
        around: Callable[[Any], Any] | None = None,
    ) -> Any:
        return self._running.run(fn, *args)

    def is_async(self, fn: Callable[..., Any]) -> bool:
        return False  # the thread Worker refuses async handlers when it is built

    def run_awaitable(self, awaitable: Any, what: str) -> Any:
        close = getattr(awaitable, "close", None)
        if close is not None:  # a coroutine never awaited: no "never awaited" warning
            close()
        raise TypeError(
            f"{what} gave an awaitable ({type(awaitable).__name__}); the thread Worker cannot "
            f"await it (sqla_queue.AsyncWorker can)"
        )

    def interrupt(self, wait: float = 0.0) -> bool:
        """A thread cannot be interrupted: a handler past the grace finishes alone."""
        return True

    def cancelled(self) -> bool:
        return False

    def close(self) -> None:
        self._running.report()


class AsyncRuntime:
    """Every service and executor a task on the running loop, its code in a greenlet.

    ``async def`` handlers are awaited in the executor's own task (no task per job), so
    shutdown cancels that task while it awaits a handler; the handler's exceptions,
    ``KeyboardInterrupt`` and ``SystemExit`` included, are thrown back into the executor's
    greenlet, never let out into the loop. A handler may cancel that task too (its own
    ``current_task().cancel()``, a watchdog, ``asyncio.timeout``): such a cancellation is
    the handler's failure, taken back once the handler is over, so only the worker's own
    stop (:meth:`interrupt`) or the loop cancelling every task ends an executor.
    Plain handlers run in a pool of ``threads`` daemon threads, except those that must
    stay on the loop (``on_loop``: a
    synchronous transactional handler, whose session awaits on this loop underneath, as
    with ``AsyncSession.run_sync``).
    """

    name = "asyncio"

    def __init__(self, threads: int) -> None:
        self._threads = threads
        self._pool: _DaemonThreadPool | None = None
        #: Executor tasks awaiting a handler right now: what interrupt() cancels.
        self._in_handler: set[asyncio.Task[Any]] = set()
        #: Tasks interrupt() cancelled: their cancellation is the worker's, not a handler's.
        self._interrupted: weakref.WeakSet[asyncio.Task[Any]] = weakref.WeakSet()
        #: A task that only waits, on the services' loop: cancelled along with every other
        #: task when the loop shuts down (``asyncio.run()`` ending without ``stop()``).
        self._guard: asyncio.Task[None] | None = None
        self._guard_release: asyncio.Future[None] | None = None
        self._kinds: dict[Any, bool] = {}
        self.call_plain: Callable[..., Any] = self.call

    def spawn(self, target: Callable[..., None], name: str, *args: Any, own_thread: bool = False) -> Strand:
        if own_thread:  # a loop of its own, on a thread of its own
            return _on_thread(lambda: asyncio.run(greenlet_spawn(target, *args)), name)
        strand = Strand(name)
        loop = asyncio.get_running_loop()
        if self._guard is None:
            self._guard_release = release = loop.create_future()
            self._guard = loop.create_task(_until(release), name="sqla_queue-guard")
        task = loop.create_task(greenlet_spawn(target, *args), name=name)
        task.add_done_callback(lambda _: strand.finished())
        strand.is_current = lambda: _current_task() is task
        return strand

    def is_async(self, fn: Callable[..., Any]) -> bool:
        try:
            kind = self._kinds.get(fn)
            if kind is None:
                kind = self._kinds[fn] = is_async_callable(fn)
        except TypeError:  # an unhashable callable
            return is_async_callable(fn)
        return kind

    def call(
        self, fn: Callable[..., Any], *args: Any, on_loop: bool = False,
        around: Callable[[Any], Any] | None = None,
    ) -> Any:
        if self.is_async(fn):
            awaitable = fn(*args)
            return self._await(around(awaitable) if around is not None and inspect.isawaitable(awaitable)
                               else awaitable)
        if on_loop:
            result = fn(*args)
        else:
            loop = asyncio.get_running_loop()
            context = contextvars.copy_context()
            result = self._await(loop.run_in_executor(self._executor(), context.run, fn, *args))
        if inspect.isawaitable(result):
            return self._await(result)
        return result

    def run_awaitable(self, awaitable: Any, what: str) -> Any:
        return self._await(awaitable)

    def _await(self, awaitable: Any) -> Any:
        """Await a handler (or the thread running one) so that interrupt() can cut it short.

        A cancellation of this task that the handler caused (its own ``cancel()``, a
        watchdog's, an ``asyncio.timeout`` that expired) is the handler's: once the
        handler is over, a cancellation it requested but never awaited is taken here,
        and the task's count of cancellation requests goes back to what it was, so the
        executor goes on as if nothing happened (``asyncio.timeout`` and task groups in
        later handlers rely on that count).

        The awaitable is awaited by the task, never started here in the executor's
        greenlet, even when it would finish without suspending: a handler using an
        ``AsyncSession`` starts greenlets of its own, whose driver would then be this
        greenlet instead of the task's, and the switches that follow would reach the
        wrong one (the worker's tests with transactional handlers on asyncio fail so)."""
        task = asyncio.current_task()
        assert task is not None
        self._in_handler.add(task)
        before = task.cancelling()
        try:
            return await_only(awaitable)
        finally:
            self._in_handler.discard(task)
            if task.cancelling() > before and not self.cancelled():
                self._take_back_cancel(task, before)

    def _take_back_cancel(self, task: asyncio.Task[Any], before: int) -> None:
        try:
            await_only(asyncio.sleep(0))  # a cancellation requested but not delivered lands here
        except asyncio.CancelledError:
            if self.cancelled():
                raise  # the worker's stop came meanwhile
        while task.cancelling() > before:
            task.uncancel()

    def _executor(self) -> _DaemonThreadPool:
        if self._pool is None:
            self._pool = _DaemonThreadPool(self._threads, "sqla_queue-sync")
        return self._pool

    def interrupt(self, wait: float = 0.0) -> bool:
        """Cancel the ``async def`` handlers still running (CancelledError at their await):
        their executors end with them, their jobs already handed back. A plain handler's
        thread cannot be stopped: its executor stops waiting for it, and it ends alone.

        Waits up to ``wait`` seconds for those executors' tasks to end: a cancellation is
        only delivered when the loop next runs the task, and the handler's ``except``
        clause runs then; returning before would let the caller close the loop or the
        engine under it."""
        ended: list[Event] = []
        for task in list(self._in_handler):
            flag = Event()
            ended.append(flag)
            task.get_loop().call_soon_threadsafe(self._interrupt, task, flag)
        deadline = time.monotonic() + wait
        return all(flag.wait(max(deadline - time.monotonic(), 0.0)) for flag in ended)

    def _interrupt(self, task: asyncio.Task[Any], ended: Event) -> None:
        self._interrupted.add(task)
        task.add_done_callback(lambda _: ended.set())  # also called if it is done already
        task.cancel("sqla_queue: the worker is stopping")

    def cancelled(self) -> bool:
        """The worker's own stop cancelled this task, or the loop is cancelling every
        task (it is shutting down); a cancellation a handler caused is neither."""
        task = _current_task()
        if task is None:
            return False
        if task in self._interrupted:
            return True
        guard = self._guard
        return guard is not None and guard.get_loop() is task.get_loop() and (
            guard.cancelling() > 0 or guard.cancelled()
        )

    def close(self) -> None:
        release, self._guard_release = self._guard_release, None
        if release is not None:
            release.get_loop().call_soon_threadsafe(_resolve, release)
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.running.report()
            pool.shutdown(wait=False, cancel_futures=True)


class _Running:
    """The plain handlers running right now, by thread: what a stopped worker names when
    one of them outlived its stop."""

    def __init__(self) -> None:
        #: By thread identifier (``threading.get_ident()``: no Python call, unlike
        #: ``current_thread()``); :meth:`report` finds the thread's name.
        self._by_thread: dict[int, tuple[Callable[..., Any], tuple[Any, ...]]] = {}

    def run(self, fn: Callable[..., T], *args: Any) -> T:
        me = threading.get_ident()
        self._by_thread[me] = (fn, args)
        try:
            return fn(*args)
        finally:
            del self._by_thread[me]

    def report(self) -> None:
        names = {thread.ident: thread.name for thread in threading.enumerate()}
        for ident, (fn, args) in list(self._by_thread.items()):
            if isinstance(getattr(fn, "__self__", None), contextvars.Context) and args:
                fn, args = args[0], args[1:]  # Context.run(handler, job)
            job = getattr(args[0], "id", "?") if args else "?"
            log.warning(
                "handler %s (job %s) is still running in thread %s after the worker stopped: a "
                "thread cannot be interrupted; its job was handed back, and the process can exit "
                "without waiting for it",
                _name_of(fn), job, names.get(ident, f"#{ident}"),
            )


def _name_of(fn: Any) -> str:
    target = getattr(fn, "func", fn)  # functools.partial
    name = getattr(target, "__qualname__", None) or type(target).__qualname__
    module = getattr(target, "__module__", None)
    return f"{module}.{name}" if module else name


_Work = tuple["concurrent.futures.Future[Any]", Callable[..., Any], tuple[Any, ...], dict[str, Any]]


class _DaemonThreadPool(concurrent.futures.Executor):
    """A ``ThreadPoolExecutor`` of at most ``size`` daemon threads, for plain handlers.

    ``ThreadPoolExecutor`` joins its threads at interpreter exit, so one plain handler
    stuck past the shutdown grace would keep the process from ever exiting (``sqla-queue
    worker`` and a user's own ``asyncio.run(worker.run())`` alike). Daemon threads do
    not, as the thread Worker's executors do not: a handler still running then ends with
    the process, its job already handed back.
    """

    def __init__(self, size: int, name: str) -> None:
        self._size = size
        self._name = name
        self._work: queue.SimpleQueue[_Work | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._lock = threading.Lock()
        self._shut = False
        self.running = _Running()

    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:
            if self._shut:
                raise RuntimeError("cannot run a handler: the worker stopped")
            self._work.put((future, fn, args, kwargs))
            if self._idle:
                self._idle -= 1  # a waiting thread takes it
            elif len(self._threads) < self._size:
                thread = threading.Thread(
                    target=self._serve, name=f"{self._name}_{len(self._threads)}", daemon=True
                )
                self._threads.append(thread)
                thread.start()
        return future

    def _serve(self) -> None:
        while True:
            item = self._work.get()
            if item is None:
                return
            future, fn, args, kwargs = item
            del item
            if future.set_running_or_notify_cancel():
                try:
                    result = self.running.run(functools.partial(fn, **kwargs) if kwargs else fn, *args)
                except BaseException as exc:  # noqa: BLE001 - the awaiting task gets it, as from ThreadPoolExecutor
                    future.set_exception(exc)
                else:
                    future.set_result(result)
            del future
            with self._lock:
                self._idle += 1

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            self._shut = True
            if cancel_futures:
                while True:
                    try:
                        item = self._work.get_nowait()
                    except queue.Empty:
                        break
                    if item is not None:
                        item[0].cancel()
            for _ in self._threads:
                self._work.put(None)
        if wait:
            for thread in self._threads:
                thread.join()


def _on_thread(target: Callable[..., None], name: str, *args: Any) -> Strand:
    strand = Strand(name)

    def run() -> None:
        try:
            target(*args)
        finally:
            strand.finished()

    thread = threading.Thread(target=run, name=name, daemon=True)
    strand.is_current = lambda: threading.current_thread() is thread
    thread.start()
    return strand


def _current_task() -> asyncio.Task[Any] | None:
    try:
        return asyncio.current_task()
    except RuntimeError:  # no running loop in this thread
        return None


def run_in_greenlet(fn: Callable[..., Any], *args: Any) -> Coroutine[Any, Any, Any]:
    """``fn(*args)`` as a coroutine: the entry from async code into the runtime."""
    return greenlet_spawn(fn, *args)
