"""Execution: threads that each claim, run and complete their own jobs.

Each executor thread owns one dedicated connection: it claims a batch on it, runs the
handlers one after another, and hands the outcomes to the completer, which records them
on the same connection. No job crosses a thread, and while work keeps coming a batch
costs one statement however many jobs it holds: the completion of the batch before and
the claim of the next, together, which the executor runs itself
(:class:`CompleteThenClaim`) and whose completed tokens the completer settles. The batch
is sized by the handlers' measured speed: up to ``batch_size`` jobs for fast handlers, one
at a time for slow ones, so a job never waits long behind its batch-mates; until a thread
has measured its handlers, and after it found nothing to claim (when it has peers), it
claims one job at a time, so slow jobs arriving at idle threads spread over all of them,
whatever the thread ran before.
Every claim and completion runs under a deadline (``statement_deadline``): a connection
that stops answering is dropped and the call made again on a new one.

:class:`Executor` turns one run of a handler into an :class:`~.outcome.Outcome`; nothing a
handler does (any ``BaseException``, a bad return value, an unformattable error, a lost
connection) escapes it.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import re
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager, AbstractContextManager, suppress
from types import CoroutineType
from typing import Any

from sqlalchemy import Connection
from sqlalchemy.orm import Session

from ..current import CANCELLED, STOPPING, bind, in_context, timeout_text, unbind
from ..driver import DbConnection, Driver
from ..errors import DeadLetter, JobCancelled, LeaseLost, ResultNotStorable, RetryLater, Snooze, UnknownTask
from ..ops import Claimed, ClaimRequest, Operations
from ..runtime import Runtime
from ..tasks import ResolvedHandler, TaskRegistry
from .completer import Completer, progress_of
from .context import WorkerContext
from .ledger import Held, Ledger, Start
from .outcome import Kind, Outcome, describe_error, storable
from .producer import Producer
from .service import Reconnecting, Service
from .watchdog import Watchdog

__all__ = ["Executor", "ExecutorPool", "Lane"]

log = logging.getLogger("sqla_queue.worker")

#: Handler time one batch aims at: long enough to amortise the claim and the completion,
#: short enough that a job waits little behind its batch-mates.
BATCH_TARGET_SECONDS = 0.05
#: The longest delay a retry can ask for (about ten years).
MAX_DELAY_SECONDS = 10 * 365 * 86400.0
#: Losses of the worker's own connection in a row, under the same job's handler, that hand
#: the job back at once without counting the attempt; past them, each loss is the job's
#: own failure (an attempt and the backoff): a handler that kills its connection every
#: time must not run forever. The count lives in the row (its ``last_error``, see
#: :func:`losses_in_a_row`), so it holds across workers and restarts: a job runs at most
#: ``(FREE_HAND_BACKS + 1) * max_attempts`` times, then goes to the dead letter saying so.
FREE_HAND_BACKS = 2
#: How ``last_error`` begins after a loss of the worker's connection under a handler.
LOSS_PREFIX = "connection lost ("
_LOSSES = re.compile(r"connection lost \((\d{1,9}) in a row")


def losses_in_a_row(last_error: object) -> int:
    """Losses of a worker's connection in a row under the job's handlers, as its row's
    ``last_error`` says (written by the hand-back or the retry that followed the last
    one; any other outcome since overwrote it, or left it, like a snooze)."""
    if not isinstance(last_error, str):
        return 0
    found = _LOSSES.match(last_error)
    return int(found.group(1)) if found else 0


def batch_size(per_job: float | None, took: float, max_batch: int) -> tuple[float, int]:
    """After a batch whose handlers took ``took`` seconds per job: the smoothed time per
    job (``per_job`` is the one before, None at first) and the next batch's size.

    The size aims the batch's handler time at :data:`BATCH_TARGET_SECONDS`, between one
    job and ``max_batch``; the smoothing keeps one odd job from swinging it."""
    smoothed = took if per_job is None else 0.7 * per_job + 0.3 * took
    return smoothed, max(1, min(max_batch, int(BATCH_TARGET_SECONDS / max(smoothed, 1e-6))))


class Lane(Reconnecting):
    """An executor thread's connection, reconnected on demand, and the start of the
    lease owner names it claims under: ``{owner}/{index}.{n}`` (see :mod:`.ledger`)."""

    def __init__(self, driver: Driver, name: str, owner: str = "") -> None:
        super().__init__(driver, name)
        self.name = name
        #: Every owner name of this lane starts with it (and no other lane's does).
        self.prefix = f"{owner}."


class Executor:
    """Runs one job's handler and says what came of it."""

    def __init__(
        self,
        ctx: WorkerContext,
        handler: ResolvedHandler | TaskRegistry,
        session_factory: Callable[[], Any],
        job_context: Callable[[], AbstractContextManager[Any] | AbstractAsyncContextManager[Any]] | None,
    ) -> None:
        self.config = ctx.config
        self.ledger = ctx.ledger
        self.driver = ctx.driver
        self.owner = ctx.owner
        self.handler = handler
        self.session_factory = session_factory
        self.job_context = job_context
        self.runtime = ctx.driver.runtime
        self.ops = ctx.ops
        #: Tells handlers past their deadline (set by the worker).
        self.watchdog: Watchdog | None = None
        #: A return value as the result the table keeps (None: it keeps none).
        self.encode_result = ctx.ops.result_encoder(ctx.config.max_result_size) if ctx.ops.stores_results else None
        #: The one handler when it is a plain function taking the job (not a registry, not
        #: transactional, not ``async def``) and no ``job_context`` wraps it: a job without
        #: a deadline then runs it straight from :meth:`run` (:meth:`_plain`), through
        #: none of the choices the other kinds need.
        self._plain_fn: Callable[[Any], Any] | None = None
        #: The same for an ``async def`` handler (the AsyncWorker): :meth:`_plain_async`.
        self._async_fn: Callable[[Any], Any] | None = None
        if isinstance(handler, ResolvedHandler) and not handler.transactional and job_context is None:
            if self.runtime.is_async(handler.fn):
                self._async_fn = handler.fn
            else:
                self._plain_fn = handler.fn
        self._call_plain = self.runtime.call_plain

    def run(self, held: Held, lane: Lane) -> Outcome:
        if held.load_error is not None:
            return Outcome(held, Kind.FAIL, held.load_error)
        if held.stopped == CANCELLED:  # cancelled before it started
            return Outcome(held, Kind.CANCELLED)
        bound = bind(held)  # its context is made when the handler first asks for it
        try:
            fn = self._plain_fn
            if fn is not None and held.deadline is None:
                outcome = self._plain(held, fn)
            elif self._async_fn is not None and held.deadline is None:
                outcome = self._plain_async(held, self._async_fn)
            else:
                handler = self._resolve(held.job)
                if held.deadline is not None or self.job_context is not None or self.runtime.is_async(handler.fn):
                    # Made now: the watchdog tells a running handler by it, an ``async def``
                    # handler's task is cancelled through it, and a job_context may ask for it.
                    # Otherwise the handler's first current_job() makes it (most never ask).
                    held.job_context(running=False)
                    if held.deadline is not None and self.watchdog is not None:
                        self.watchdog.watch(held)
                if self.job_context is not None:
                    outcome = self._in_job_context(held, handler, lane)
                else:
                    outcome = self._call(held, handler, lane)
        except BaseException as exc:
            if self.runtime.cancelled():
                raise  # the executor's own task is cancelled (its loop is closing): stop here
            outcome = self.failure(held, exc)
        finally:
            unbind(bound)
        return outcome if held.stopped is None else self._over(held, outcome)

    def _plain(self, held: Held, fn: Callable[[Any], Any]) -> Outcome:
        """:meth:`_call` and :meth:`_invoke` for the plain handler (``_plain_fn``), in one
        frame: the path every job of such a handler without a deadline takes."""
        context = held.context  # None until the handler asks (then made running)
        if context is not None:
            context.enter(None)
        try:
            result = self._call_plain(fn, held.job)
        finally:
            context = held.context
            if context is not None:
                context.leave()
        return Outcome(held, Kind.DONE) if result is None else self._returned(held, result)

    def _plain_async(self, held: Held, fn: Callable[[Any], Any]) -> Outcome:
        """:meth:`_call` and :meth:`_invoke` for the ``async def`` handler (``_async_fn``):
        its context made and entered with the task a cancel or a timeout cancels, its
        coroutine awaited with the context current (:func:`~sqla_queue.current.in_context`)."""
        context = held.job_context(running=False)
        context.enter(asyncio.current_task())
        try:
            awaitable: Any = fn(held.job)
            if type(awaitable) is CoroutineType or inspect.isawaitable(awaitable):
                awaitable = in_context(context, awaitable)
            result = self.runtime.run_awaitable(awaitable, "the handler")
        finally:
            context.leave()
        return Outcome(held, Kind.DONE) if result is None else self._returned(held, result)

    def _returned(self, held: Held, result: Any) -> Outcome:
        """What a plain or ``async def`` handler (of the fast paths) returned: done,
        with the result the table keeps, if it keeps one."""
        if result is None:
            return Outcome(held, Kind.DONE)
        if inspect.isawaitable(result):
            return self._awaitable(held, self._resolve(held.job), result)
        if self.encode_result is not None:
            return self._with_result(held, result)
        return Outcome(held, Kind.DONE)

    def _over(self, held: Held, outcome: Outcome) -> Outcome:
        """The outcome of an attempt that was told to stop: ``cancelled`` (nothing to
        record: the row says so), or the timeout's failure, retried by the usual rules.
        An attempt whose transaction committed first keeps its ``done``."""
        reason = held.stopped
        if reason is None or outcome.kind in (Kind.COMMITTED, Kind.LOST):
            return outcome
        if reason == CANCELLED:
            return Outcome(held, Kind.CANCELLED)
        return Outcome(held, Kind.RETRY, timeout_text(held.timeout or 0.0), self._backoff(held))

    def _backoff(self, held: Held) -> float:
        try:
            return min(self.config.backoff.delay(held.token.attempt).total_seconds(), MAX_DELAY_SECONDS)
        except (OverflowError, ValueError):
            return min(self.config.backoff.cap, MAX_DELAY_SECONDS)

    def _invoke(self, held: Held, fn: Callable[..., Any], *args: Any, on_loop: bool = False) -> Any:
        """Call the handler with its job's context current; an ``async def`` handler's
        task is the one a cancel or a timeout cancels (never a plain handler's: a thread
        cannot be stopped, and the executor waits for it, so it holds its slot)."""
        if not self.runtime.is_async(fn):
            context = held.context  # None until the handler asks (then made running)
            if context is not None:
                context.enter(None)
            try:
                return self.runtime.call(fn, *args, on_loop=on_loop)
            finally:
                context = held.context
                if context is not None:
                    context.leave()
        context = held.job_context(running=False)  # made before the start: see run()
        context.enter(asyncio.current_task())
        try:
            return self.runtime.call(fn, *args, on_loop=on_loop, around=lambda aw: in_context(context, aw))
        finally:
            context.leave()

    def _in_job_context(self, held: Held, handler: ResolvedHandler, lane: Lane) -> Outcome:
        """The handler inside a fresh ``job_context()``: a context manager, or on the
        asyncio runtime an async one. The context sees what the handler raised, as a
        ``with`` block would; if it swallows it, the job has failed all the same (a
        ``with`` statement would go on after the block, and the handler must not run
        twice)."""
        assert self.job_context is not None
        enter, leave = _context_methods(self.job_context(), self.runtime)
        enter()
        try:
            outcome = self._call(held, handler, lane)
        except BaseException as exc:
            if not leave(type(exc), exc, exc.__traceback__) or self.runtime.cancelled():
                raise
            return self.failure(held, exc)
        leave(None, None, None)
        return outcome

    def _call(self, held: Held, handler: ResolvedHandler, lane: Lane) -> Outcome:
        if handler.transactional:
            return self._transactional(held, handler, lane)
        result = self._invoke(held, handler.fn, held.job)
        if result is not None:
            if inspect.isawaitable(result):
                return self._awaitable(held, handler, result)
            if self.encode_result is not None:
                return self._with_result(held, result)
        return Outcome(held, Kind.DONE)

    def _with_result(self, held: Held, result: Any) -> Outcome:
        """Done, with the result as the table keeps it; a result it cannot keep fails the
        attempt as an exception of the handler's would (it is retried with the backoff)."""
        assert self.encode_result is not None
        try:
            text = self.encode_result(result)
        except ResultNotStorable as exc:
            return self.failure(held, exc)
        return Outcome(held, Kind.DONE, result=text)

    def _resolve(self, job: Any) -> ResolvedHandler:
        handler = self.handler
        return handler.lookup(job.task) if isinstance(handler, TaskRegistry) else handler

    def _awaitable(self, held: Held, handler: ResolvedHandler, result: Any) -> Outcome:
        close = getattr(result, "close", None)
        if close is not None:
            with suppress(Exception):
                close()
        return Outcome(
            held,
            Kind.FAIL,
            f"handler {handler.name!r} returned an awaitable ({type(result).__name__}); the thread "
            f"Worker runs plain functions and cannot await it (sqla_queue.AsyncWorker can)",
        )

    def failure(self, held: Held, exc: BaseException, conn: DbConnection | None = None) -> Outcome:
        """What a handler's exception comes to. ``conn``: the worker's connection the
        handler's transaction ran on (None for a plain handler, which never uses it).

        Only the state of that connection says the worker lost it, never the exception's
        class: a ``ConnectionError`` or ``OperationalError`` of the handler's own (an
        upstream that is down, another database) is the job's failure, with the backoff.
        """
        limit = self.config.max_error_length
        if isinstance(exc, LeaseLost):
            return Outcome(held, Kind.LOST)
        if isinstance(exc, UnknownTask):
            return Outcome(held, Kind.FAIL, storable(str(exc), limit))
        if isinstance(exc, JobCancelled) and exc.reason == STOPPING and held.stopped is None:
            # The handler gave up because the worker stops: back to pending at once for
            # another worker, no backoff. The attempt counts: the handler ran.
            return Outcome(held, Kind.RELEASE, "the worker stopped; its handler gave up", refund=False)
        if isinstance(exc, DeadLetter):
            return Outcome(held, Kind.FAIL, storable(f"DeadLetter: {_reason(exc)}", limit))
        if isinstance(exc, Snooze):
            # Not a failure: no attempt spent (the statement gives the claim's back), no error.
            delay = min(exc.delay.total_seconds(), MAX_DELAY_SECONDS)
            return Outcome(held, Kind.SNOOZE, storable(_reason(exc), limit), delay)
        if isinstance(exc, RetryLater):
            delay = min(exc.delay.total_seconds(), MAX_DELAY_SECONDS)
            return Outcome(held, Kind.RETRY, storable(f"RetryLater: {_reason(exc)}", limit), delay)
        if isinstance(exc, KeyboardInterrupt | SystemExit):
            log.error("job %s: the handler raised %s; the job will be retried",
                      held.token.job_id, type(exc).__name__)
        error = describe_error(exc, limit)
        if conn is not None and (conn.broken or conn.sa.invalidated):
            # The streak as the claimed row told it (any worker's, before a restart too).
            losses = losses_in_a_row(getattr(held.job, "last_error", None)) + 1
            held.losses = losses
            if losses <= FREE_HAND_BACKS:
                # Not the job's fault: back to pending at once, the attempt not counted
                # (``max_attempts`` grows by one; the release is fenced by owner and
                # attempt, on a new connection), the streak noted in ``last_error``.
                log.warning("job %s attempt %d: the worker's connection was lost under its handler; "
                            "handed back without counting the attempt", held.token.job_id, held.token.attempt)
                return Outcome(held, Kind.RELEASE, storable(
                    f"{LOSS_PREFIX}{losses} in a row under this job; handed back, attempt not counted): {error}",
                    limit))
            error = storable(f"{LOSS_PREFIX}{losses} in a row under this job; attempt counted): {error}", limit)
        return Outcome(held, Kind.RETRY, error, self._backoff(held))

    def _transactional(self, held: Held, handler: ResolvedHandler, lane: Lane) -> Outcome:
        """The handler's writes and the fenced completion commit in one transaction.

        The handler's session is joined to a transaction on this thread's connection in
        ``create_savepoint`` mode: its ``commit()`` and ``rollback()`` (and its own
        savepoints) act on a SAVEPOINT, and only this method commits the transaction,
        after the handler returned, with the completion in it. So whatever shape the
        handler's transaction takes, its final writes and the job's completion commit
        together, or neither does.
        """
        try:
            conn = lane.connect()
        except Exception as exc:
            if not self.driver.is_connection_error(exc):
                raise
            # The handler never ran: the job goes back at once, its attempt refunded (the
            # release is made on a new connection, once one can be had). Not its failure,
            # and not a loss under its handler.
            log.warning("job %s: no connection to run its transactional handler on (%s); handed back",
                        held.token.job_id, _first_line(exc))
            return Outcome(held, Kind.RELEASE, storable(f"no connection: {_first_line(exc)}",
                                                        self.config.max_error_length))
        conn.set_autocommit(False)
        sa: Connection = conn.sa
        trans = sa.begin()
        committed = False
        session: Session | None = None
        try:
            try:
                session, given = self.driver.session_on(self.session_factory, sa)
                fn = handler.fn
                if not self.runtime.is_async(fn):
                    given = session  # a plain function gets the synchronous session
                result = self._invoke(held, fn, held.job, given, on_loop=True)
                if inspect.isawaitable(result):
                    return self._awaitable(held, handler, result)
                session.commit()
                # Encoded before the completion: a result the table cannot keep rolls back.
                stored = self.encode_result(result) if self.encode_result is not None else None
            except BaseException as exc:
                if self.runtime.cancelled():
                    raise
                return self.failure(held, exc, conn)
            if held.stopped is not None:
                # Cancelled or past its deadline: its writes roll back (the finally), and
                # the database would refuse the completion anyway.
                return Outcome(held, Kind.DONE)
            if not self.ledger.finishing([held]):
                return Outcome(held, Kind.LOST)
            try:
                with self.driver.deadline(conn, self.config.statement_deadline):
                    if not self.ops.complete_in_transaction(sa, held.owner, held.token, stored, held.progress):
                        return Outcome(held, Kind.LOST)
                    trans.commit()
                    committed = True
                    self.ops.committed(held.token)
            except Exception as exc:  # noqa: BLE001
                if self.driver.is_connection_error(exc):
                    # The commit may or may not have landed (a failover, a cut link). The
                    # row says, once the transaction is over: the completer hands the job
                    # back (or retries it) fenced by owner and attempt, which waits for the
                    # old transaction's lock on the row if it still runs, and matches
                    # nothing if it committed; then the row reads done. No waiting for the
                    # lease to run out, and no second run of a committed job.
                    log.warning("job %s: connection lost while committing; the job's row will tell "
                                "whether it committed", held.token.job_id)
                    outcome = self.failure(held, exc, conn)
                    outcome.unsure = True
                    return outcome
                return self.failure(held, exc)
            return Outcome(held, Kind.COMMITTED)
        finally:
            if session is not None:
                with suppress(Exception):
                    session.close()
            with suppress(Exception):
                # Also after a COMMIT that failed (a deferred constraint, a serialization
                # failure): the transaction is inactive then, but still holds the
                # connection, whose next begin() would fail until it is rolled back.
                if not committed:
                    trans.rollback()
            try:
                conn.set_autocommit(True)
            except Exception:  # noqa: BLE001 - a broken connection: make a new one
                lane.reset()


