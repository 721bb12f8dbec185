"""What every statement module shares: the type aliases and statuses, durations as seconds and
the clock, the bound-parameter names of the worker's statements (and how a single call fills
them in: :func:`_param`), the queue and kind filters, the one fence of every transition
after a claim (:func:`_token_fence`), and the freshness guard of the claim and of the
release of lost claims (:func:`still_fresh`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import datetime, timedelta
from types import MappingProxyType
from typing import Any, Final, TypeAlias

from sqlalchemy import (
    Boolean,
    DateTime,
    Float,
    Interval,
    Select,
    Text,
    and_,
    any_,
    bindparam,
    cast,
    false,
    func,
    inspect,
    literal,
    literal_column,
    select,
    type_coerce,
)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.sql.elements import BindParameter, ColumnElement

from ..model import TIMEOUT_COLUMNS, ClaimToken, JobStatus, QueueTable, queue_table, status_literal

#: A queue model class or its Table.
QueueModel: TypeAlias = Any
Duration: TypeAlias = "timedelta | float"


PENDING = JobStatus.PENDING
RUNNING = JobStatus.RUNNING
DONE = JobStatus.DONE
FAILED = JobStatus.FAILED
CANCELLED = JobStatus.CANCELLED


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


def has_timeouts(model: QueueModel) -> bool:
    """Whether the table has the columns of timeouts (``timeout``, ``started_at``,
    ``deadline_at``): every :class:`~sqla_queue.JobMixin` model does."""
    qt = model if isinstance(model, QueueTable) else queue_table(model)
    return all(name in qt.c for name in TIMEOUT_COLUMNS)


def _token_values(owner: str, tokens: ClaimToken | Iterable[tuple[Any, int]], **values: Any) -> dict[str, Any]:
    """The bound values of a token statement, for the single-call conveniences."""
    listed = _tokens(tokens)
    return {OWNER_PARAM: owner, IDS_PARAM: [t[0] for t in listed], ATTEMPTS_PARAM: [t[1] for t in listed], **values}


#: Bound-parameter names of the token statements (see the templates' parameters below).
OWNER_PARAM: Final = "sqla_queue_owner"
#: The NOTIFY channel a statement wakes the workers on, when it releases jobs of its own
#: accord (a workflow's children): bound to the declared table's channel, and given by the
#: worker as its own (under the engine's ``schema_translate_map``).
CHANNEL_PARAM: Final = "sqla_queue_channel"
IDS_PARAM: Final = "sqla_queue_ids"
ATTEMPTS_PARAM: Final = "sqla_queue_attempts"
JOB_PARAM: Final = "sqla_queue_job"
ATTEMPT_PARAM: Final = "sqla_queue_attempt"
#: The completion's results on a table that keeps them: JSON texts (or NULLs), one per
#: token (``RESULT_PARAM``: the one of a single token).
RESULTS_PARAM: Final = "sqla_queue_results"
RESULT_PARAM: Final = "sqla_queue_result"
#: Each token's progress as JSON text, NULL for unchanged, on a table that keeps progress
#: (optional: unbound, no token's changes); ``ONE_PROGRESS_PARAM``: a single token's.
PROGRESS_PARAM: Final = "sqla_queue_progress"
ONE_PROGRESS_PARAM: Final = "sqla_queue_one_progress"


# -- templates: built once, the owner and tokens bound at execution ------------------------
#
# The worker runs the templates (claim_template, complete_many_if_owner, … in the modules
# of each stage) for every batch. Each takes its tokens as PostgreSQL arrays, so one SQL
# text serves any batch size (no parameter limit, no parse per size), and returns
# ``(pk, attempts)`` so the caller can tell exactly which attempts it moved.

#: Bound-parameter names of the templates.
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
    *extra: tuple[Any, ...],
    arrays: tuple[ColumnElement[Any], ...] | None = None,
) -> Any:
    """``unnest(:ids, :attempts, ...) AS tokens(pk, attempt, ...)``: tokens as a relation,
    joined to the table by primary key (an index lookup per token). ``arrays``: the ids
    and attempts arrays, if not the bound ``IDS_PARAM``/``ATTEMPTS_PARAM``, and then the
    array of each ``extra`` column too."""
    ids, attempts, *given = arrays or _id_arrays(qt)
    columns: list[ColumnElement[Any]] = [ids, attempts]
    names = ["pk", "attempt"]
    for n, (name, kind, *optional) in enumerate(extra):
        element_type = Text() if kind == "text" else Float()
        # An optional array left unbound is NULL, which unnest pads with NULLs.
        column = given[n] if given else _param(name, ARRAY(element_type), *([None] if optional else []))
        columns.append(column)
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


def _owner_match(qt: QueueTable, *, owner_prefix: bool) -> ColumnElement[bool]:
    """``lease_owner = :owner``, or with ``owner_prefix`` every owner starting with it."""
    owner = _param(OWNER_PARAM, qt.c.lease_owner.type)
    if owner_prefix:
        prefixed: ColumnElement[bool] = func.starts_with(qt.c.lease_owner, owner, type_=Boolean())
        return prefixed
    matched: ColumnElement[bool] = qt.c.lease_owner == owner
    return matched


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


# -- periodic jobs: the watermark of each schedule ------------------------------------------

#: Bound-parameter names of :func:`schedule_tick_template`.
SCHEDULE_PARAM: Final = "sqla_queue_schedule"
TICK_PARAM: Final = "sqla_queue_tick"
