"""The claim: :func:`claim` and the worker's :func:`claim_template` (from the head of the pending
index, or a cursor claim after a key), and the way round a row no claim can update
(:func:`claim_candidates`, :func:`fail_unclaimable`).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any, Final

from sqlalchemy import (
    BigInteger,
    DateTime,
    Float,
    Select,
    Text,
    all_,
    func,
    literal_column,
    not_,
    select,
    true,
    tuple_,
    union_all,
)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.sql.dml import ReturningUpdate
from sqlalchemy.sql.elements import ColumnElement, Grouping

from ..model import QueueTable, flow_rules, queue_table, status_literal
from ._base import (
    AFTER_KEY_PARAM,
    AFTER_KEYS_PARAM,
    AFTER_PRIORITIES_PARAM,
    AFTER_PRIORITY_PARAM,
    AFTER_RUN_AFTER_PARAM,
    AFTER_RUN_AFTERS_PARAM,
    ERROR_PARAM,
    FAILED,
    KEY_PARAM,
    LEASE_PARAM,
    LIMIT_PARAM,
    OWNER_PARAM,
    PENDING,
    RUNNING,
    SKIP_PARAM,
    TASK_NAMES_PARAM,
    TASK_TIMEOUTS_PARAM,
    TIMEOUT_PARAM,
    Duration,
    QueueModel,
    _clock,
    _keys_of,
    _kind_filter,
    _param,
    _queue_array,
    _queue_filter,
    _queue_names,
    _seconds,
    _status,
    _values,
    has_timeouts,
    seconds_interval,
    still_fresh,
)
from ._flow import unpaused
from ._limits import claimable_within_limits


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
    rules = flow_rules(qt.table)
    if rules and after:
        raise ValueError("a table with __queue_flow__ rules is claimed from the head: after=True does not apply")
    if rules:
        claimable = claimable_within_limits(qt, conditions, order, limit, names, rules)
    elif after and names is not None and len(names) > 1:
        claimable = _claimable_after_each_queue(qt, conditions, order, limit, names)
    elif after:
        claimable = _claimable_after(qt, [*conditions, *_queue_filter(qt, names), *unpaused(qt, names)], order, limit)
    elif names is None or len(names) == 1:
        claimable = (
            select(qt.pk)
            .where(*conditions, *_queue_filter(qt, names), *unpaused(qt, names))
            .order_by(*order)
            .limit(limit)
            .with_for_update(skip_locked=True)
        )
    else:
        served = func.unnest(_queue_array(qt, names)).table_valued("name").render_derived(name="served")
        per_queue = (
            select(qt.pk, c.priority, c.run_after)
            .where(*conditions, c.queue == served.c.name, *unpaused(qt, served=served.c.name))
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
        .where(*conditions, c.queue == served.c.name, *unpaused(qt, served=served.c.name), *where)
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
            *unpaused(qt, _queue_names(queues)),
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
