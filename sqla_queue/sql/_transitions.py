"""The transitions of a claimed job, each behind the fence: complete, retry, fail, release,
snooze (the worker's statements over token arrays, and the single calls that bind them), the
completion and next claim of the executor's cycle in one statement; and cancel.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import (
    CompoundSelect,
    String,
    Text,
    case,
    false,
    func,
    literal,
    null,
    or_,
    select,
    true,
    union_all,
)
from sqlalchemy.dialects.postgresql import ARRAY, array
from sqlalchemy.sql.dml import ReturningUpdate
from sqlalchemy.sql.elements import ColumnElement

from ..model import ClaimToken, QueueTable, queue_table, result_column, status_literal
from ._base import (
    ATTEMPT_PARAM,
    DELAYS_PARAM,
    DONE,
    DONE_FLAG_COLUMN,
    ERRORS_PARAM,
    FAILED,
    JOB_PARAM,
    ONE_PROGRESS_PARAM,
    PENDING,
    RESULT_PARAM,
    RESULTS_PARAM,
    Duration,
    QueueModel,
    _clock,
    _id_arrays,
    _param,
    _seconds,
    _token_fence,
    _token_table,
    _token_values,
    _tokens,
    _values,
    has_timeouts,
    seconds_interval,
)
from ._claim import claim_template
from ._finish import Finishing, finished
from ._history import history_values
from ._results import _progress_of, _stored_result, progress_extra, result_encoder
from ._workflows import children_taken, edges_cleared


def complete_if_owner(
    model: QueueModel,
    *,
    owner: str,
    tokens: ClaimToken | Iterable[tuple[Any, int]],
    results: Sequence[Any] | None = None,
) -> Finishing:
    """Mark jobs ``done`` if ``owner`` still holds their current attempt.

    Run it in the handler's own transaction to make the handler's writes and the
    completion one atomic step: if it returns no row, roll back. Returns ``(pk,
    attempts)`` of each job it completed. On a table that keeps results
    (:class:`~sqla_queue.ResultMixin`), ``results`` gives each token's (None: no result),
    checked as the worker checks a handler's return value. This is
    :func:`complete_many_if_owner`, the statement the worker runs, with the values bound.
    """
    listed = _tokens(tokens)
    values = _token_values(owner, listed)
    qt = queue_table(model)
    column = result_column(qt.table)
    if column is not None:
        given = [None] * len(listed) if results is None else list(results)
        if len(given) != len(listed):
            raise ValueError(f"results must give one value per token: {len(listed)} tokens, {len(given)} results")
        encode = result_encoder(column)
        values[RESULTS_PARAM] = [encode(value) for value in given]
    elif results is not None:
        raise TypeError(f"table {qt.table.name!r} keeps no results (its model has no __queue_result__)")
    with _values(values):
        return complete_many_if_owner(model)


def complete_template(model: QueueModel, *, single: bool = False) -> Finishing:
    """:func:`complete_many_if_owner` (kept under this name): the owner and tokens bound
    at execution, ``{OWNER_PARAM: owner, IDS_PARAM: [id1, ...], ATTEMPTS_PARAM:
    [attempt1, ...]}``; ``single=True`` takes one token as ``{JOB_PARAM: job_id,
    ATTEMPT_PARAM: attempt}`` instead (and, on a table that keeps results, its result's
    JSON text as ``RESULT_PARAM``). The same statement, fence and effect."""
    if not single:
        return complete_many_if_owner(model)
    qt = queue_table(model)
    ids = array([_param(JOB_PARAM, qt.pk.type)])
    attempts = array([_param(ATTEMPT_PARAM, qt.c.attempts.type)])
    results = array([_param(RESULT_PARAM, Text(), None)]) if result_column(qt.table) is not None else None
    progress = array([_param(ONE_PROGRESS_PARAM, Text(), None)]) if progress_extra(qt) else None
    return _complete_many(qt, ids, attempts, results, progress)


def retry_if_owner(
    model: QueueModel, *, owner: str, token: ClaimToken | tuple[Any, int], error: str, delay: Duration
) -> Finishing:
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
) -> Finishing:
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


def _before_deadline(qt: QueueTable) -> list[ColumnElement[bool]]:
    """An attempt past its deadline can no longer complete (it has timed out): the
    completion's extra guard, on a table with timeouts."""
    if not has_timeouts(qt):
        return []
    deadline = qt.c.deadline_at
    return [or_(deadline.is_(None), deadline > _clock())]


