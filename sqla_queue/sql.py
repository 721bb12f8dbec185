"""Statement builders: every state change of a job, as a SQLAlchemy Core statement.

Each function takes a queue model (or its ``Table``) and returns an ``Executable`` that
the caller can print, compose and run on any ``Connection`` or ``Session``, in their own
transaction. Nothing here opens connections, sleeps or starts threads.

Every transition after a claim is *fenced*: it matches only a row that is still
``running``, still leased to ``owner``, and still on the attempt the caller claimed. A
worker that lost its lease (it stalled, the sweeper returned the job, another worker
re-claimed it) matches nothing, so it can neither extend, complete nor fail the job; and
since the claim increments ``attempts``, not even the same owner can finish an attempt
that is no longer current. Callers learn the outcome from ``RETURNING``.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime, timedelta
from types import MappingProxyType
from typing import Any, Final, NamedTuple, TypeAlias

from sqlalchemy import (
    CTE,
    BigInteger,
    Boolean,
    CompoundSelect,
    DateTime,
    Delete,
    Float,
    Interval,
    Numeric,
    Select,
    String,
    Table,
    Text,
    all_,
    and_,
    any_,
    bindparam,
    case,
    cast,
    delete,
    false,
    func,
    insert,
    inspect,
    literal,
    literal_column,
    not_,
    null,
    or_,
    select,
    true,
    tuple_,
    type_coerce,
    union_all,
)
from sqlalchemy.dialects.postgresql import ARRAY, Insert, array
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.postgresql.base import PGDialect, PGIdentifierPreparer
from sqlalchemy.sql import column as _sql_column
from sqlalchemy.sql import table as _sql_table
from sqlalchemy.sql.dml import ReturningDelete, ReturningInsert, ReturningUpdate
from sqlalchemy.sql.elements import BindParameter, ColumnElement, Grouping

from .errors import EnqueueError
from .model import (
    FINISHED_STATUSES,
    TIMEOUT_COLUMNS,
    JobStatus,
    QueueTable,
    UniqueJobs,
    notify_channel,
    queue_table,
    status_literal,
    unique_jobs,
    unique_predicate,
)
from .periodic import schedules_table

__all__ = [
    "Backoff",
    "ClaimToken",
    "archive_finished",
    "cancel_jobs",
    "cancel_pending",
    "claim",
    "claim_schedule_tick",
    "claim_candidates",
    "claim_template",
    "complete_if_owner",
    "complete_many_if_owner",
    "complete_many_if_owner_then_claim",
    "complete_template",
    "delay_from_insert",
    "delete_jobs",
    "extend_leases_if_owner",
    "extend_unlocked_leases_if_owner",
    "fail_if_owner",
    "fail_many_if_owner",
    "fail_unclaimable",
    "finished_per_minute",
    "get_job",
    "has_timeouts",
    "insert_unique",
    "is_solitary",
    "isolated_waiting",
    "job_filter",
    "keeps_unique_key",
    "lease_owners",
    "list_jobs",
    "listening_workers",
    "next_run_after",
    "owned_tokens",
    "prune_finished",
    "queue_depth",
    "prune_lock_key",
    "queue_stats",
    "release_if_owner",
    "release_lost_claims",
    "release_many_if_owner",
    "requeue_failed",
    "retry_if_owner",
    "retry_many_if_owner",
    "schedule_states",
    "schedule_tick_template",
    "seconds_interval",
    "snooze_if_owner",
    "snooze_many_if_owner",
    "still_fresh",
    "sweep_expired",
    "token_states",
    "unique_holder",
]

#: A queue model class or its Table.
QueueModel: TypeAlias = Any
Duration: TypeAlias = "timedelta | float"

_PG_PREPARER: Final = PGIdentifierPreparer(PGDialect())  # type: ignore[no-untyped-call]

PENDING = JobStatus.PENDING
RUNNING = JobStatus.RUNNING
DONE = JobStatus.DONE
FAILED = JobStatus.FAILED
CANCELLED = JobStatus.CANCELLED


class ClaimToken(NamedTuple):
    """What a claim hands out and every later transition must present: id and attempt."""

    job_id: Any
    attempt: int


def _seconds(value: Duration, what: str) -> float:
    seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"{what} must be a finite, non-negative duration, got {value!r}")
    return seconds


#: One second as an interval literal: multiplied by a number of seconds, never by days.
_ONE_SECOND: Final = literal_column("interval '1 second'", Interval())


def seconds_interval(seconds: float | ColumnElement[Any]) -> ColumnElement[timedelta]:
    """``CAST(:s AS FLOAT) * interval '1 second'``: exactly ``seconds`` seconds (a number,
    or an expression such as a bound parameter).

    Not a bound ``timedelta``: psycopg sends ``timedelta(days=1)`` as the interval
    ``'1 day'``, which PostgreSQL adds by the calendar, so across a daylight-saving
    change in the session's time zone it lasts 23 or 25 hours. Seconds are seconds.
    The explicit cast lets the statement prepare on its own (PREPARE, other drivers).
    """
    if not isinstance(seconds, ColumnElement):
        seconds = literal(float(seconds), Float())
    return type_coerce(cast(seconds, Float()) * _ONE_SECOND, Interval())


def _interval(value: Duration, what: str) -> ColumnElement[timedelta]:
    return seconds_interval(_seconds(value, what))


def delay_from_insert(seconds: float) -> ColumnElement[datetime]:
    """``clock_timestamp()`` + ``seconds``: a delay measured from the statement's moment.

    ``now()`` would be the start of the transaction, so in a transaction that ran for
    three seconds a two-second delay would already be over at commit.
    """
    return _clock() + seconds_interval(seconds)


def _clock() -> ColumnElement[datetime]:
    # clock_timestamp(), not now(): a lease is measured from the moment the row changes,
    # not from the start of a transaction that may have waited on locks.
    return func.clock_timestamp(type_=DateTime(timezone=True))


def _status(qt: QueueTable, status: JobStatus) -> ColumnElement[bool]:
    column: ColumnElement[str] = qt.c.status
    return column == status_literal(status)


def _tokens(tokens: ClaimToken | Iterable[tuple[Any, int]]) -> list[tuple[Any, int]]:
    if isinstance(tokens, ClaimToken):
        tokens = [tokens]
    return [(job_id, int(attempt)) for job_id, attempt in tokens]


def _pk_in(qt: QueueTable, ids: Iterable[Any]) -> ColumnElement[bool]:
    """``pk = ANY(:ids)``; for no ids a plain ``false``, so that empty means none.

    An array, not an expanded ``IN`` list: one parameter whatever the number of ids
    (psycopg allows 65,535), and a text that runs as compiled, on any cursor.
    """
    if isinstance(ids, (str, bytes)):
        raise TypeError("ids must be a collection of job ids, not a single string")
    wanted = list(ids)
    if not wanted:
        return false()
    return qt.pk == any_(bindparam("ids", wanted, type_=ARRAY(qt.pk.type), unique=True))


def _queue_names(queues: Sequence[str] | None) -> list[str] | None:
    if queues is None:
        return None
    if isinstance(queues, str):
        raise TypeError("queues must be a sequence of queue names, not a single string")
    names = list(dict.fromkeys(queues))
    if not names:
        raise ValueError("queues must name at least one queue (or be None for all queues)")
    return names


def _queue_array(qt: QueueTable, names: list[str]) -> ColumnElement[Any]:
    return bindparam("queues", names, type_=ARRAY(qt.c.queue.type), unique=True)


def _queue_filter(qt: QueueTable, queues: Sequence[str] | None) -> list[ColumnElement[bool]]:
    """``queue = :name`` or ``queue = ANY(:names)``: never an expanding ``IN``, whose
    placeholder only SQLAlchemy's own execution fills in (the worker compiles once and
    runs the text on the psycopg cursor)."""
    names = _queue_names(queues)
    if names is None:
        return []
    if len(names) == 1:
        return [qt.c.queue == names[0]]
    return [qt.c.queue == any_(_queue_array(qt, names))]


def _kind_filter(qt: QueueTable) -> list[ColumnElement[bool]]:
    """A single-table-inheritance subclass's own rows: its polymorphic identity and its
    subclasses' (as the ORM's ``select(SubClass)`` would). Nothing for a base or a plain
    model: they take every row of the table."""
    cls = qt.mapped_class
    mapper: Any = inspect(cls) if cls is not None else None
    if mapper is None or mapper.polymorphic_on is None or mapper.inherits is None:
        return []
    on: ColumnElement[Any] = mapper.polymorphic_on
    identities = list(
        dict.fromkeys(m.polymorphic_identity for m in mapper.self_and_descendants if m.polymorphic_identity is not None)
    )
    if len(identities) == 1:
        return [on == identities[0]]
    return [on == any_(bindparam("identities", identities, type_=ARRAY(on.type), unique=True))]


#: Values the parameters of the statement being built take (see :func:`_param`).
_BOUND: ContextVar[Mapping[str, Any]] = ContextVar("sqla_queue_bound", default=MappingProxyType({}))


def _param(name: str, type_: Any, *default: Any) -> BindParameter[Any]:
    """A named parameter of the worker's statements, bound at execution; or, while a
    single-call builder (:func:`claim`, :func:`complete_if_owner`, …) builds its
    statement, the value that builder was given. So each is the worker's statement with
    values filled in: one statement, one SET clause, one fence, whichever way it runs."""
    bound = _BOUND.get()
    if name in bound:
        return bindparam(name, bound[name], type_=type_)
    if default:
        return bindparam(name, default[0], type_=type_)
    return bindparam(name, type_=type_)


@contextmanager
def _values(values: Mapping[str, Any]) -> Iterator[None]:
    token = _BOUND.set(values)
    try:
        yield
    finally:
        _BOUND.reset(token)


def claim(
    model: QueueModel,
    *,
    owner: str,
    limit: int = 1,
    lease: Duration = 30.0,
    queues: Sequence[str] | None = None,
    isolated: bool = False,
    timeout: Duration | None = None,
) -> ReturningUpdate[Any]:
    """Atomically claim up to ``limit`` runnable jobs for ``owner``.

    ``UPDATE … FROM (SELECT pk … WHERE status='pending' AND run_after <= now()
    ORDER BY priority DESC, run_after, pk LIMIT n FOR UPDATE SKIP LOCKED) … RETURNING *``:
    concurrent claimers skip each other's rows instead of queueing behind them, and the
    selection and the status change are one statement, so no lock is released in between.
    The row's ``attempts`` is incremented; with ``owner`` it forms the fencing token.

    ``isolated=True`` claims (one at a time) the jobs whose last attempt ended with an
    expired lease; the default claim leaves them alone so they never share a batch.

    Each claimed attempt gets a deadline (``deadline_at``) when the job has a
    ``timeout`` of its own, or ``timeout`` is given (the job's wins); its lease never
    runs past it.

    This is :func:`claim_template`, the statement the worker runs, with the values bound.
    """
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"limit must be an integer of at least 1, got {limit!r}")
    seconds = _seconds(lease, "lease")
    values: dict[str, Any] = {OWNER_PARAM: owner, LIMIT_PARAM: 1 if isolated else limit, LEASE_PARAM: seconds}
    if timeout is not None:
        values[TIMEOUT_PARAM] = _seconds(timeout, "timeout")
    with _values(values):
        return claim_template(model, queues=queues, isolated=isolated)


def _claim(
    qt: QueueTable,
    queues: Sequence[str] | None,
    isolated: bool,
    *,
    limit: int | ColumnElement[int],
    owner: str | ColumnElement[str],
    lease: ColumnElement[Any],
    extra: Sequence[ColumnElement[bool]] = (),
    after: bool = False,
) -> ReturningUpdate[Any]:
    """The claim of :func:`claim` and :func:`claim_template`: values or bound parameters.

    Every form reads the pending jobs in the order of a partial index and stops after
    ``limit`` rows, however large the backlog:

    - all queues: ``<table>_claim_idx (priority DESC, run_after, pk)``;
    - one queue: ``<table>_claim_queue_idx (queue, priority DESC, run_after, pk)``;
    - several queues: one ``LATERAL`` index scan of ``claim_queue_idx`` per queue
      (``unnest(:queues)``), each ``LIMIT n FOR UPDATE SKIP LOCKED``, then the best
      ``n`` of them. ``queue = ANY(:queues)`` cannot do this on PostgreSQL 15: the
      index cannot return several queues' rows in one order, so the claim sorted every
      pending row of those queues (200k pending: 500 ms against 1 ms); the all-queues
      index with a queue filter reads past every job of the queues not served, a
      backlog there makes it as slow. The price: up to ``n`` rows locked per queue, the
      surplus released when the statement's transaction ends (the worker claims in
      autocommit: at once). Meanwhile other claimers skip those rows and take the next.
    """
    c = qt.c
    conditions = [
        _status(qt, PENDING),
        c.run_after <= func.now(),
        c.isolated if isolated else not_(c.isolated),
        *_kind_filter(qt),
        *extra,
    ]
    names = _queue_names(queues)
    order = (c.priority.desc(), c.run_after, qt.pk)
    if after and names is not None and len(names) > 1:
        claimable = _claimable_after_each_queue(qt, conditions, order, limit, names)
    elif after:
        claimable = _claimable_after(qt, [*conditions, *_queue_filter(qt, names)], order, limit)
    elif names is None or len(names) == 1:
        claimable = (
            select(qt.pk)
            .where(*conditions, *_queue_filter(qt, names))
            .order_by(*order)
            .limit(limit)
            .with_for_update(skip_locked=True)
        )
    else:
        served = func.unnest(_queue_array(qt, names)).table_valued("name").render_derived(name="served")
        per_queue = (
            select(qt.pk, c.priority, c.run_after)
            .where(*conditions, c.queue == served.c.name)
            .order_by(*order)
            .limit(limit)
            .with_for_update(skip_locked=True)
            .lateral("per_queue")
        )
        pk = per_queue.c[qt.pk.name]
        claimable = (
            select(pk)
            .select_from(served)
            .join(per_queue, true())
            .order_by(per_queue.c.priority.desc(), per_queue.c.run_after, pk)
            .limit(limit)
        )
    lease_expires_at: ColumnElement[Any] = _clock() + seconds_interval(lease)
    timed: dict[str, Any] = {}
    if has_timeouts(qt):
        deadline = _clock() + seconds_interval(_timeout_of(qt))
        # LEAST ignores NULL: no deadline, the lease alone.
        lease_expires_at = func.least(lease_expires_at, deadline, type_=DateTime(timezone=True))
        timed = {"started_at": _clock(), "deadline_at": deadline}
    return (
        qt.table.update()
        .where(_keys_of(qt, claimable))
        .values(
            status=status_literal(RUNNING),
            lease_owner=owner,
            lease_expires_at=lease_expires_at,
            attempts=c.attempts + 1,
            **timed,
        )
        .returning(*(_loadable_run_after(qt) if col is c.run_after else col for col in qt.table.c))
    )


def _keys_of(qt: QueueTable, chosen: Select[Any]) -> ColumnElement[bool]:
    """``pk = ANY(ARRAY(chosen))``: the rows whose keys ``chosen`` (one column of keys,
    ``LIMIT n FOR UPDATE SKIP LOCKED``) picks, picked once.

    Not a join to ``chosen`` as a subquery: a plan may put that subquery on the inner
    side of a nested loop and run it again for every outer row, and each run locks and
    returns rows the previous ones did not (this statement's own updates are skipped),
    so the statement would move many more rows than its LIMIT. That plan is PostgreSQL's
    choice for a table it believes empty (a generic plan made while it was). An
    uncorrelated ``ARRAY(…)`` is an InitPlan: run once, whatever the plan around it.
    """
    picked = func.array(chosen.scalar_subquery(), type_=ARRAY(qt.pk.type))
    return qt.pk == any_(picked)


def _claimable_after(
    qt: QueueTable, conditions: Sequence[ColumnElement[bool]], order: Sequence[ColumnElement[Any]],
    limit: int | ColumnElement[int],
) -> Select[Any]:
    """The pending keys after the cursor (``AFTER_*_PARAM``) in the claim's order: the
    rest of its priority (one index range, ``(run_after, pk) > (…)``), then the lower
    priorities. Each part ``LIMIT n FOR UPDATE SKIP LOCKED``; the outer LIMIT stops the
    second from running (and locking) when the first filled the claim."""
    c = qt.c
    priority = _param(AFTER_PRIORITY_PARAM, c.priority.type)
    later = tuple_(c.run_after, qt.pk) > tuple_(
        _param(AFTER_RUN_AFTER_PARAM, c.run_after.type), _param(AFTER_KEY_PARAM, qt.pk.type)
    )
    parts = [
        select(qt.pk)
        .where(*conditions, *where)
        .order_by(*order)
        .limit(limit)
        .with_for_update(skip_locked=True)
        .subquery(name)  # a UNION's own branches cannot lock; subqueries in them can
        for name, where in (("same_priority", (c.priority == priority, later)), ("lower", (c.priority < priority,)))
    ]
    ahead = union_all(*(select(part.c[qt.pk.name]) for part in parts)).subquery("ahead")
    return select(ahead.c[qt.pk.name]).limit(limit)


def _claimable_after_each_queue(
    qt: QueueTable, conditions: Sequence[ColumnElement[bool]], order: Sequence[ColumnElement[Any]],
    limit: int | ColumnElement[int], names: list[str],
) -> Select[Any]:
    """Several queues' pending keys, each after a cursor of its own: one ``LATERAL`` per
    queue as the claim from the head makes, each reading :func:`_claimable_after`'s two
    parts from that queue's ``AFTER_*S_PARAM`` entry (arrays in the order of the queues
    given, duplicates dropped), then the best ``n`` of them. A queue whose entry has the
    priority :data:`HEAD_PRIORITY` is read from its head (no job of it was claimed yet)."""
    c = qt.c
    served = (
        func.unnest(
            _queue_array(qt, names),
            _param(AFTER_PRIORITIES_PARAM, ARRAY(BigInteger())),
            _param(AFTER_RUN_AFTERS_PARAM, ARRAY(c.run_after.type)),
            _param(AFTER_KEYS_PARAM, ARRAY(qt.pk.type)),
        )
        .table_valued("name", "after_priority", "after_run_after", "after_key")
        .render_derived(name="served")
    )
    later = tuple_(c.run_after, qt.pk) > tuple_(served.c.after_run_after, served.c.after_key)
    parts = [
        select(qt.pk, c.priority, c.run_after)
        .where(*conditions, c.queue == served.c.name, *where)
        # The queue first, one value here: the order of <table>_claim_queue_idx, which
        # reads this queue's entries alone (the all-queues index would read every
        # queue's, a backlog of a queue not served included).
        .order_by(c.queue, *order)
        .limit(limit)
        .with_for_update(skip_locked=True)
        .correlate(served)
        .subquery(name)
        for name, where in (
            ("same_priority", (c.priority == served.c.after_priority, later)),
            ("lower", (c.priority < served.c.after_priority,)),
        )
    ]
    ahead = union_all(*(select(*part.c) for part in parts)).subquery("ahead")
    per_queue = select(*ahead.c).limit(limit).lateral("per_queue")
    pk = per_queue.c[qt.pk.name]
    return (
        select(pk)
        .select_from(served)
        .join(per_queue, true())
        .order_by(per_queue.c.priority.desc(), per_queue.c.run_after, pk)
        .limit(limit)
    )


def has_timeouts(model: QueueModel) -> bool:
    """Whether the table has the columns of timeouts (``timeout``, ``started_at``,
    ``deadline_at``): every :class:`~sqla_queue.JobMixin` model does."""
    qt = model if isinstance(model, QueueTable) else queue_table(model)
    return all(name in qt.c for name in TIMEOUT_COLUMNS)


def _timeout_of(qt: QueueTable) -> ColumnElement[Any]:
    """The seconds a claimed attempt may run: the job's own ``timeout``, else its task's
    (a task table: ``TASK_NAMES_PARAM``/``TASK_TIMEOUTS_PARAM``, two arrays), else
    ``TIMEOUT_PARAM``; NULL when none is set. The most specific wins."""
    c = qt.c
    choices: list[ColumnElement[Any]] = [c.timeout]
    if qt.is_task_table:
        names = _param(TASK_NAMES_PARAM, ARRAY(c.task.type), None)
        timeouts = _param(TASK_TIMEOUTS_PARAM, ARRAY(Float()), None)
        choices.append(Grouping(timeouts)[func.array_position(names, c.task)])
    choices.append(_param(TIMEOUT_PARAM, Float(), None))
    return func.coalesce(*choices, type_=Float())


#: The widest timestamps Python's ``datetime`` holds in any time zone (a day inside).
_FIRST_LOADABLE: Final = literal_column("timestamptz '0001-01-02 00:00:00+00'", DateTime(timezone=True))
_LAST_LOADABLE: Final = literal_column("timestamptz '9999-12-30 00:00:00+00'", DateTime(timezone=True))


def _loadable_run_after(qt: QueueTable) -> ColumnElement[datetime]:
    """The claimed row's ``run_after`` within Python's datetime range: a job scheduled
    at ``'-infinity'`` (or before year 1) is due, and must load and run, not fail as a
    row no driver can read. The row itself keeps its value."""
    return func.least(func.greatest(qt.c.run_after, _FIRST_LOADABLE), _LAST_LOADABLE, type_=qt.c.run_after.type).label(
        qt.c.run_after.name
    )


def isolated_waiting(model: QueueModel, *, queues: Sequence[str] | None = None) -> Select[Any]:
    """``SELECT EXISTS`` a runnable isolated job: cheap, served by a tiny partial index."""
    qt = queue_table(model)
    c = qt.c
    found = (
        select(qt.pk)
        .where(
            _status(qt, PENDING), c.isolated, c.run_after <= func.now(), *_queue_filter(qt, queues),
            *_kind_filter(qt),
        )
        .limit(1)
    )
    return select(found.exists())


def _token_values(owner: str, tokens: ClaimToken | Iterable[tuple[Any, int]], **values: Any) -> dict[str, Any]:
    """The bound values of a token statement, for the single-call conveniences."""
    listed = _tokens(tokens)
    return {OWNER_PARAM: owner, IDS_PARAM: [t[0] for t in listed], ATTEMPTS_PARAM: [t[1] for t in listed], **values}


def extend_leases_if_owner(
    model: QueueModel, *, owner: str, tokens: ClaimToken | Iterable[tuple[Any, int]], lease: Duration
) -> CompoundSelect[Any]:
    """Push the leases of ``owner``'s current attempts forward: one statement per heartbeat.

    Returns ``(pk, attempts)`` of each job it extended; a job missing from the result has
    lost its lease, or its row is locked by another transaction right now (the handler's
    own update of it): the heartbeat steps over it rather than wait. This is
    :func:`extend_unlocked_leases_if_owner`, the statement the worker runs, with the
    values bound.
    """
    seconds = _seconds(lease, "lease")
    with _values(_token_values(owner, tokens, **{LEASE_PARAM: seconds})):
        return extend_unlocked_leases_if_owner(model)


def complete_if_owner(
    model: QueueModel, *, owner: str, tokens: ClaimToken | Iterable[tuple[Any, int]]
) -> ReturningUpdate[Any]:
    """Mark jobs ``done`` if ``owner`` still holds their current attempt.

    Run it in the handler's own transaction to make the handler's writes and the
    completion one atomic step: if it returns no row, roll back. Returns ``(pk,
    attempts)`` of each job it completed. This is :func:`complete_many_if_owner`, the
    statement the worker runs, with the values bound.
    """
    with _values(_token_values(owner, tokens)):
        return complete_many_if_owner(model)


#: Bound-parameter names of the token statements (see the templates below).
OWNER_PARAM: Final = "sqla_queue_owner"
IDS_PARAM: Final = "sqla_queue_ids"
ATTEMPTS_PARAM: Final = "sqla_queue_attempts"
JOB_PARAM: Final = "sqla_queue_job"
ATTEMPT_PARAM: Final = "sqla_queue_attempt"


def complete_template(model: QueueModel, *, single: bool = False) -> ReturningUpdate[Any]:
    """:func:`complete_many_if_owner` (kept under this name): the owner and tokens bound
    at execution, ``{OWNER_PARAM: owner, IDS_PARAM: [id1, ...], ATTEMPTS_PARAM:
    [attempt1, ...]}``; ``single=True`` takes one token as ``{JOB_PARAM: job_id,
    ATTEMPT_PARAM: attempt}`` instead. The same statement, fence and effect."""
    if not single:
        return complete_many_if_owner(model)
    qt = queue_table(model)
    ids = array([_param(JOB_PARAM, qt.pk.type)])
    attempts = array([_param(ATTEMPT_PARAM, qt.c.attempts.type)])
    return _complete_many(qt, ids, attempts)


def retry_if_owner(
    model: QueueModel, *, owner: str, token: ClaimToken | tuple[Any, int], error: str, delay: Duration
) -> ReturningUpdate[Any]:
    """Record a failed attempt: back to ``pending`` after ``delay``, or to ``failed``.

    A job that has used ``max_attempts`` becomes ``failed`` (the dead letter). Returns
    ``(pk, attempts, status)`` so the caller knows which it was, or nothing if the lease
    was lost. This is :func:`retry_many_if_owner`, the statement the worker runs, with
    the values bound.
    """
    seconds = _seconds(delay, "delay")
    with _values(_token_values(owner, [token], **{ERRORS_PARAM: [error], DELAYS_PARAM: [seconds]})):
        return retry_many_if_owner(model)


def fail_if_owner(
    model: QueueModel, *, owner: str, token: ClaimToken | tuple[Any, int], error: str
) -> ReturningUpdate[Any]:
    """Dead-letter a job now (``failed``), whatever attempts remain; returns ``(pk,
    attempts)``. This is :func:`fail_many_if_owner` with the values bound."""
    with _values(_token_values(owner, [token], **{ERRORS_PARAM: [error]})):
        return fail_many_if_owner(model)


def release_if_owner(
    model: QueueModel,
    *,
    owner: str,
    tokens: ClaimToken | Iterable[tuple[Any, int]],
    refund_attempt: bool = True,
) -> ReturningUpdate[Any]:
    """Hand claimed jobs back to ``pending`` at once, e.g. on a worker's shutdown.

    ``refund_attempt`` does not count the attempt against ``max_attempts`` (a job whose
    handler never started): ``max_attempts`` grows by one, and ``attempts`` keeps the
    claim's number, so the next claim hands out a new one and a fencing token never
    names two claims. Returns ``(pk, attempts)``. This is
    :func:`release_many_if_owner` with the values bound.
    """
    with _values(_token_values(owner, tokens)):
        return release_many_if_owner(model, refund_attempt=refund_attempt)


#: How ``last_error`` begins when a job's lease expired on two attempts in a row: its
#: workers vanished twice while it ran, so the worker runs it with no other job at all.
SOLITARY_REASON: Final = "lease expired again"


def is_solitary(isolated: Any, last_error: Any) -> bool:
    """Whether a claimed row must run alone in its worker (its lease expired on its last
    two attempts), from its ``isolated`` and ``last_error`` columns.

    Derived, not stored: only :func:`sweep_expired` writes this reason, and every other
    way out of an attempt (a retry, a requeue) clears ``isolated`` or ends the job.
    """
    return bool(isolated) and isinstance(last_error, str) and last_error.startswith(SOLITARY_REASON + ":")


def sweep_expired(model: QueueModel, *, limit: int = 1000) -> ReturningUpdate[Any]:
    """Return jobs whose lease expired to ``pending`` (or ``failed`` when exhausted).

    Their worker stopped heartbeating: it died, froze or lost the database. The job is
    marked ``isolated`` so its next attempt runs alone in its batch, and ``last_error``
    says why; a job that was isolated already gets :data:`SOLITARY_REASON` there, and
    the worker then runs it alone in the whole worker (see :func:`is_solitary`).
    Safe to run from many workers at once: rows another sweeper holds are skipped.
    Returns ``(pk, status)`` of every job it moved.
    """
    if limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}")
    qt = queue_table(model)
    c = qt.c
    expired = (
        select(qt.pk)
        .where(_status(qt, RUNNING), c.lease_expires_at < _clock())
        .limit(limit)
        .with_for_update(skip_locked=True)
    )
    exhausted = c.attempts >= c.max_attempts
    # A job already isolated when its lease expires again has now been running when two
    # workers in a row vanished: it is marked to run alone in its worker from now on
    # (see SOLITARY_REASON), so that it cannot take other jobs with it any more.
    why: ColumnElement[Any] = case(
        (c.isolated, literal(SOLITARY_REASON + ": worker ", String)), else_=literal("lease expired: worker ", String)
    )
    isolated: ColumnElement[Any] = true()
    if has_timeouts(qt):
        # Past its deadline, the attempt timed out (its lease never runs past it): the
        # job's own failure, retried or dead-lettered, and not a sign its worker died.
        timed_out = and_(c.deadline_at.is_not(None), c.deadline_at <= _clock())
        why = case((timed_out, literal("timed out after ", String) + _seconds_text(c.deadline_at - c.started_at)
                    + literal(" s: worker ", String)), else_=why)
        isolated = case((timed_out, c.isolated), else_=true())
    reason = (
        why
        + func.coalesce(c.lease_owner, "?")
        + literal(" did not finish attempt ", String)
        + cast(c.attempts, String)
        + literal(" of ", String)
        + cast(c.max_attempts, String)
    )
    return (
        qt.table.update()
        .where(_keys_of(qt, expired))
        .values(
            status=case((exhausted, status_literal(FAILED)), else_=status_literal(PENDING)),
            finished_at=case((exhausted, _clock()), else_=null()),
            last_error=reason,
            lease_owner=null(),
            lease_expires_at=null(),
            isolated=isolated,
        )
        .returning(qt.pk, c.status)
    )


def _seconds_text(interval: ColumnElement[Any]) -> ColumnElement[str]:
    """An interval as seconds, ``30`` or ``0.5``: as :func:`sqla_queue.current.timeout_text` writes them."""
    rounded = cast(func.round(cast(func.extract("epoch", interval), Numeric()), 3), String)
    return func.coalesce(func.rtrim(func.rtrim(rounded, "0"), "."), "?")



def requeue_failed(
    model: QueueModel,
    *,
    ids: Iterable[Any] | None = None,
    queues: Sequence[str] | None = None,
    delay: Duration = 0,
    tasks: Sequence[str] | None = None,
    error_contains: str | None = None,
    statuses: Sequence[JobStatus | str] = (FAILED,),
) -> ReturningUpdate[Any]:
    """Give dead-lettered (``failed``) jobs a fresh set of attempts.

    ``last_error`` is kept for the record. ``ids=None`` requeues every failed job (of
    ``queues``, ``tasks``, with ``error_contains`` in ``last_error``: the filters of
    :func:`list_jobs`); an empty ``ids`` requeues none. ``delay`` counts from the update.
    ``statuses``: the finished states to requeue, ``failed`` and/or ``cancelled``.

    Unique jobs: a job whose key another job holds now (or a newer job of ``statuses``
    with the same key) stays as it is, so the requeue never breaks the unique index; an
    enqueue of that key racing the requeue can still make it fail with an
    ``IntegrityError`` (an UPDATE cannot skip a conflict), so run it again.
    """
    qt = queue_table(model)
    wanted = list(dict.fromkeys(JobStatus(s) for s in statuses))
    if not wanted or any(s not in (FAILED, CANCELLED) for s in wanted):
        raise ValueError(f"only failed and cancelled jobs can be requeued, got {[str(s) for s in wanted]}")
    status: ColumnElement[bool] = (
        _status(qt, wanted[0]) if len(wanted) == 1 else qt.c.status.in_([status_literal(s) for s in wanted])
    )
    conditions = [
        status,
        *_job_filter(qt, ids=ids, queues=queues, tasks=tasks, error_contains=error_contains),
    ]
    unique = unique_jobs(qt.table)
    if unique is not None and any(s not in unique.statuses for s in wanted):
        other = qt.table.alias("sqla_queue_holder")
        other_pk = other.c[qt.pk.key]
        held = or_(
            other.c.status.in_([status_literal(st) for st in unique.statuses]),
            and_(other.c.status.in_([status_literal(st) for st in wanted]), other_pk > qt.pk),
        )
        conditions.append(
            ~select(literal(1))
            .where(other.c[unique.column] == qt.c[unique.column], other_pk != qt.pk, held)
            .exists()
        )
    return (
        qt.table.update()
        .where(*conditions)
        .values(
            status=status_literal(PENDING),
            attempts=0,
            run_after=_clock() + _interval(delay, "delay"),
            finished_at=null(),
            lease_owner=null(),
            lease_expires_at=null(),
            isolated=False,
        )
        .returning(qt.pk)
    )


def cancel_jobs(
    model: QueueModel, *, ids: Iterable[Any] | None = None, queues: Sequence[str] | None = None
) -> ReturningUpdate[Any]:
    """Cancel pending **and running** jobs: ``cancelled``, finished now, no lease expiry
    (``lease_owner`` is kept: the worker that held it).

    A fenced transition: a running attempt of a cancelled job can no longer complete,
    retry or fail (every later statement of its worker is fenced by ``status =
    'running'``), so its handler's transactional writes roll back, whatever it does. The
    cancel and a completion racing it lock the same row: the first to commit wins, the
    other matches nothing. ``ids`` and/or ``queues`` choose the jobs (an empty ``ids``
    cancels none; neither: every unfinished job). Returns ``(pk, status before)`` of
    each job cancelled; the running ones' workers learn it from
    :func:`sqla_queue.cancel`'s NOTIFY, or their next poll of their jobs.
    """
    qt = queue_table(model)
    c = qt.c
    conditions: list[ColumnElement[bool]] = [
        c.status.in_([status_literal(PENDING), status_literal(RUNNING)]), *_queue_filter(qt, queues), *_kind_filter(qt)
    ]
    if ids is not None:
        conditions.append(_pk_in(qt, ids))
    before = select(qt.pk, c.status).where(*conditions).with_for_update().subquery("sqla_queue_before")
    name = qt.pk.name
    return (
        qt.table.update()
        .where(qt.pk == before.c[name], c.status.in_([status_literal(PENDING), status_literal(RUNNING)]))
        .values(status=status_literal(CANCELLED), finished_at=_clock(), lease_expires_at=null())
        .returning(qt.pk, before.c.status)
    )


def cancel_pending(model: QueueModel, *, ids: Iterable[Any]) -> ReturningUpdate[Any]:
    """Cancel jobs that have not been claimed yet; running jobs are left to finish.

    An empty ``ids`` cancels nothing.
    """
    qt = queue_table(model)
    return (
        qt.table.update()
        .where(_status(qt, PENDING), _pk_in(qt, ids))
        .values(status=status_literal(CANCELLED), finished_at=_clock())
        .returning(qt.pk)
    )


def _statuses(statuses: Sequence[JobStatus | str] | None) -> list[JobStatus] | None:
    if statuses is None:
        return None
    if isinstance(statuses, str):
        raise TypeError("statuses must be a sequence of statuses, not a single string")
    try:
        wanted = list(dict.fromkeys(JobStatus(s) for s in statuses))
    except ValueError:
        raise ValueError(
            f"unknown status in {list(statuses)!r} (one of {', '.join(s.value for s in JobStatus)})"
        ) from None
    if not wanted:
        raise ValueError("statuses must name at least one status (or be None for all)")
    return wanted


def job_filter(
    model: QueueModel,
    *,
    ids: Iterable[Any] | None = None,
    queues: Sequence[str] | None = None,
    statuses: Sequence[JobStatus | str] | None = None,
    tasks: Sequence[str] | None = None,
    error_contains: str | None = None,
) -> list[ColumnElement[bool]]:
    """The WHERE conditions of the inspection filters, to compose into a statement of
    your own: ``select(Model).where(*job_filter(Model, statuses=["failed"]))``.

    ``None`` leaves a filter out; a list keeps jobs matching any of its values;
    ``error_contains`` matches ``last_error`` case-insensitively, ``%`` and ``_`` taken
    literally. ``tasks`` needs a task table (:class:`~sqla_queue.TaskMixin`). Statuses
    are inline literals, so the partial indexes of ``pending`` and ``running`` jobs serve.
    """
    return _job_filter(
        queue_table(model), ids=ids, queues=queues, statuses=statuses, tasks=tasks, error_contains=error_contains
    )


def _job_filter(
    qt: QueueTable,
    *,
    ids: Iterable[Any] | None = None,
    queues: Sequence[str] | None = None,
    statuses: Sequence[JobStatus | str] | None = None,
    tasks: Sequence[str] | None = None,
    error_contains: str | None = None,
) -> list[ColumnElement[bool]]:
    c = qt.c
    conditions: list[ColumnElement[bool]] = []
    if ids is not None:
        conditions.append(_pk_in(qt, ids))
    conditions.extend(_queue_filter(qt, queues))
    wanted = _statuses(statuses)
    if wanted is not None:
        column: ColumnElement[str] = c.status
        literals = [status_literal(s) for s in wanted]
        conditions.append(column == literals[0] if len(literals) == 1 else column.in_(literals))
    if tasks is not None:
        if "task" not in c:
            raise ValueError(f"table {qt.table.fullname!r} has no task column: filter by task on a task table")
        if isinstance(tasks, str):
            raise TypeError("tasks must be a sequence of task names, not a single string")
        names = list(dict.fromkeys(tasks))
        if not names:
            raise ValueError("tasks must name at least one task (or be None for all)")
        task: ColumnElement[str] = c.task
        conditions.append(
            task == names[0] if len(names) == 1
            else task == any_(bindparam("tasks", names, type_=ARRAY(c.task.type), unique=True))
        )
    if error_contains is not None:
        if not error_contains:
            raise ValueError("error_contains must not be empty (or be None for any error)")
        error: ColumnElement[str] = c.last_error
        conditions.append(error.icontains(error_contains, autoescape=True))
    conditions.extend(_kind_filter(qt))
    return conditions


def list_jobs(
    model: QueueModel,
    *,
    ids: Iterable[Any] | None = None,
    queues: Sequence[str] | None = None,
    statuses: Sequence[JobStatus | str] | None = None,
    tasks: Sequence[str] | None = None,
    error_contains: str | None = None,
    before: Any = None,
    limit: int = 50,
) -> Select[Any]:
    """A page of jobs, every column, newest key first: the filters of :func:`job_filter`.

    Keyset pagination: pass the key of the last row of a page as ``before`` to get the
    next. The primary key's index is read backwards from there and stops after ``limit``
    matching rows, so a page costs the same on the millionth row as on the first (no
    ``OFFSET``); only a filter that few rows match reads far.
    """
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"limit must be an integer of at least 1, got {limit!r}")
    qt = queue_table(model)
    conditions = _job_filter(
        qt, ids=ids, queues=queues, statuses=statuses, tasks=tasks, error_contains=error_contains
    )
    if before is not None:
        conditions.append(qt.pk < bindparam("before", before, type_=qt.pk.type))
    return select(qt.table).where(*conditions).order_by(qt.pk.desc()).limit(limit)


def get_job(model: QueueModel, job_id: Any) -> Select[Any]:
    """One job, every column (the user's own too), by key."""
    qt = queue_table(model)
    return select(qt.table).where(qt.pk == bindparam("job_id", job_id, type_=qt.pk.type))


def keeps_unique_key(model: QueueModel) -> ColumnElement[bool] | None:
    """The condition of finished jobs that still hold their unique key (a key, in a
    finished status of the model's :class:`~sqla_queue.UniqueJobs`: ``done`` under
    :data:`~sqla_queue.UNIQUE_EVER`); None when no finished status holds keys.

    Such a row is what makes "at most once, ever" true: deleting it frees its key, and
    the same work can then be enqueued and run again. So :func:`prune_finished` and
    :func:`archive_finished` never remove one, and :func:`delete_jobs` only with
    ``free_keys=True``.
    """
    qt = queue_table(model)
    unique = unique_jobs(qt.table)
    if unique is None:
        return None
    kept = [s for s in unique.statuses if s in FINISHED_STATUSES]
    if not kept:
        return None
    statuses: ColumnElement[bool] = (
        _status(qt, kept[0]) if len(kept) == 1 else qt.c.status.in_([status_literal(s) for s in kept])
    )
    return and_(qt.c[unique.column].isnot(None), statuses)


#: The statuses :func:`delete_jobs` may delete: all but ``running``.
DELETABLE_STATUSES: Final = (PENDING, DONE, FAILED, CANCELLED)


def delete_jobs(
    model: QueueModel,
    *,
    ids: Iterable[Any] | None = None,
    queues: Sequence[str] | None = None,
    statuses: Sequence[JobStatus | str] | None = None,
    tasks: Sequence[str] | None = None,
    error_contains: str | None = None,
    limit: int = 10_000,
    free_keys: bool = False,
) -> ReturningDelete[Any]:
    """Delete up to ``limit`` jobs matching the filters of :func:`job_filter`; returns
    their keys. Never a ``running`` job (its worker holds it: cancel it, or let it end),
    and rows another transaction holds are skipped, not waited for; run it until it
    returns fewer than ``limit`` rows. ``statuses=None`` means every deletable status.

    Finished jobs that still hold a unique key (:func:`keeps_unique_key`: ``done``
    under :data:`~sqla_queue.UNIQUE_EVER`) are kept unless ``free_keys=True``: deleting
    one frees its key, so the same work could be enqueued and run again.
    """
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"limit must be an integer of at least 1, got {limit!r}")
    wanted = _statuses(statuses)
    if wanted is None:
        wanted = list(DELETABLE_STATUSES)
    if RUNNING in wanted:
        raise ValueError("running jobs cannot be deleted: their worker holds them (cancel them first)")
    qt = queue_table(model)
    conditions = _job_filter(qt, ids=ids, queues=queues, statuses=wanted, tasks=tasks, error_contains=error_contains)
    kept = None if free_keys else keeps_unique_key(qt.table)
    if kept is not None:
        conditions.append(~kept)
    doomed = (
        select(qt.pk)
        .where(*conditions)
        .limit(limit)
        .with_for_update(skip_locked=True)
    )
    return delete(qt.table).where(_keys_of(qt, doomed)).returning(qt.pk)


