"""The claim under flow rules (``__queue_flow__``): full keys passed over, a sequence's
head only, candidates ranked within their key against each limit, fair claims that go
round the keys, and the advisory lock claims take turns on; with what ``sqla-queue
stats`` shows of each rule.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any, Final, cast

from sqlalchemy import (
    BigInteger,
    Select,
    Subquery,
    Table,
    any_,
    case,
    exists,
    func,
    literal,
    or_,
    select,
    true,
    tuple_,
    union_all,
)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.sql.elements import ColumnElement

from ..flow import declared_queues_table
from ..model import QueueTable, flow_rules, notify_channel, queue_table, status_literal
from ..rules import Concurrency, FlowRule, InOrder, RateLimit
from ._base import FAILED, PENDING, RUNNING, QueueModel, _clock, _queue_array, _queue_filter, seconds_interval
from ._flow import unpaused

#: How many candidates per job asked for a claim under concurrency rules reads: rows of a
#: key already at its limit are passed over in the scan, but several candidates of one
#: key can still fill a batch of which only the first fits.
CANDIDATES_PER_JOB: Final = 4


def flow_lock_key(table: Table, schema_translate_map: Mapping[str | None, str | None] | None = None) -> int:
    """The transaction-level advisory lock a claim of ``table`` (a table with flow rules)
    takes before it claims: a 64-bit number from the table's channel name, so the same in
    every process, and one per schema a ``schema_translate_map`` puts the table in."""
    digest = hashlib.sha1(f"sqla_queue.flow:{notify_channel(table, schema_translate_map)}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def flow_lock(
    model: QueueModel, *, schema_translate_map: Mapping[str | None, str | None] | None = None
) -> Select[Any]:
    """``SELECT pg_advisory_xact_lock(<the table's flow lock>)``: run it first in the
    transaction of a claim of a table with ``__queue_flow__`` rules, as the worker does,
    then the claim, then commit. Claims that take turns this way each count the running
    jobs every earlier claim committed, which is what makes the limits strict."""
    table = queue_table(model).table
    return select(func.pg_advisory_xact_lock(literal(flow_lock_key(table, schema_translate_map), BigInteger())))


def limit_of(
    qt: QueueTable, rule: Concurrency | RateLimit, key: ColumnElement[Any] | None
) -> ColumnElement[int] | int:
    """``rule``'s limit for the key ``key`` (a column of the row it is for): the model's,
    or, for a rule on the queue (``key="queue"``) of a table with a queues table, the
    queue's own limit where one is set at run time (its ``concurrency`` or ``rate``), read
    by primary key."""
    table = declared_queues_table(qt.table)
    if table is None or rule.key != "queue" or key is None:
        return rule.limit
    own = table.c.concurrency if isinstance(rule, Concurrency) else table.c.rate
    # Correlated explicitly: the key may be a column of a subquery the FROM list lacks.
    set_here = select(own).where(table.c.queue == key).correlate_except(table).scalar_subquery()
    return func.coalesce(set_here, rule.limit)


def _window_start(rule: RateLimit) -> ColumnElement[Any]:
    """Where a rate limit's window starts: ``now() - per``."""
    return func.now() - seconds_interval(rule.seconds)


def _others(qt: QueueTable) -> Any:
    return qt.table.alias("counted_jobs")


def _counted(qt: QueueTable, rule: Concurrency | RateLimit, key: ColumnElement[Any] | None) -> ColumnElement[int]:
    """What ``rule`` counts now, of the key ``key`` (a column of the row the count is
    for) or of the whole table (a rule without a key: computed once): the running jobs
    (:class:`Concurrency`), or the jobs started within its period (:class:`RateLimit`,
    whatever their status since)."""
    others = _others(qt)
    count = select(func.count()).select_from(others)
    if isinstance(rule, Concurrency):
        count = count.where(others.c.status == status_literal(RUNNING))
    else:
        # now(), not the clock: a stable bound is an index condition on (key, started_at),
        # where clock_timestamp() would filter every start the key ever had. It is the
        # transaction's start, a moment before the claim: the window counts a little more.
        count = count.where(others.c.started_at > _window_start(rule))
    if rule.key is not None:
        assert key is not None
        count = count.where(others.c[rule.key] == key)
    return count.scalar_subquery()


def _first_of_its_key(qt: QueueTable, rule: InOrder) -> ColumnElement[bool]:
    """No earlier job of the row's key (``created_at``, then the primary key) is pending
    or running (or failed, when dead letters block): the row is its key's head. A NULL
    key is not ordered. Safe without turns: an earlier job only ever stops holding the
    row back by finishing, and a snapshot that missed it finishing holds back more."""
    others = _others(qt)
    key = qt.c[rule.key]
    holding = [PENDING, RUNNING, *([FAILED] if rule.on_dead_letter == "block" else [])]
    earlier = select(others.c[qt.pk.name]).where(
        others.c[rule.key] == key,
        or_(*(others.c.status == status_literal(s) for s in holding)),
        tuple_(others.c.created_at, others.c[qt.pk.name]) < tuple_(qt.c.created_at, qt.pk),
    )
    return or_(key.is_(None), ~exists(earlier))


def _window_counts(qt: QueueTable, rule: RateLimit) -> Select[Any]:
    """``(key, started)``: each key's starts within ``rule``'s window, by a range of its
    index on ``(started_at, key)``."""
    assert rule.key is not None
    others = _others(qt)
    key = others.c[rule.key]
    return (
        select(key.label("key"), func.count().label("started"))
        .where(others.c.started_at > _window_start(rule), key.is_not(None))
        .group_by(key)
    )


def _full_keys(qt: QueueTable, rule: Concurrency | RateLimit) -> Select[Any]:
    """The keys of ``rule`` at its limit: their running jobs (:class:`Concurrency`), or
    their starts within the window (:class:`RateLimit`). An uncorrelated subquery, one
    pass over those rows by the rule's index (they are few: at most the limit per key),
    so a row of a full key costs the scan a hash probe, not a count of its own, however
    long its key's backlog."""
    assert rule.key is not None
    others = _others(qt)
    key = others.c[rule.key]
    counted = (
        others.c.status == status_literal(RUNNING)
        if isinstance(rule, Concurrency)
        else others.c.started_at > _window_start(rule)
    )
    return select(key).where(counted, key.is_not(None)).group_by(key).having(func.count() >= limit_of(qt, rule, key))


def room(qt: QueueTable, rules: Sequence[FlowRule]) -> list[ColumnElement[bool]]:
    """The candidates' condition under ``rules``: their key is below its limit (a NULL
    key is not limited), and, under a strict rate limit, their own last start left its
    period. The scan passes over the rows of a full key."""
    conditions: list[ColumnElement[bool]] = []
    for rule in rules:
        if isinstance(rule, InOrder):
            conditions.append(_first_of_its_key(qt, rule))
        elif rule.key is None:
            conditions.append(_counted(qt, rule, None) < rule.limit)
        else:
            key = qt.c[rule.key]
            conditions.append(or_(key.is_(None), key.not_in(_full_keys(qt, rule))))
        if isinstance(rule, RateLimit) and rule.strict:
            started = qt.c.started_at
            conditions.append(or_(started.is_(None), started <= _clock() - seconds_interval(rule.seconds)))
    return conditions


def key_columns(qt: QueueTable, rules: Sequence[FlowRule]) -> list[ColumnElement[Any]]:
    """The columns a claim under ``rules`` carries from its candidates to their ranking."""
    return [qt.c[name] for name in dict.fromkeys(rule.key for rule in _counting(rules) if rule.key is not None)]


def _counting(rules: Sequence[FlowRule]) -> list[Concurrency | RateLimit]:
    """The rules whose limit a claim's candidates are ranked against."""
    return [rule for rule in rules if isinstance(rule, Concurrency | RateLimit)]


def within_limits(
    qt: QueueTable, candidates: Subquery, rules: Sequence[FlowRule], limit: int | ColumnElement[int]
) -> Select[Any]:
    """The keys of ``candidates`` (pk, priority, run_after and the rules' key columns, in
    any order; keys with room, see :func:`room`) that fit: each ranked within its key in
    the claim's order, and kept while its rank plus the jobs of its key running now stays
    within the limit; the best ``limit`` of them."""
    pk = candidates.c[qt.pk.name]
    order = (candidates.c.priority.desc(), candidates.c.run_after, pk)
    rules = _counting(rules)
    ranks: list[ColumnElement[Any]] = []
    source: Any = candidates
    for n, rule in enumerate(rules):
        key = candidates.c[rule.key] if rule.key is not None else None
        rank = func.row_number().over(partition_by=key, order_by=order) if key is not None else func.row_number().over(
            order_by=order)
        if isinstance(rule, RateLimit) and key is not None:
            # A window's starts per key, counted once and joined: its index leads with
            # started_at, so a count per candidate would read the whole window each time.
            starts = _window_counts(qt, rule).subquery(f"window_{n}")
            source = source.outerjoin(starts, starts.c.key == key)
            now: ColumnElement[Any] = func.coalesce(starts.c.started, 0)
        elif key is not None and isinstance(rule, Concurrency) and _fixed(limit_of(qt, rule, key)) == 1:
            # A key with a job running is full at a limit of 1, and the candidates are of
            # keys with room (room(), in the same snapshot): none of theirs runs.
            now = literal(0)
        else:
            now = _counted(qt, rule, key)
        ranks.append((rank + now).label(f"flow_{n}"))
    ranked = select(*candidates.c, *ranks).select_from(source).subquery("ranked")
    fits: list[ColumnElement[bool]] = []
    for n, rule in enumerate(rules):
        taken = ranked.c[f"flow_{n}"] <= limit_of(qt, rule, ranked.c[rule.key] if rule.key is not None else None)
        fits.append(taken if rule.key is None else or_(ranked.c[rule.key].is_(None), taken))
    rpk = ranked.c[qt.pk.name]
    return select(rpk).where(*fits).order_by(ranked.c.priority.desc(), ranked.c.run_after, rpk).limit(limit)


def _fixed(limit: ColumnElement[int] | int) -> int | None:
    """A limit known when the statement is built (not a queue's own, read by the claim)."""
    return limit if isinstance(limit, int) else None


def claimable_within_limits(
    qt: QueueTable, conditions: Sequence[ColumnElement[bool]], order: Sequence[ColumnElement[Any]],
    limit: int | ColumnElement[int], names: list[str] | None, rules: Sequence[FlowRule],
) -> Select[Any]:
    """The claim's keys under concurrency rules: the head of the queues served, as
    without rules, passing over the rows whose key is at its limit; up to
    :data:`CANDIDATES_PER_JOB` candidates per job asked, then those that fit
    (:func:`within_limits`). Only strict when claims take turns (:func:`flow_lock`)."""
    c = qt.c
    carried = [qt.pk, c.priority, c.run_after, *key_columns(qt, rules)]
    where = [*conditions, *room(qt, rules)]
    many = limit * CANDIDATES_PER_JOB
    fair = next((rule for rule in rules if isinstance(rule, Concurrency) and rule.fair), None)
    if fair is not None:
        candidates = _round_the_keys(qt, fair, carried, [*where, *_queue_filter(qt, names), *unpaused(qt, names)],
                                     order, many)
    elif names is None or len(names) == 1:
        candidates = (
            select(*carried)
            .where(*where, *_queue_filter(qt, names), *unpaused(qt, names))
            .order_by(*order)
            .limit(many)
            .subquery("candidates")
        )
    else:
        served = func.unnest(_queue_array(qt, names)).table_valued("name").render_derived(name="served")
        per_queue = (
            select(*carried)
            .where(*where, c.queue == served.c.name, *unpaused(qt, served=served.c.name))
            .order_by(*order)
            .limit(many)
            .lateral("per_queue")
        )
        candidates = select(*per_queue.c).select_from(served).join(per_queue, true()).subquery("candidates")
    # The candidates are read without locking them; only the jobs chosen are locked
    # (SKIP LOCKED), each checked again on its latest version (still pending, still
    # due): a claim locks the rows it takes, not four times as many.
    chosen = func.array(within_limits(qt, candidates, rules, limit).scalar_subquery(), type_=ARRAY(qt.pk.type))
    return select(qt.pk).where(qt.pk == any_(chosen), *conditions).with_for_update(skip_locked=True)


def _round_the_keys(
    qt: QueueTable, rule: Concurrency, carried: Sequence[ColumnElement[Any]], where: Sequence[ColumnElement[bool]],
    order: Sequence[ColumnElement[Any]], many: ColumnElement[int] | int,
) -> Subquery:
    """A fair claim's candidates: every key of ``rule`` with pending jobs, found by a
    loose index scan (a recursive CTE, one probe of ``<table>_fair_<key>_idx`` per key),
    and up to ``rule.limit`` of each key's claimable jobs in the claim's order; with the
    jobs whose key is NULL (not limited), up to ``many``. The cost of a claim grows with
    the number of keys, not with any one key's backlog."""
    assert rule.key is not None
    c = qt.c
    walker = qt.table.alias("key_walk")
    wkey = walker.c[rule.key]
    pending = walker.c.status == status_literal(PENDING)
    first = select(wkey).where(pending, wkey.is_not(None)).order_by(wkey).limit(1).scalar_subquery()
    walk = select(first.label("k")).cte("pending_keys", recursive=True)
    following = select(wkey).where(pending, wkey > walk.c.k).order_by(wkey).limit(1).scalar_subquery()
    walk = walk.union_all(select(following.label("k")).where(walk.c.k.is_not(None)))
    key = c[rule.key]
    per_key = (
        select(*carried)
        .where(*where, key == walk.c.k)
        .order_by(*order)
        .limit(rule.limit)
        .lateral("per_key")
    )
    keyed = select(*per_key.c).select_from(walk).join(per_key, true()).where(walk.c.k.is_not(None))
    unkeyed = (
        select(*carried)
        .where(*where, key.is_(None))
        .order_by(*order)
        .limit(many)
        .subquery("unkeyed")
    )
    return union_all(keyed, select(*unkeyed.c)).subquery("candidates")


def rule_counts(model: QueueModel, rule: FlowRule, *, limit: int = 5) -> Select[Any]:
    """``(key, count)`` of the ``limit`` keys nearest ``rule``'s limit, busiest first:
    running jobs (:class:`~sqla_queue.Concurrency`), starts within the period
    (:class:`~sqla_queue.RateLimit`), or jobs waiting their turn
    (:class:`~sqla_queue.InOrder`: pending). A rule without a key gives one row, the
    table's count, its key NULL. What the dashboard and ``sqla-queue stats`` show."""
    qt = queue_table(model)
    count = func.count().label("count")
    if isinstance(rule, Concurrency):
        where = qt.c.status == status_literal(RUNNING)
    elif isinstance(rule, RateLimit):
        where = qt.c.started_at > _window_start(rule)
    else:
        where = qt.c.status == status_literal(PENDING)
    if rule.key is None:
        return cast("Select[Any]", select(literal(None).label("key"), count).where(where))
    column = qt.c[rule.key]
    return (
        select(column.label("key"), count)
        .where(where, column.is_not(None))
        .group_by(column)
        .order_by(count.desc(), column)
        .limit(limit)
    )


def next_free_start(qt: QueueTable, names: list[str] | None) -> ColumnElement[Any] | None:
    """When the soonest rate limit's window lets a start in again, while a due job of the
    queues ``names`` waits (NULL otherwise): an idle worker wakes then rather than at its
    next poll. None for a table without rate limits."""
    rates = [rule for rule in flow_rules(qt.table) if isinstance(rule, RateLimit)]
    if not rates:
        return None
    others = _others(qt)
    frees = [
        select(func.min(others.c.started_at) + seconds_interval(rule.seconds))
        .where(others.c.started_at > _window_start(rule))
        .scalar_subquery()
        for rule in rates
    ]
    due = exists(
        select(qt.pk).where(
            qt.c.status == status_literal(PENDING), qt.c.run_after <= func.now(), *_queue_filter(qt, names)
        )
    )
    free = frees[0] if len(frees) == 1 else func.least(*frees)
    return case((due, free), else_=None)