def complete_many_if_owner(model: QueueModel) -> Finishing:
    """``done`` for every token still running under its owner and attempt:
    ``{OWNER_PARAM, IDS_PARAM, ATTEMPTS_PARAM}``, and on a table that keeps results
    ``RESULTS_PARAM`` (each token's result as JSON text, or NULL); returns ``(pk,
    attempts)`` of each. On a table with workflows, a last column: the children each
    job kept to count, held by another transaction then (NULL: none), for
    :func:`~sqla_queue.sql.settle_edges` after the commit; so with
    :func:`retry_many_if_owner` and :func:`fail_many_if_owner`."""
    qt = queue_table(model)
    return _complete_many(qt, *_id_arrays(qt))


def _complete_many(
    qt: QueueTable, ids: ColumnElement[Any], attempts: ColumnElement[Any], results: ColumnElement[Any] | None = None,
    progress: ColumnElement[Any] | None = None,
) -> Finishing:
    values: dict[str, Any] = {"status": status_literal(DONE), "finished_at": _clock(), "lease_expires_at": null()}
    column = result_column(qt.table)
    extra: list[tuple[Any, ...]] = []
    arrays = [ids, attempts]
    if column is not None:
        extra.append((RESULTS_PARAM, "text"))
        arrays.append(results if results is not None else _param(RESULTS_PARAM, ARRAY(Text())))
    for name, kind, optional in progress_extra(qt):
        extra.append((name, kind, optional))
        arrays.append(progress if progress is not None else _param(name, ARRAY(Text()), None))
    tokens = _token_table(qt, *extra, arrays=tuple(arrays))
    if column is not None:
        values[column.key] = _stored_result(column, tokens.c[RESULTS_PARAM])
    values.update(_progress_of(qt, tokens))
    values.update(history_values(qt, "done"))
    taken = children_taken(qt, ids)
    values.update(edges_cleared(qt, status_literal(DONE), taken))
    update = (
        qt.table.update()
        .where(_token_fence(qt, tokens, ids=ids), *_before_deadline(qt))
        .values(**values)
        .returning(qt.pk, tokens.c.attempt)
    )
    return finished(qt, update, taken=taken)


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
    completed (its key and attempt in their columns, on a table with workflows the
    children it kept in ``child_ids``, NULL elsewhere).

    The two updates touch disjoint rows (running ones, pending ones) and see the same
    snapshot, so neither needs the other's effect.
    """
    qt = queue_table(model)
    done = complete_many_if_owner(model).cte("sqla_queue_completed")
    claimed = claim_template(
        model, queues=queues, isolated=isolated, skip=skip, fresh=fresh, after=after
    ).cte("sqla_queue_claimed")
    done_pk, done_attempt, *done_kept = list(done.c)
    flag = DONE_FLAG_COLUMN
    # A completed token's row: its key and attempt, and on a table with workflows the
    # children it kept to count (see complete_many_if_owner) in child_ids; NULL elsewhere.
    given = {id(qt.pk): done_pk, id(qt.c.attempts): done_attempt}
    if done_kept:
        given[id(qt.c.child_ids)] = done_kept[0]
    completed_columns = [given.get(id(column), null()) for column in qt.table.c]
    return union_all(
        select(*claimed.c, false().label(flag)),
        select(*completed_columns, true().label(flag)),
    )


def retry_many_if_owner(model: QueueModel) -> Finishing:
    """Failed attempts: back to ``pending`` after each token's delay (seconds), or
    ``failed`` once ``max_attempts`` are used; ``{OWNER_PARAM, IDS_PARAM, ATTEMPTS_PARAM,
    ERRORS_PARAM, DELAYS_PARAM}``. Returns ``(pk, attempts, status)``."""
    qt = queue_table(model)
    c = qt.c
    tokens = _token_table(qt, (ERRORS_PARAM, "text"), (DELAYS_PARAM, "float"), *progress_extra(qt))
    exhausted = c.attempts >= c.max_attempts
    status = case((exhausted, status_literal(FAILED)), else_=status_literal(PENDING))
    taken = children_taken(qt, _id_arrays(qt)[0])
    update = (
        qt.table.update()
        .where(_token_fence(qt, tokens))
        .values(
            status=status,
            run_after=case(
                (exhausted, c.run_after),
                else_=_clock() + seconds_interval(tokens.c[DELAYS_PARAM]),
            ),
            finished_at=case((exhausted, _clock()), else_=null()),
            last_error=tokens.c[ERRORS_PARAM],
            lease_owner=case((exhausted, c.lease_owner), else_=null()),
            lease_expires_at=null(),
            isolated=false(),
            **_progress_of(qt, tokens),
            **history_values(qt, _retried(tokens.c[ERRORS_PARAM], exhausted), tokens.c[ERRORS_PARAM]),
            **edges_cleared(qt, status, taken),
        )
        .returning(qt.pk, tokens.c.attempt, c.status)
    )
    return finished(qt, update, failed_only=True, taken=taken)


def fail_many_if_owner(model: QueueModel) -> Finishing:
    """Dead-letter (``failed``) now, whatever attempts remain: ``{OWNER_PARAM, IDS_PARAM,
    ATTEMPTS_PARAM, ERRORS_PARAM}``. Returns ``(pk, attempts)``."""
    qt = queue_table(model)
    tokens = _token_table(qt, (ERRORS_PARAM, "text"), *progress_extra(qt))
    taken = children_taken(qt, _id_arrays(qt)[0])
    update = (
        qt.table.update()
        .where(_token_fence(qt, tokens))
        .values(
            status=status_literal(FAILED),
            finished_at=_clock(),
            last_error=tokens.c[ERRORS_PARAM],
            lease_expires_at=null(),
            **_progress_of(qt, tokens),
            **history_values(qt, "failed", tokens.c[ERRORS_PARAM]),
            **edges_cleared(qt, status_literal(FAILED), taken),
        )
        .returning(qt.pk, tokens.c.attempt)
    )
    return finished(qt, update, taken=taken)


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
    tokens = _token_table(qt, (DELAYS_PARAM, "float"), *progress_extra(qt))
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
            **_progress_of(qt, tokens),
            **history_values(qt, "snoozed"),
        )
        .returning(qt.pk, tokens.c.attempt)
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
    extra = ((ERRORS_PARAM, "text"),) if with_errors else ()
    tokens = _token_table(qt, *extra, *progress_extra(qt))
    values: dict[str, Any] = {
        "status": status_literal(PENDING),
        "lease_owner": null(),
        "lease_expires_at": null(),
        **_progress_of(qt, tokens),
        **history_values(qt, "released", func.nullif(tokens.c[ERRORS_PARAM], "") if with_errors else None),
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



def _retried(error: ColumnElement[Any], exhausted: ColumnElement[bool]) -> ColumnElement[Any]:
    """How a failed attempt ended, for its history: ``timed out`` (the worker's timeout
    text), else ``failed`` once the attempts are used up, else ``retried``."""
    return case(
        (error.startswith("timed out after "), literal("timed out", String())),
        (exhausted, literal("failed", String())),
        else_=literal("retried", String()),
    )