def finished_per_minute(model: QueueModel, *, minutes: int = 60) -> Select[Any]:
    """``(queue, minute, status, jobs)``: jobs that finished (``done``, ``failed``,
    ``cancelled``) in each of the last ``minutes`` minutes, by queue; the throughput and
    failure chart of the dashboard. Minutes without a finished job have no row."""
    if isinstance(minutes, bool) or not isinstance(minutes, int) or minutes < 1:
        raise ValueError(f"minutes must be an integer of at least 1, got {minutes!r}")
    qt = queue_table(model)
    c = qt.c
    minute = func.date_trunc("minute", c.finished_at, type_=DateTime(timezone=True)).label("minute")
    return (
        select(c.queue, minute, c.status, func.count().label("jobs"))
        .where(
            c.status.in_([status_literal(s) for s in FINISHED_STATUSES]),
            c.finished_at >= func.date_trunc("minute", func.now()) - seconds_interval((minutes - 1) * 60.0),
            *_kind_filter(qt),
        )
        .group_by(c.queue, minute, c.status)
        .order_by(c.queue, minute, c.status)
    )


def lease_owners(model: QueueModel) -> Select[Any]:
    """``(lease_owner, jobs, oldest_lease, latest_lease)``: each worker name holding
    running jobs, how many, and the earliest and latest ``lease_expires_at`` among them.
    Every heartbeat pushes the leases it holds forward, so the latest expiry minus the
    worker's lease is its last heartbeat; an oldest lease in the past is a worker that
    stopped heartbeating (the sweeper will return its jobs). Served by the partial index
    of running jobs' leases."""
    qt = queue_table(model)
    c = qt.c
    return (
        select(
            c.lease_owner,
            func.count().label("jobs"),
            func.min(c.lease_expires_at).label("oldest_lease"),
            func.max(c.lease_expires_at).label("latest_lease"),
        )
        .where(_status(qt, RUNNING), *_kind_filter(qt))
        .group_by(c.lease_owner)
        .order_by(c.lease_owner)
    )


