"""Leases: the heartbeat's extension, the tokens an owner still holds, the release of claims
whose answer was lost, the sweep of expired leases (and the solitary rule it writes), and
when the next delayed job falls due.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Final

from sqlalchemy import (
    CompoundSelect,
    DateTime,
    Float,
    Numeric,
    Select,
    String,
    and_,
    any_,
    case,
    cast,
    func,
    literal,
    not_,
    null,
    or_,
    select,
    true,
    union_all,
)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.sql.dml import ReturningUpdate
from sqlalchemy.sql.elements import ColumnElement, Grouping

from ..model import ClaimToken, QueueTable, queue_table, status_literal
from ._base import (
    ATTEMPTS_PARAM,
    FAILED,
    IDS_PARAM,
    LEASE_PARAM,
    OWNER_PARAM,
    PENDING,
    PROGRESS_PARAM,
    RUNNING,
    SINCE_PARAM,
    Duration,
    QueueModel,
    _clock,
    _keys_of,
    _kind_filter,
    _owner_match,
    _param,
    _queue_filter,
    _queue_names,
    _seconds,
    _status,
    _token_fence,
    _token_table,
    _token_values,
    _values,
    has_timeouts,
    seconds_interval,
    still_fresh,
)
from ._finish import Finishing, finished
from ._flow import unpaused
from ._history import history_values
from ._limits import next_free_start
from ._results import progress_extra, progress_values
from ._sessions import lease_over
from ._workflows import edges_cleared


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


def sweep_expired(
    model: QueueModel, *, limit: int = 1000, lease: Duration | None = None, heartbeat: Duration | None = None
) -> Finishing:
    """Return jobs whose lease expired to ``pending`` (or ``failed`` when exhausted).

    Their worker stopped heartbeating: it died, froze or lost the database. With
    ``lease`` and ``heartbeat`` (the workers' settings), also the jobs of a worker whose
    session ended (it died: see :func:`~sqla_queue.sql._sessions.lease_over`) once
    their lease missed 1.5 heartbeats, before it expires; they count as expired. The job is
    marked ``isolated`` so its next attempt runs alone in its batch, and ``last_error``
    says why; a job that was isolated already gets :data:`SOLITARY_REASON` there, and
    the worker then runs it alone in the whole worker (see :func:`is_solitary`).
    Safe to run from many workers at once: rows another sweeper holds are skipped.
    Returns ``(pk, status, queue, attempts)`` of every job it moved, and ``task`` last on
    a task table. A job it dead-letters is finished like any other (see
    :func:`~sqla_queue.sql._finish.finished`).
    """
    if limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}")
    if (lease is None) != (heartbeat is None):
        raise ValueError("give both lease and heartbeat, or neither")
    qt = queue_table(model)
    c = qt.c
    over = lease_over(
        qt,
        lease=None if lease is None else _seconds(lease, "lease"),
        heartbeat=None if heartbeat is None else _seconds(heartbeat, "heartbeat"),
    )
    expired = (
        select(qt.pk)
        .where(_status(qt, RUNNING), over)
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
    ended: ColumnElement[Any] = literal("lost", String)
    if has_timeouts(qt):
        ended = case((timed_out, literal("timed out", String)), else_=ended)
    status = case((exhausted, status_literal(FAILED)), else_=status_literal(PENDING))
    shown = [qt.pk, c.status, c.queue, c.attempts, *([c.task] if qt.is_task_table else [])]
    update = (
        qt.table.update()
        .where(_keys_of(qt, expired))
        .values(
            status=status,
            finished_at=case((exhausted, _clock()), else_=null()),
            last_error=reason,
            lease_owner=null(),
            lease_expires_at=null(),
            isolated=isolated,
            **history_values(qt, ended, reason),
            **edges_cleared(qt, status),
        )
        .returning(*shown)
    )
    return finished(qt, update, failed_only=True)


def _seconds_text(interval: ColumnElement[Any]) -> ColumnElement[str]:
    """An interval as seconds, ``30`` or ``0.5``: as :func:`sqla_queue.current.timeout_text` writes them."""
    rounded = cast(func.round(cast(func.extract("epoch", interval), Numeric()), 3), String)
    return func.coalesce(func.rtrim(func.rtrim(rounded, "0"), "."), "?")


def _capped(qt: QueueTable, lease_expires_at: ColumnElement[Any]) -> ColumnElement[Any]:
    """A new lease, never past the attempt's deadline: a heartbeat cannot keep a job
    that timed out, so after a crash the sweeper ends it at its deadline."""
    if not has_timeouts(qt):
        return lease_expires_at
    return func.least(lease_expires_at, qt.c.deadline_at, type_=DateTime(timezone=True))


def extend_unlocked_leases_if_owner(model: QueueModel, *, owner_prefix: bool = False) -> CompoundSelect[Any]:
    """The heartbeat: push the leases of the tokens forward, skipping rows locked by
    another transaction (a handler updating its own job row) instead of waiting for them:
    ``{OWNER_PARAM, IDS_PARAM, ATTEMPTS_PARAM, LEASE_PARAM}``. Returns ``(pk, attempts)``;
    a token missing from the result is locked or lost: ask :func:`owned_tokens`. On a
    table that keeps progress, ``PROGRESS_PARAM`` (optional) gives each token's, written
    with its lease.

    ``SINCE_PARAM`` (seconds, optional): also extend every other job running under the
    owner whose lease was set (``lease_expires_at - LEASE_PARAM``) no more than that long
    ago: the jobs of a claim sent that long ago whose answer has not been read yet (an
    event loop blocked by a handler), whose tokens the caller cannot know. Served by the
    partial index on running leases, a range of recent leases, not a scan; NULL (the
    default) adds nothing. The two updates touch disjoint rows, in one statement.

    ``owner_prefix=True``: ``OWNER_PARAM`` is the start of the lease owners (a worker's
    name, ending with ``/``, whose executors each claim under a name of their own)."""
    qt = queue_table(model)
    extra = progress_extra(qt)
    tokens = _token_table(qt, *extra)
    name = qt.pk.name
    lockable = (
        select(qt.pk, *(tokens.c[PROGRESS_PARAM] for _ in extra))
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
        .values(lease_expires_at=extended, **progress_values(qt, lockable.c[PROGRESS_PARAM] if extra else None))
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
            *unpaused(qt, _queue_names(queues)),
            *_kind_filter(qt),
        )
        .order_by(c.run_after)
        .limit(1)
        .scalar_subquery()
    )
    free = next_free_start(qt, _queue_names(queues))
    due: ColumnElement[Any] = soonest
    if free is not None:  # LEAST ignores NULL: whichever comes first
        due = func.least(soonest, free, type_=c.run_after.type)
    return select(func.extract("epoch", due - now))