def _context_methods(context: Any, runtime: Runtime) -> tuple[Callable[[], Any], Callable[..., Any]]:
    """``(enter, exit)`` of what ``job_context()`` returned, awaited when it is async."""
    kind = type(context)
    if hasattr(kind, "__enter__") and hasattr(kind, "__exit__"):
        return (lambda: kind.__enter__(context)), (lambda *exc: kind.__exit__(context, *exc))
    if hasattr(kind, "__aenter__") and hasattr(kind, "__aexit__"):
        return (
            lambda: runtime.run_awaitable(kind.__aenter__(context), "job_context"),
            lambda *exc: runtime.run_awaitable(kind.__aexit__(context, *exc), "job_context"),
        )
    raise TypeError(f"job_context() returned {kind.__name__}, not a context manager")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def _reason(exc: DeadLetter | RetryLater | Snooze) -> str:
    try:
        return str(exc.reason)
    except Exception:  # noqa: BLE001
        return "<reason could not be formatted>"


class CompleteThenClaim:
    """A batch's completion and the next claim, one statement and one round trip
    (``ops.complete_then_claim``), run by the executor on the done outcomes the completer
    left to it (:meth:`Completer.record` with ``claim_owner``); the completer settles what
    it moved, or records them the usual way if it failed."""

    def __init__(self, ops: Operations, driver: Driver, ledger: Ledger, completer: Completer) -> None:
        self.ops = ops
        self.driver = driver
        self.ledger = ledger
        self.completer = completer

    def __call__(
        self, connect: Callable[[], DbConnection], done: list[Outcome], request: ClaimRequest
    ) -> list[Claimed] | None:
        """Record ``done`` (all claimed under ``request.owner``) and run ``request``:
        the rows claimed, or None when no claim ran."""
        if not done:
            return None
        try:
            conn = connect()
            sent = time.monotonic()
            try:
                ops = self.ops
                results = [o.result for o in done] if ops.stores_results else None
                progress = progress_of(done) if ops.stores_progress else None
                moved, claimed = ops.complete_then_claim(conn, [o.held.token for o in done], request, results, progress)
            except Exception as exc:
                if self.driver.is_connection_error(exc):
                    self.ledger.claim_unknown(request.owner)  # it may have committed unseen
                raise
        except Exception as exc:  # noqa: BLE001 - recorded the usual way
            self.completer.complete_after_failure(connect, done, exc)
            return None
        self.completer.settle_completed(connect, done, moved, sent)
        return claimed