def listening_workers(
    model: QueueModel, schema_translate_map: Mapping[str | None, str | None] | None = None
) -> Select[Any]:
    """``(pid, application_name, client, connected_at, last_active)``: the connections
    of this database that wait for ``model``'s jobs, one per live worker listening to
    its channel (under the engine's ``schema_translate_map``), oldest first.

    A worker's listener runs ``LISTEN`` and waits, so its last statement in
    ``pg_stat_activity`` is that ``LISTEN`` for as long as the worker lives, idle or
    busy: the live workers without a table of their own. Not seen: workers started
    with ``listen=False`` (behind a transaction pooler), and every worker when the
    reading role may not see other roles' statements (grant it ``pg_read_all_stats``).
    """
    channel = notify_channel(queue_table(model).table, schema_translate_map)
    activity = _sql_table(
        "pg_stat_activity", *(_sql_column(name) for name in (
            "pid", "datname", "application_name", "client_addr", "client_port", "backend_start", "state_change",
            "query",
        ))
    )
    a = activity.c
    client = func.coalesce(func.host(a.client_addr) + ":" + cast(a.client_port, String), "local socket")
    return (
        select(
            a.pid,
            a.application_name,
            client.label("client"),
            a.backend_start.label("connected_at"),
            a.state_change.label("last_active"),
        )
        .where(
            a.datname == func.current_database(),
            a.pid != func.pg_backend_pid(),
            a.query == literal('LISTEN "' + channel.replace('"', '""') + '"', String),
        )
        .order_by(a.backend_start, a.pid)
    )


#: Ages of finished jobs by status: what :func:`prune_finished` removes past which age.
Ages: TypeAlias = "Mapping[JobStatus | str, Duration | datetime]"


def _finished_before(
    qt: QueueTable,
    older_than: Duration | datetime | Ages,
    statuses: Sequence[JobStatus | str] | None,
    default: Sequence[JobStatus],
    limit: int,
    exclusive: bool,
) -> Select[Any]:
    if isinstance(older_than, Mapping):
        if statuses is not None:
            raise ValueError("give the statuses either as the keys of older_than or as statuses, not both")
        ages: dict[JobStatus, Duration | datetime] = {JobStatus(s): age for s, age in older_than.items()}
        wanted = list(ages)
    else:
        wanted = [JobStatus(s) for s in (default if statuses is None else statuses)]
        ages = dict.fromkeys(wanted, older_than)
    unfinished = [s for s in wanted if s not in FINISHED_STATUSES]
    if unfinished or not wanted:
        raise ValueError(
            f"only finished jobs ({', '.join(s.value for s in FINISHED_STATUSES)}) can be "
            f"removed, got {[s.value for s in wanted]}"
        )
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}")
    cutoffs: dict[Any, list[JobStatus]] = {}
    for status, age in ages.items():
        if isinstance(age, datetime):
            if age.tzinfo is None:
                raise ValueError("older_than must be timezone-aware")
            key: Any = ("at", age)
        else:
            key = ("ago", _seconds(age, "older_than"))
        cutoffs.setdefault(key, []).append(status)
    conditions: list[ColumnElement[bool]] = []
    for (kind, value), group in cutoffs.items():
        cutoff: ColumnElement[datetime] = (
            literal(value, DateTime(timezone=True)) if kind == "at" else func.now() - seconds_interval(value)
        )
        conditions.append(and_(qt.c.status.in_([status_literal(s) for s in group]), qt.c.finished_at < cutoff))
    where = [or_(*conditions) if len(conditions) > 1 else conditions[0]]
    kept = keeps_unique_key(qt.table)
    if kept is not None:
        where.append(~kept)  # "at most once, ever": a key's holder outlives any retention
    if exclusive:
        where.insert(0, select(func.pg_try_advisory_xact_lock(prune_lock_key(qt.table))).scalar_subquery())
    return select(qt.pk).where(*where).limit(limit).with_for_update(skip_locked=True)