class ExecutorPool(Service):
    """``concurrency`` executor threads, started and stopped as one service."""

    name = "executor"

    def __init__(self, ctx: WorkerContext, producer: Producer, executor: Executor, completer: Completer) -> None:
        config = ctx.config
        super().__init__(config.poll_interval, reconnect_backoff=config.reconnect_backoff, runtime=ctx.driver.runtime)
        self.config = config
        self.ledger = ctx.ledger
        self.driver = ctx.driver
        self.ops = ctx.ops
        self.producer = producer
        self.executor = executor
        self.completer = completer
        self.complete_then_claim = CompleteThenClaim(ctx.ops, ctx.driver, ctx.ledger, completer)
        self.max_batch = config.max_batch(ctx.ops.claims_take_turns)
        self.signal = ctx.signal
        self.stats = ctx.stats
        self.hooks = ctx.hooks

    def start(self) -> None:
        if self._threads:
            raise RuntimeError("executors already started")
        for n in range(self.config.concurrency):
            self._spawn(self._thread, f"sqla_queue-executor-{n}", n)

    def request_stop(self) -> None:
        super().request_stop()
        self.signal.stop()

    def _thread(self, index: int) -> None:
        lane = Lane(self.driver, f"sqla_queue executor {index}", f"{self.producer.owner}/{index}")
        # One job until the handlers are measured: at a cold start, a thread that took a
        # batch of slow jobs would run them one after another while its peers idle.
        limit = 1
        per_job: float | None = None
        failures = 0
        held: list[Held] = []
        try:
            while not self.stopping:
                if not held:
                    try:
                        conn = lane.connect()
                        self._recover(lane, conn)
                        held = self.producer.claim(conn, limit, self.ledger.lane_owner(lane.prefix))
                        if not held:
                            if not self.stopping:
                                self.producer.wait_for_work(conn)
                            # Back from idle, one job first, as at a start: what arrives
                            # now may be slower than what this thread measured (eight
                            # slow jobs after a thousand fast ones), and a batch of them
                            # would run in series while its idle peers look on. The
                            # measure is kept: one fast job brings the batch size back.
                            # (A lone executor has no peer to share with: it keeps its size.)
                            if self.config.concurrency > 1:
                                limit = 1
                            failures = 0
                            continue
                    except Exception as exc:  # noqa: BLE001 - the database went away: back off
                        lane.reset()
                        failures += 1
                        delay = self.backoff.delay(failures).total_seconds()
                        log.warning("executor %d: %s: %s (retrying in %.2fs)", index, type(exc).__name__,
                                    _first_line(exc), delay)
                        self.sleep(delay)
                        continue
                    if failures:
                        log.info("executor %d: recovered after %d error(s)", index, failures)
                    failures = 0
                if self.stopping:  # claimed while stop() ran: give back what it did not take
                    self.completer.hand_back(lane.connect, self.ledger.take(held), refund=True)
                    break
                self.hooks.claimed(held)
                isolated, solitary = held[0].isolated, held[0].solitary
                if len(held) == limit and not isolated:
                    self.signal.wake()  # there may be more: rouse an idle peer
                held, ran, busy = self._run_batch(held, lane, limit)
                if ran:
                    # Handler time only: the round trip is what a batch amortises, so
                    # counting it would keep small batches small on a slow link.
                    per_job, limit = batch_size(per_job, busy / ran, self.max_batch)
                if isolated:
                    self.producer.look_for_isolated()
                if solitary:
                    self.signal.wake(self.config.concurrency)  # the others claimed nothing meanwhile
                self._round_done()
            if held:
                self.completer.hand_back(lane.connect, self.ledger.take(held), refund=True)
            with suppress(Exception):  # stopping: give back what a lost claim took, if it can be told
                if self.ledger.unknown_claims(lane.prefix):
                    self._recover(lane, lane.connect())
        finally:
            lane.reset()

    def _recover(self, lane: Lane, conn: DbConnection) -> None:
        """Before claiming again: give back the rows of this lane's claims whose answer
        was lost (a connection error raised here is the claim loop's to back off on)."""
        for owner in self.ledger.unknown_claims(lane.prefix):
            self.producer.recover(conn, owner)

    def _run_batch(self, held: list[Held], lane: Lane, limit: int) -> tuple[list[Held], int, float]:
        """Run ``held``; record the outcomes, claiming the next batch in the same round trip
        when there is one to claim. Returns the next batch (maybe empty), the jobs run and
        the time their handlers took."""
        outcomes: list[Outcome] = []
        deferred: list[Held] = []
        ran = 0
        began = time.monotonic()
        busy = 0.0
        request = None
        accepted = False
        hooks = self.hooks
        started = hooks.started if hooks.wants_started else None
        ledger_start, run, clock = self.ledger.start, self.executor.run, time.perf_counter
        # One reading of the clock a job: a job's run ends when the next one's begins
        # (the few statements between them count in its run time), and its wall-clock
        # start is the batch's, moved on by the monotonic clock.
        t0 = clock()
        wall = time.time() - t0
        try:
            for h in held:
                start = ledger_start(h)
                if start is Start.DEFER:
                    deferred.append(h)  # a solitary job waits for this worker to empty
                    continue
                if start is Start.SKIP:
                    continue  # lost meanwhile, or handed back by a shutdown
                if h.solitary:
                    t0 = clock()  # it may have waited in start() for the others to finish
                h.started_at = wall + t0
                if started is not None:
                    started(h)
                    t0 = clock()
                outcomes.append(run(h, lane))
                end = clock()
                h.run_time = end - t0
                t0 = end
                ran += 1
            busy = time.monotonic() - began
            if deferred:
                self.completer.hand_back(lane.connect, deferred, refund=True)
            entered = (
                not self.stopping and not self.ledger.unknown_claims(lane.prefix) and self.producer.try_enter()
            )
            try:
                owner = self.ledger.lane_owner(lane.prefix)
                request = self.producer.request(limit, owner) if entered else None
                if request is None:
                    self.completer.record(lane.connect, outcomes)
                    return [], ran, busy
                done = self.completer.record(lane.connect, outcomes, claim_owner=request.owner)
                claimed = self.complete_then_claim(lane.connect, done, request)
                if claimed is None:  # no claim ran with the completion
                    return [], ran, busy
                nxt = self.producer.accept(request, claimed)
                accepted = True
            finally:
                if entered:
                    self.producer.leave()
                if request is not None and not accepted:
                    self.producer.unclaimed(request)
            if not nxt and request.isolated:
                return [], ran, busy  # no isolated job waits: claim ordinary ones next round
            return nxt, ran, busy
        except Exception:
            log.exception("executor: unexpected error; the batch's jobs return after their lease")
            self.ledger.lose(held)
            return [], ran, busy