def prune_lock_key(table: Table) -> int:
    """The advisory lock ``exclusive`` pruning takes for ``table``: a 64-bit number from
    its name, the same in every process."""
    digest = hashlib.sha1(f"sqla_queue.prune:{table.fullname}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def prune_finished(
    model: QueueModel,
    *,
    older_than: Duration | datetime | Ages,
    statuses: Sequence[JobStatus | str] | None = None,
    limit: int = 10_000,
    exclusive: bool = False,
) -> Delete:
    """Delete up to ``limit`` jobs that finished before ``older_than`` ago.

    ``statuses`` default to ``done`` and ``cancelled``: dead letters (``failed``) are
    kept unless named. ``older_than`` may instead map statuses to their own ages,
    ``{"done": timedelta(days=7), "failed": timedelta(days=90)}`` (those statuses only).
    Bounded, so a large backlog is pruned in short transactions: run it until its
    rowcount is below ``limit``. Rows another transaction holds are skipped, and only
    finished rows are touched, so it never waits for (nor blocks) a claim.

    ``exclusive=True``: the statement first takes a transaction-level advisory lock of
    the table's (:func:`prune_lock_key`, tried, never waited for) and deletes nothing when
    another pruner holds it: many workers, at most one pruning a table at a time.

    Finished jobs that still hold a unique key (:func:`keeps_unique_key`: ``done``
    under :data:`~sqla_queue.UNIQUE_EVER`) are never pruned, whatever their age.
    """
    qt = queue_table(model)
    doomed = _finished_before(qt, older_than, statuses, (DONE, CANCELLED), limit, exclusive)
    return delete(qt.table).where(_keys_of(qt, doomed))


def archive_finished(
    model: QueueModel,
    archive: Table | type[Any],
    *,
    older_than: Duration | datetime | Ages,
    statuses: Sequence[JobStatus | str] | None = None,
    limit: int = 10_000,
    exclusive: bool = False,
) -> ReturningInsert[Any]:
    """Move finished jobs into ``archive`` in one statement (``WITH moved AS (DELETE …
    RETURNING …) INSERT INTO archive SELECT … FROM moved``).

    Every column the two tables share by name is copied; see
    :func:`sqla_queue.archive_table` for a ready-made archive table. ``statuses``
    default to every finished one; ``older_than`` and ``exclusive`` are those of
    :func:`prune_finished`. Returns the ids it moved; bounded by ``limit``, so run it
    until it returns fewer. Finished jobs that still hold a unique key stay in the queue
    table (:func:`keeps_unique_key`): only there does the key keep the work from running
    again.
    """
    qt = queue_table(model)
    target: Table = archive if isinstance(archive, Table) else archive.__table__
    shared = [col.name for col in qt.table.c if col.name in target.c]
    doomed = _finished_before(qt, older_than, statuses, FINISHED_STATUSES, limit, exclusive)
    moved: CTE = (
        delete(qt.table)
        .where(qt.pk.in_(doomed.scalar_subquery()))
        .returning(*(qt.table.c[name] for name in shared))
        .cte("moved")
    )
    return (
        insert(target)
        .from_select(shared, select(*(moved.c[name] for name in shared)), include_defaults=False)
        .returning(target.c[qt.pk.name])
    )


def queue_stats(model: QueueModel) -> Select[Any]:
    """Jobs per queue and status, with the age of the oldest runnable pending job."""
    qt = queue_table(model)
    c = qt.c
    runnable = and_(_status(qt, PENDING), c.run_after <= func.now())
    return (
        select(
            c.queue,
            c.status,
            func.count().label("jobs"),
            (func.now() - func.min(c.run_after).filter(runnable)).label("oldest_runnable_age"),
        )
        .group_by(c.queue, c.status)
        .order_by(c.queue, c.status)
    )


#: The statuses :func:`queue_depth` counts unless told: each has a partial index, so the
#: count reads only their rows, however many finished jobs the table keeps.
DEPTH_STATUSES: Final = (PENDING, RUNNING)

_PG_STAT_USER_TABLES = _sql_table("pg_stat_user_tables", _sql_column("relid"), _sql_column("n_dead_tup"))


def queue_depth(
    model: QueueModel,
    *,
    statuses: Sequence[JobStatus | str] = DEPTH_STATUSES,
    regclass: str | None = None,
) -> Select[Any]:
    """Jobs per queue and status among ``statuses``, the oldest runnable job's age per
    queue (``oldest_runnable_seconds``, on the ``pending`` rows), and the table's dead
    tuples (``pg_stat_user_tables.n_dead_tup``, the same on every row): what the
    Prometheus gauges and the dashboard's overview show, in one cheap statement.

    Rows ``(queue, status, jobs, oldest_runnable_seconds, dead_tuples)``, ordered by
    queue and status; an empty table gives one row whose queue and status are NULL (its
    dead tuples still told). Each status is counted on its own, so ``pending`` and
    ``running`` read only their partial indexes' rows; ``done`` or ``failed`` read the
    whole table unless you give them an index of their own. ``regclass``: the table's
    name as PostgreSQL should look it up (default: the model's, quoted; pass the
    translated one under a ``schema_translate_map``).
    """
    qt = queue_table(model)
    c = qt.c
    if not statuses:
        raise ValueError("queue_depth needs at least one status")
    parts: list[Select[Any]] = []
    for status in dict.fromkeys(JobStatus(s) for s in statuses):
        if status is PENDING:
            oldest: ColumnElement[Any] = func.extract(
                "epoch", func.now() - func.min(c.run_after).filter(c.run_after <= func.now())
            )
        else:
            oldest = cast(null(), Float)
        parts.append(
            select(
                c.queue.label("queue"),
                status_literal(status).label("status"),
                func.count().label("jobs"),
                cast(oldest, Float).label("oldest_runnable_seconds"),
            )
            .where(_status(qt, status))
            .group_by(c.queue)
        )
    groups = (parts[0] if len(parts) == 1 else union_all(*parts)).subquery("depth")
    if regclass is None:
        preparer = _PG_PREPARER
        table = qt.table
        regclass = (f"{preparer.quote(table.schema)}.{preparer.quote(table.name)}" if table.schema
                    else preparer.quote(table.name))
    stat = _PG_STAT_USER_TABLES.c
    dead_tuples = select(stat.n_dead_tup).where(stat.relid == func.to_regclass(literal(regclass, Text)))
    dead = select(func.coalesce(dead_tuples.scalar_subquery(), 0).label("dead_tuples")).subquery("dead")
    return (
        select(groups.c.queue, groups.c.status, groups.c.jobs, groups.c.oldest_runnable_seconds, dead.c.dead_tuples)
        .select_from(dead.outerjoin(groups, true()))
        .order_by(groups.c.queue, groups.c.status)
    )


#: The longest delay a :class:`Backoff` gives (about ten years), whatever its cap: a
#: longer one could not be added to a timestamp, nor held by a ``timedelta``.
MAX_BACKOFF_SECONDS: Final = 10 * 365 * 86400.0


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff with jitter and a cap: ``base * factor**(attempt-1)``.

    The delay of attempt ``n`` is drawn uniformly from ``[d*(1-jitter), d*(1+jitter)]``
    (jitter spreads retries of jobs that failed together) and never exceeds ``cap``, nor
    :data:`MAX_BACKOFF_SECONDS` (``cap=float("inf")`` means that ceiling). Every attempt
    number gets a delay, however large.
    """

    base: float = 1.0
    factor: float = 2.0
    cap: float = 3600.0
    jitter: float = 0.1

    def __post_init__(self) -> None:
        for name in ("base", "factor", "cap", "jitter"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
                raise ValueError(f"{name} must be a number, got {value!r}")
        if self.base < 0 or self.cap < 0:
            raise ValueError("base and cap must not be negative")
        if self.factor < 1:
            raise ValueError("factor must be at least 1")
        if not 0 <= self.jitter <= 1:
            raise ValueError("jitter must be between 0 and 1")

    def bounds(self, attempt: int) -> tuple[float, float]:
        """The smallest and largest delay (seconds) attempt ``attempt`` can get."""
        ceiling = min(float(self.cap), MAX_BACKOFF_SECONDS)
        exponent = max(int(attempt) - 1, 0)
        if self.base == 0:
            raw = 0.0  # not 0 * inf
        elif exponent == 0 or self.factor == 1:
            raw = float(self.base)
        else:
            try:  # factor**exponent overflows a float for large attempts
                raw = self.base * float(self.factor) ** exponent
            except OverflowError:
                raw = math.inf
        raw = min(raw, ceiling)  # finite from here on: no inf * 0
        return min(raw * (1 - self.jitter), ceiling), min(raw * (1 + self.jitter), ceiling)

    def delay(self, attempt: int, rand: Callable[[], float] = random.random) -> timedelta:
        """The delay before retrying after attempt ``attempt`` (1-based) failed."""
        low, high = self.bounds(attempt)
        return timedelta(seconds=low + (high - low) * rand())


# -- templates: built once, the owner and tokens bound at execution ------------------------
#
# The worker runs these for every batch. Each takes its tokens as PostgreSQL arrays, so one
# SQL text serves any batch size (no parameter limit, no parse per size), and returns
# ``(pk, attempts)`` so the caller can tell exactly which attempts it moved.

#: Bound-parameter names of the templates below.
LIMIT_PARAM: Final = "sqla_queue_limit"
LEASE_PARAM: Final = "sqla_queue_lease_seconds"
ERRORS_PARAM: Final = "sqla_queue_errors"
DELAYS_PARAM: Final = "sqla_queue_delays"
SKIP_PARAM: Final = "sqla_queue_skip"
KEY_PARAM: Final = "sqla_queue_key"
ERROR_PARAM: Final = "sqla_queue_error"
FRESH_PARAM: Final = "sqla_queue_fresh_seconds"
#: A cursor claim's start (see :func:`claim_template`): the priority, ``run_after`` and key
#: of the last job claimed, in the claim's order.
AFTER_PRIORITY_PARAM: Final = "sqla_queue_after_priority"
AFTER_RUN_AFTER_PARAM: Final = "sqla_queue_after_run_after"
AFTER_KEY_PARAM: Final = "sqla_queue_after_key"
#: A cursor claim of several queues: the same, one entry per queue (arrays, in the order
#: of the queues given); a queue with no cursor yet has the priority ``HEAD_PRIORITY``.
AFTER_PRIORITIES_PARAM: Final = "sqla_queue_after_priorities"
AFTER_RUN_AFTERS_PARAM: Final = "sqla_queue_after_run_afters"
AFTER_KEYS_PARAM: Final = "sqla_queue_after_keys"
#: Above every priority a job can have (an ``INTEGER``): a cursor at it reads its queue
#: from the head.
HEAD_PRIORITY: Final = 2**31
#: The last column of :func:`complete_many_if_owner_then_claim`: true on a completed token's row.
DONE_FLAG_COLUMN: Final = "sqla_queue_done"
#: :func:`extend_unlocked_leases_if_owner`'s window (seconds back from now), or NULL.
SINCE_PARAM: Final = "sqla_queue_since_seconds"
#: The claim's timeout (seconds) of jobs without one of their own (or their task's), or NULL.
TIMEOUT_PARAM: Final = "sqla_queue_timeout_seconds"
#: A task table's claim: task names, and the timeout (seconds) of each.
TASK_NAMES_PARAM: Final = "sqla_queue_task_names"
TASK_TIMEOUTS_PARAM: Final = "sqla_queue_task_timeouts"


def _id_arrays(qt: QueueTable) -> tuple[ColumnElement[Any], ColumnElement[Any]]:
    return (
        _param(IDS_PARAM, ARRAY(qt.pk.type)),
        _param(ATTEMPTS_PARAM, ARRAY(qt.c.attempts.type)),
    )


def _token_table(
    qt: QueueTable,
    *extra: tuple[str, Any],
    arrays: tuple[ColumnElement[Any], ColumnElement[Any]] | None = None,
) -> Any:
    """``unnest(:ids, :attempts, ...) AS tokens(pk, attempt, ...)``: tokens as a relation,
    joined to the table by primary key (an index lookup per token). ``arrays``: the ids
    and attempts arrays, if not the bound ``IDS_PARAM``/``ATTEMPTS_PARAM``."""
    ids, attempts = arrays or _id_arrays(qt)
    columns: list[ColumnElement[Any]] = [ids, attempts]
    names = ["pk", "attempt"]
    for name, kind in extra:
        element_type = Text() if kind == "text" else Float()
        columns.append(_param(name, ARRAY(element_type)))
        names.append(name)
    return func.unnest(*columns).table_valued(*names).render_derived(name="tokens")


def _token_fence(
    qt: QueueTable, tokens: Any, *, owner_prefix: bool = False, ids: ColumnElement[Any] | None = None
) -> ColumnElement[bool]:
    """The guard of every post-claim transition: the job is running, under this owner,
    on this attempt (the token's). ``ids``: the array ``tokens`` was made of, if not
    ``IDS_PARAM``."""
    # ``pk = ANY(:ids)`` besides the join: it lets every plan, generic ones included, find
    # the rows by primary key rather than scan the running jobs (or a bloated index of them).
    # The status is tested as ``status || ''``, which no partial index's ``WHERE status =
    # 'running'`` is implied by: otherwise PostgreSQL prefers that small-looking index, and
    # beside a long transaction it holds the dead entries of every job that ever ran
    # (measured: a completion of 8 jobs 31 ms through it, against well under 1 ms by key).
    return and_(
        qt.pk == any_(ids if ids is not None else _id_arrays(qt)[0]),
        qt.pk == tokens.c.pk,
        qt.c.attempts == tokens.c.attempt,
        qt.c.status.op("||")(literal_column("''")) == status_literal(RUNNING),
        _owner_match(qt, owner_prefix=owner_prefix),
    )


def _before_deadline(qt: QueueTable) -> list[ColumnElement[bool]]:
    """An attempt past its deadline can no longer complete (it has timed out): the
    completion's extra guard, on a table with timeouts."""
    if not has_timeouts(qt):
        return []
    deadline = qt.c.deadline_at
    return [or_(deadline.is_(None), deadline > _clock())]


def _capped(qt: QueueTable, lease_expires_at: ColumnElement[Any]) -> ColumnElement[Any]:
    """A new lease, never past the attempt's deadline: a heartbeat cannot keep a job
    that timed out, so after a crash the sweeper ends it at its deadline."""
    if not has_timeouts(qt):
        return lease_expires_at
    return func.least(lease_expires_at, qt.c.deadline_at, type_=DateTime(timezone=True))


def _owner_match(qt: QueueTable, *, owner_prefix: bool) -> ColumnElement[bool]:
    """``lease_owner = :owner``, or with ``owner_prefix`` every owner starting with it."""
    owner = _param(OWNER_PARAM, qt.c.lease_owner.type)
    if owner_prefix:
        prefixed: ColumnElement[bool] = func.starts_with(qt.c.lease_owner, owner, type_=Boolean())
        return prefixed
    matched: ColumnElement[bool] = qt.c.lease_owner == owner
    return matched


def claim_template(
    model: QueueModel,
    *,
    queues: Sequence[str] | None = None,
    isolated: bool = False,
    skip: bool = False,
    by_key: bool = False,
    fresh: bool = False,
    after: bool = False,
) -> ReturningUpdate[Any]:
    """:func:`claim` with the owner, the limit and the lease (seconds) bound at execution:
    ``{OWNER_PARAM: owner, LIMIT_PARAM: n, LEASE_PARAM: 60.0}``.

    ``after=True`` makes it a *cursor claim*: it takes ``AFTER_PRIORITY_PARAM``,
    ``AFTER_RUN_AFTER_PARAM`` and ``AFTER_KEY_PARAM``, the last job claimed, and claims
    only jobs after it in the claim's order. Its index scan starts there, not at the head
    of the pending index, where every claimed job leaves a dead entry that only vacuum
    removes: a long transaction elsewhere (a report, ``pg_dump``) keeps them all, and a
    claim from the head reads every one. A job that sorts before the cursor (a higher
    priority, or made visible late by a long transaction) waits for the next claim from
    the head; the worker runs one periodically, and whenever a cursor claim finds nothing.
    Several queues take one cursor each: ``AFTER_PRIORITIES_PARAM``,
    ``AFTER_RUN_AFTERS_PARAM`` and ``AFTER_KEYS_PARAM``, arrays in the order of
    ``queues`` (``HEAD_PRIORITY``: that queue from its head).

    ``skip=True`` also takes ``SKIP_PARAM``, keys the claim must pass over (rows its
    UPDATE cannot change: a trigger that raises, a ``NOT VALID`` CHECK they violate);
    ``by_key=True`` claims only the row whose key is ``KEY_PARAM``, if it is claimable;
    ``fresh=True`` takes ``FRESH_PARAM`` (see :func:`still_fresh`). ``TIMEOUT_PARAM``
    (seconds, optional) and, on a task table, ``TASK_NAMES_PARAM``/``TASK_TIMEOUTS_PARAM``
    set the deadline of jobs without a ``timeout`` of their own.
    """
    qt = queue_table(model)
    extra: list[ColumnElement[bool]] = []
    if fresh:
        extra.append(still_fresh())
    if skip:
        extra.append(qt.pk != all_(_param(SKIP_PARAM, ARRAY(qt.pk.type))))
    if by_key:
        extra.append(qt.pk == _param(KEY_PARAM, qt.pk.type))
    return _claim(
        qt,
        queues,
        isolated,
        limit=_param(LIMIT_PARAM, qt.c.attempts.type),
        owner=_param(OWNER_PARAM, qt.c.lease_owner.type),
        lease=_param(LEASE_PARAM, Float()),
        extra=extra,
        after=after,
    )


def still_fresh() -> ColumnElement[bool]:
    """``FRESH_PARAM`` seconds have not passed since the transaction began: for a
    statement sent on its own (autocommit), since the server received it.

    A caller that gives up on a statement after that long (it drops the connection) may
    leave it waiting in the server, behind a lock, and running when the lock is gone:
    its answer would reach no one. A claim guarded so claims nothing then. Evaluated once
    per statement (an InitPlan), after the statement got its table locks. Not
    ``statement_timestamp()``: with the extended protocol it is taken at the Execute
    message, after a lock wait during the Parse.
    """
    elapsed = select(func.clock_timestamp() - func.transaction_timestamp()).scalar_subquery()
    return elapsed < seconds_interval(_param(FRESH_PARAM, Float()))


def claim_candidates(
    model: QueueModel, *, queues: Sequence[str] | None = None, isolated: bool = False
) -> Select[Any]:
    """The keys :func:`claim_template` would claim next, in its order, without claiming
    or locking them: ``{LIMIT_PARAM, SKIP_PARAM}``. A worker whose claim failed on a
    row it cannot update claims these one by one to find that row."""
    qt = queue_table(model)
    c = qt.c
    return (
        select(qt.pk)
        .where(
            _status(qt, PENDING),
            c.run_after <= func.now(),
            c.isolated if isolated else not_(c.isolated),
            *_queue_filter(qt, queues),
            qt.pk != all_(_param(SKIP_PARAM, ARRAY(qt.pk.type))),
        )
        .order_by(c.priority.desc(), c.run_after, qt.pk)
        .limit(_param(LIMIT_PARAM, qt.c.attempts.type))
    )


def fail_unclaimable(model: QueueModel) -> ReturningUpdate[Any]:
    """Dead-letter the pending job ``KEY_PARAM`` that no claim can take, with the reason
    ``ERROR_PARAM``; its attempts are left as they are (none ran). Returns its key, or
    nothing when the row cannot be updated this way either (or is no longer pending)."""
    qt = queue_table(model)
    return (
        qt.table.update()
        .where(qt.pk == _param(KEY_PARAM, qt.pk.type), _status(qt, PENDING))
        .values(
            status=status_literal(FAILED),
            finished_at=_clock(),
            last_error=_param(ERROR_PARAM, Text()),
        )
        .returning(qt.pk)
    )


def complete_many_if_owner(model: QueueModel) -> ReturningUpdate[Any]:
    """``done`` for every token still running under its owner and attempt:
    ``{OWNER_PARAM, IDS_PARAM, ATTEMPTS_PARAM}``; returns ``(pk, attempts)`` of each."""
    qt = queue_table(model)
    return _complete_many(qt, *_id_arrays(qt))


def _complete_many(qt: QueueTable, ids: ColumnElement[Any], attempts: ColumnElement[Any]) -> ReturningUpdate[Any]:
    tokens = _token_table(qt, arrays=(ids, attempts))
    return (
        qt.table.update()
        .where(_token_fence(qt, tokens, ids=ids), *_before_deadline(qt))
        .values(status=status_literal(DONE), finished_at=_clock(), lease_expires_at=null())
        .returning(qt.pk, tokens.c.attempt)
    )


def complete_many_if_owner_then_claim(
    model: QueueModel,
    *,
    queues: Sequence[str] | None = None,
    isolated: bool = False,
    skip: bool = False,
    fresh: bool = False,
    after: bool = False,
) -> CompoundSelect[Any]:
    """:func:`complete_many_if_owner` and :func:`claim_template` in one statement, one
    transaction: the parameters of both (one owner), and rows of every table column plus
    a last one, ``sqla_queue_done``: false for each job claimed, true for each token
    completed (its key and attempt in their columns, NULL elsewhere).

    The two updates touch disjoint rows (running ones, pending ones) and see the same
    snapshot, so neither needs the other's effect.
    """
    qt = queue_table(model)
    done = complete_many_if_owner(model).cte("sqla_queue_completed")
    claimed = claim_template(
        model, queues=queues, isolated=isolated, skip=skip, fresh=fresh, after=after
    ).cte("sqla_queue_claimed")
    done_pk, done_attempt = list(done.c)
    flag = DONE_FLAG_COLUMN
    completed_columns = [
        done_pk if column is qt.pk else done_attempt if column is qt.c.attempts else null()
        for column in qt.table.c
    ]
    return union_all(
        select(*claimed.c, false().label(flag)),
        select(*completed_columns, true().label(flag)),
    )


def retry_many_if_owner(model: QueueModel) -> ReturningUpdate[Any]:
    """Failed attempts: back to ``pending`` after each token's delay (seconds), or
    ``failed`` once ``max_attempts`` are used; ``{OWNER_PARAM, IDS_PARAM, ATTEMPTS_PARAM,
    ERRORS_PARAM, DELAYS_PARAM}``. Returns ``(pk, attempts, status)``."""
    qt = queue_table(model)
    c = qt.c
    tokens = _token_table(qt, (ERRORS_PARAM, "text"), (DELAYS_PARAM, "float"))
    exhausted = c.attempts >= c.max_attempts
    return (
        qt.table.update()
        .where(_token_fence(qt, tokens))
        .values(
            status=case((exhausted, status_literal(FAILED)), else_=status_literal(PENDING)),
            run_after=case(
                (exhausted, c.run_after),
                else_=_clock() + seconds_interval(tokens.c[DELAYS_PARAM]),
            ),
            finished_at=case((exhausted, _clock()), else_=null()),
            last_error=tokens.c[ERRORS_PARAM],
            lease_owner=case((exhausted, c.lease_owner), else_=null()),
            lease_expires_at=null(),
            isolated=false(),
        )
        .returning(qt.pk, tokens.c.attempt, c.status)
    )


def fail_many_if_owner(model: QueueModel) -> ReturningUpdate[Any]:
    """Dead-letter (``failed``) now, whatever attempts remain: ``{OWNER_PARAM, IDS_PARAM,
    ATTEMPTS_PARAM, ERRORS_PARAM}``. Returns ``(pk, attempts)``."""
    qt = queue_table(model)
    tokens = _token_table(qt, (ERRORS_PARAM, "text"))
    return (
        qt.table.update()
        .where(_token_fence(qt, tokens))
        .values(
            status=status_literal(FAILED),
            finished_at=_clock(),
            last_error=tokens.c[ERRORS_PARAM],
            lease_expires_at=null(),
        )
        .returning(qt.pk, tokens.c.attempt)
    )


def snooze_if_owner(
    model: QueueModel, *, owner: str, tokens: ClaimToken | Iterable[tuple[Any, int]], delay: Duration
) -> ReturningUpdate[Any]:
    """Run jobs again after ``delay`` without spending an attempt (a handler's
    ``Snooze``): back to ``pending``, their attempt given back. Returns ``(pk,
    attempts)``. This is :func:`snooze_many_if_owner`, the statement the worker runs,
    with the values bound (one delay for every token)."""
    seconds = _seconds(delay, "delay")
    listed = _tokens(tokens)
    with _values(_token_values(owner, listed, **{DELAYS_PARAM: [seconds] * len(listed)})):
        return snooze_many_if_owner(model)


def snooze_many_if_owner(model: QueueModel) -> ReturningUpdate[Any]:
    """Snoozed attempts: back to ``pending`` after each token's delay (seconds), the
    attempt not counted: ``max_attempts`` grows by one, so snoozing never uses up the
    attempts it allows, while ``attempts`` keeps the claim's number (the next claim's
    token is a new one); ``last_error`` is left as it was (a snooze is no failure).
    ``{OWNER_PARAM, IDS_PARAM, ATTEMPTS_PARAM, DELAYS_PARAM}``. Returns ``(pk,
    attempts)``: the token's attempt, as the other transitions."""
    qt = queue_table(model)
    c = qt.c
    tokens = _token_table(qt, (DELAYS_PARAM, "float"))
    return (
        qt.table.update()
        .where(_token_fence(qt, tokens))
        .values(
            status=status_literal(PENDING),
            run_after=_clock() + seconds_interval(tokens.c[DELAYS_PARAM]),
            max_attempts=c.max_attempts + 1,
            lease_owner=null(),
            lease_expires_at=null(),
            isolated=false(),
        )
        .returning(qt.pk, tokens.c.attempt)
    )


def _unique(qt: QueueTable) -> UniqueJobs:
    unique = unique_jobs(qt.table)
    if unique is None:
        raise EnqueueError(
            f"table {qt.table.fullname!r} has no unique key: its model needs sqla_queue.JobMixin's "
            "unique_key column (or a __queue_unique__ = UniqueJobs(...) declaration)"
        )
    return unique


def insert_unique(model: QueueModel) -> Insert:
    """``INSERT … ON CONFLICT (key) WHERE … DO NOTHING`` into the queue table: a job
    whose key is already held (in the statuses of the model's
    :class:`~sqla_queue.UniqueJobs`) is skipped, never an error, so the caller's
    transaction goes on. Add ``.values(...)`` (or execute with parameters) and, to learn
    which rows went in, ``.returning(...)``. The conflict target names the partial unique
    index by its column and predicate; a concurrent insert of the same key waits for the
    other transaction, then skips if it committed."""
    qt = queue_table(model)
    unique = _unique(qt)
    return pg_insert(qt.table).on_conflict_do_nothing(
        index_elements=[qt.c[unique.column]], index_where=unique_predicate(qt.table, unique)
    )


def unique_holder(model: QueueModel, *, key: Any) -> Select[Any]:
    """The primary key of the job holding ``key`` (in the statuses where a key is held),
    if one does: what a skipped :func:`insert_unique` was skipped for."""
    qt = queue_table(model)
    unique = _unique(qt)
    column = qt.c[unique.column]
    return select(qt.pk).where(column == bindparam("sqla_queue_unique_key", key, type_=column.type)).where(
        unique_predicate(qt.table, unique)
    )


def release_many_if_owner(
    model: QueueModel, *, refund_attempt: bool, with_errors: bool = False
) -> ReturningUpdate[Any]:
    """Back to ``pending`` at once (shutdown, a lost connection): ``{OWNER_PARAM,
    IDS_PARAM, ATTEMPTS_PARAM}``. See :func:`release_if_owner` on ``refund_attempt``.
    ``with_errors``: also ``ERRORS_PARAM``, each token's ``last_error`` (an empty text
    leaves the one the row has)."""
    qt = queue_table(model)
    c = qt.c
    tokens = _token_table(qt, (ERRORS_PARAM, "text")) if with_errors else _token_table(qt)
    values: dict[str, Any] = {
        "status": status_literal(PENDING),
        "lease_owner": null(),
        "lease_expires_at": null(),
    }
    if refund_attempt:
        values["max_attempts"] = c.max_attempts + 1
    if with_errors:
        values["last_error"] = func.coalesce(func.nullif(tokens.c[ERRORS_PARAM], ""), c.last_error)
    return (
        qt.table.update()
        .where(_token_fence(qt, tokens))
        .values(**values)
        .returning(qt.pk, tokens.c.attempt)
    )


def extend_unlocked_leases_if_owner(model: QueueModel, *, owner_prefix: bool = False) -> CompoundSelect[Any]:
    """The heartbeat: push the leases of the tokens forward, skipping rows locked by
    another transaction (a handler updating its own job row) instead of waiting for them:
    ``{OWNER_PARAM, IDS_PARAM, ATTEMPTS_PARAM, LEASE_PARAM}``. Returns ``(pk, attempts)``;
    a token missing from the result is locked or lost: ask :func:`owned_tokens`.

    ``SINCE_PARAM`` (seconds, optional): also extend every other job running under the
    owner whose lease was set (``lease_expires_at - LEASE_PARAM``) no more than that long
    ago: the jobs of a claim sent that long ago whose answer has not been read yet (an
    event loop blocked by a handler), whose tokens the caller cannot know. Served by the
    partial index on running leases, a range of recent leases, not a scan; NULL (the
    default) adds nothing. The two updates touch disjoint rows, in one statement.

    ``owner_prefix=True``: ``OWNER_PARAM`` is the start of the lease owners (a worker's
    name, ending with ``/``, whose executors each claim under a name of their own)."""
    qt = queue_table(model)
    tokens = _token_table(qt)
    name = qt.pk.name
    lockable = (
        select(qt.pk)
        .select_from(qt.table.join(tokens, qt.pk == tokens.c.pk))
        .where(_token_fence(qt, tokens, owner_prefix=owner_prefix))
        .with_for_update(skip_locked=True, of=qt.table)
        .subquery("lockable")
    )
    lease = _param(LEASE_PARAM, Float())
    extended = _capped(qt, _clock() + seconds_interval(lease))
    # The updates match their rows by key alone: the locking subqueries checked the fence
    # on the rows' newest versions, and their locks hold until the commit. A fence here
    # would let the plan scan the running jobs' index for the rows to update and rescan
    # the subquery for each (a generic plan, or statistics taken while few jobs ran, think
    # that index nearly empty): over a minute for 12,000 held jobs.
    known = (
        qt.table.update()
        .where(qt.pk == lockable.c[name])
        .values(lease_expires_at=extended)
        .returning(qt.pk, qt.c.attempts)
        .cte("sqla_queue_known")
    )
    since = _param(SINCE_PARAM, Float(), None)
    recent = (
        select(qt.pk)
        .where(
            _status(qt, RUNNING),
            _owner_match(qt, owner_prefix=owner_prefix),
            qt.c.lease_expires_at >= func.now() + seconds_interval(lease) - seconds_interval(since),
            ~select(known.c[name]).where(known.c[name] == qt.pk).exists(),
        )
        .with_for_update(skip_locked=True)
        .subquery("recent")
    )
    fresh = (
        qt.table.update()
        .where(qt.pk == recent.c[name])
        .values(lease_expires_at=extended)
        .returning(qt.pk, qt.c.attempts)
        .cte("sqla_queue_fresh")
    )
    return union_all(select(*known.c), select(*fresh.c))


def owned_tokens(model: QueueModel, *, owner_prefix: bool = False) -> Select[Any]:
    """Which tokens ``owner`` still holds, read without locking (a row another transaction
    has locked reads as last committed): ``{OWNER_PARAM, IDS_PARAM, ATTEMPTS_PARAM}``.
    ``owner_prefix``: as for :func:`extend_unlocked_leases_if_owner`."""
    qt = queue_table(model)
    tokens = _token_table(qt)
    fence = _token_fence(qt, tokens, owner_prefix=owner_prefix)
    return select(qt.pk, qt.c.attempts).select_from(qt.table).join(tokens, fence)


def release_lost_claims(model: QueueModel) -> ReturningUpdate[Any]:
    """Back to ``pending``, attempt not counted, every job running under ``OWNER_PARAM``
    except the tokens ``IDS_PARAM``/``ATTEMPTS_PARAM``: ``{OWNER_PARAM, IDS_PARAM,
    ATTEMPTS_PARAM, FRESH_PARAM}`` (it releases nothing once :func:`still_fresh` is
    false). Returns ``(pk, attempts)``.

    For a claimer whose claim committed but whose answer was lost with its connection:
    the rows it took are running under its name, yet it never saw them, so their
    handlers never started and their attempts must not count. This is safe only for an
    owner name that exactly one claimer uses, one claim at a time, and that passes every
    token it did receive and may still hold: then every other row under that name is one
    of the lost claims' (a row kept on another attempt was claimed again by them).
    ``max_attempts`` grows by one and ``attempts`` keeps the lost claim's number, so no
    later claim hands out that token again.
    """
    qt = queue_table(model)
    c = qt.c
    ids = _param(IDS_PARAM, ARRAY(qt.pk.type))
    attempts = _param(ATTEMPTS_PARAM, ARRAY(c.attempts.type))
    kept_attempt = func.coalesce(Grouping(attempts)[func.array_position(ids, qt.pk)], -1)
    return (
        qt.table.update()
        .where(
            _status(qt, RUNNING),
            c.lease_owner == _param(OWNER_PARAM, c.lease_owner.type),
            c.attempts != kept_attempt,
            still_fresh(),
        )
        .values(
            status=status_literal(PENDING),
            lease_owner=null(),
            lease_expires_at=null(),
            max_attempts=c.max_attempts + 1,
        )
        .returning(qt.pk, c.attempts)
    )


def token_states(model: QueueModel) -> Select[Any]:
    """``(pk, attempts, status, lease_owner, isolated, last_error)`` of the jobs
    ``IDS_PARAM``, read without locking: what a worker reads when a statement's answer
    was lost with its connection, to tell whether that statement had landed."""
    qt = queue_table(model)
    c = qt.c
    return select(qt.pk, c.attempts, c.status, c.lease_owner, c.isolated, c.last_error).where(
        qt.pk == any_(_param(IDS_PARAM, ARRAY(qt.pk.type)))
    )


#: How far back :func:`next_run_after` looks for a job that fell due just now.
RECENTLY_DUE_SECONDS: Final = 1.0


def next_run_after(model: QueueModel, *, queues: Sequence[str] | None = None) -> Select[Any]:
    """When the next delayed job (or retry) of ``queues`` falls due, as seconds from now
    (NULL when none waits; zero or less when one is due already): lets an idle worker
    wake at that time, not at its next poll.

    Jobs that fell due in the last :data:`RECENTLY_DUE_SECONDS` count too: one that fell
    due between a worker's empty claim and this query is in neither answer otherwise,
    and would wait for the poll. Isolated jobs count only ahead, since a worker whose
    isolated slot is taken cannot claim them.
    """
    qt = queue_table(model)
    c = qt.c
    now = func.now()
    soonest = (
        select(c.run_after)
        .where(
            _status(qt, PENDING),
            c.run_after > now - seconds_interval(RECENTLY_DUE_SECONDS),
            func.isfinite(c.run_after),  # 'infinity' never falls due (and cannot be subtracted)
            or_(c.run_after > now, not_(c.isolated)),
            *_queue_filter(qt, queues),
            *_kind_filter(qt),
        )
        .order_by(c.run_after)
        .limit(1)
        .scalar_subquery()
    )
    return select(func.extract("epoch", soonest - now))


# -- periodic jobs: the watermark of each schedule ------------------------------------------

#: Bound-parameter names of :func:`schedule_tick_template`.
SCHEDULE_PARAM: Final = "sqla_queue_schedule"
TICK_PARAM: Final = "sqla_queue_tick"


def schedule_tick_template(model: QueueModel) -> ReturningInsert[Any]:
    """Claim a schedule's tick: ``{SCHEDULE_PARAM: name, TICK_PARAM: tick}``.

    ``INSERT INTO <table>_schedules (name, last_tick) VALUES (:name, :tick) ON CONFLICT
    (name) DO UPDATE SET last_tick = :tick, previous_tick = <the old last_tick> WHERE
    last_tick < :tick RETURNING previous_tick``: one row when this call moved the
    watermark forward (``previous_tick`` is where it stood, NULL for a schedule seen for
    the first time), none when the tick was claimed already. Run it in the transaction
    that inserts the tick's jobs: a concurrent claim of the same tick waits for that
    transaction's row lock, then matches nothing if it committed (and claims the tick
    itself if it rolled back), so a tick is claimed if and only if its jobs exist.
    The graphile-worker design: no leader, one small row per schedule.
    """
    table = schedules_table(model)
    tick = _param(TICK_PARAM, DateTime(timezone=True))
    stmt = pg_insert(table).values(name=_param(SCHEDULE_PARAM, table.c.name.type), last_tick=tick)
    return stmt.on_conflict_do_update(
        index_elements=[table.c.name],
        set_={
            "last_tick": stmt.excluded.last_tick,
            "previous_tick": table.c.last_tick,
            "updated_at": _clock(),
        },
        where=table.c.last_tick < stmt.excluded.last_tick,
    ).returning(table.c.previous_tick)


def claim_schedule_tick(model: QueueModel, *, schedule: str, tick: datetime) -> ReturningInsert[Any]:
    """:func:`schedule_tick_template` with the schedule's name and the tick (an aware
    datetime) bound: returns ``previous_tick`` if this call claimed the tick, no row if
    it was claimed already."""
    if not isinstance(tick, datetime) or tick.tzinfo is None or tick.utcoffset() is None:
        raise ValueError(f"tick must be a timezone-aware datetime, got {tick!r}")
    with _values({SCHEDULE_PARAM: schedule, TICK_PARAM: tick}):
        return schedule_tick_template(model)


def schedule_states(model: QueueModel) -> Select[Any]:
    """``(name, last_tick, previous_tick, updated_at)`` of every schedule row of the
    queue table, by name: what ``sqla-queue schedules`` shows. A row whose schedule was
    removed from the code stays, harmless (nothing reads it but this)."""
    table = schedules_table(model)
    c = table.c
    return select(c.name, c.last_tick, c.previous_tick, c.updated_at).order_by(c.name)
