"""How a worker is sized and timed: one frozen dataclass, checked when it is made."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from datetime import timedelta
from typing import Any, Final

from ..model import FINISHED_STATUSES, RESERVED_QUEUE_PREFIX, JobStatus
from ..periodic import Schedule, check_schedules
from ..retry import Backoff

__all__ = ["WorkerConfig", "check_options"]

#: Longest ``name``: the lease owner column also holds a random suffix and the executor's tag.
MAX_NAME_LENGTH = 150


#: The most jobs a thread claims at once by default (``batch_size=None``), sized within
#: it by the handlers' speed.
DEFAULT_MAX_BATCH: Final = 32
#: The same on a table whose flow rules make claims take turns (one claim at a time per
#: table, under its lock): each turn is a claim's fixed cost paid while every other
#: claimer waits, so a fast handler's batch may grow larger. A slow handler's batch is
#: sized by its speed as anywhere (the executor aims a batch at 50 ms of handler time).
TURN_MAX_BATCH: Final = 128


#: The largest ``max_result_size``: a JSON text this long always fits in jsonb (one
#: character takes at most 7 bytes of jsonb's binary form, plus 16).
MAX_RESULT_SIZE: Final = (2**28 - 1 - 16) // 7


@dataclass(frozen=True)
class WorkerConfig:
    """Timing and sizing of a worker. Durations are in seconds.

    The lease must comfortably exceed the heartbeat interval: a worker that misses
    ``lease / heartbeat_interval`` beats in a row loses its jobs to the sweeper.
    """

    #: Handler threads; each claims, runs and completes its own jobs on its own connection.
    concurrency: int = 4
    #: Most jobs one thread claims at once. Default: sized by the handlers' speed, up to
    #: 32, or 128 on a table whose claims take turns (fast handlers get large batches;
    #: slow ones, one job at a time).
    batch_size: int | None = None
    lease: float = 60.0
    #: Default: a third of the lease.
    heartbeat_interval: float | None = None
    #: 0 turns the sweeper off (run ``sqla-queue sweep`` elsewhere then).
    sweep_interval: float = 15.0
    #: Idle threads claim at least this often, NOTIFY or not.
    poll_interval: float = 5.0
    shutdown_grace: float = 30.0
    queues: tuple[str, ...] | None = None
    #: False: poll only (PgBouncer in transaction pooling mode cannot LISTEN), and hold
    #: no session lock: once such a worker died, its jobs wait for their lease to run out.
    listen: bool = True
    backoff: Backoff = field(default_factory=Backoff)
    #: ``last_error`` keeps the exception and the end of its traceback, up to this size.
    max_error_length: int = 4000
    #: On a table that keeps results: the longest result, in characters of JSON. A
    #: longer one fails its attempt (``ResultNotStorable``): keep big results elsewhere
    #: (object storage, a table of your own) and return a reference.
    max_result_size: int = 1_048_576
    #: Prefix of the lease owner name; default: host name and process id.
    name: str | None = None
    #: Longest wait between reconnection attempts after the database went away.
    reconnect_backoff: float = 2.0
    #: Most events waiting for the observers; past it they are dropped (and counted).
    observer_queue_size: int = 10_000
    #: Serve Prometheus metrics on this port (all interfaces); needs the ``prometheus``
    #: extra. None: no exporter (mount :mod:`sqla_queue.prometheus` in your app instead).
    metrics_port: int | None = None
    #: Seconds one attempt may run, for jobs without a timeout of their own or of their
    #: task; past it the attempt fails (``timed out after N s``). None: no limit.
    timeout: float | None = None
    #: Periodic jobs this worker enqueues (besides those of its Tasks registry), each
    #: tick once however many workers run them.
    schedules: tuple[Schedule, ...] = ()
    #: False: enqueue no periodic jobs here (other workers of the table do).
    periodic: bool = True
    #: Delete finished jobs this long (seconds or a timedelta) after they finished: one
    #: age for ``done`` and ``cancelled`` (dead letters kept), or an age per status,
    #: ``{"done": 86400, "failed": timedelta(days=30)}``. None (the default): keep all.
    retention: float | timedelta | Mapping[str, float | timedelta] | None = None
    #: Seconds between two pruning passes (a pass deletes batch after batch until done).
    retention_interval: float = 60.0
    #: Most rows one pruning statement deletes (one short transaction each).
    retention_batch: int = 1000

    def __post_init__(self) -> None:
        if self.queues is not None and not isinstance(self.queues, tuple):
            if isinstance(self.queues, str):
                raise ValueError("queues must be a sequence of queue names, not a single string")
            object.__setattr__(self, "queues", tuple(self.queues))
        _positive_int("concurrency", self.concurrency)
        if self.batch_size is not None:
            _positive_int("batch_size", self.batch_size)
        for name in ("lease", "poll_interval", "reconnect_backoff"):
            _duration(name, getattr(self, name), positive=True)
        for name in ("sweep_interval", "shutdown_grace"):
            _duration(name, getattr(self, name), positive=False)
        if self.heartbeat_interval is not None:
            _duration("heartbeat_interval", self.heartbeat_interval, positive=True)
        if self.timeout is not None:
            _duration("timeout", self.timeout, positive=True)
        if self.effective_heartbeat >= self.lease:
            raise ValueError(
                f"heartbeat_interval ({self.effective_heartbeat}s) must be shorter than the "
                f"lease ({self.lease}s)"
            )
        if self.queues is not None:
            if not self.queues:
                raise ValueError("queues must name at least one queue, or be None for all")
            for queue in self.queues:
                if not isinstance(queue, str) or not queue or "\x00" in queue:
                    raise ValueError(f"queue names must be non-empty strings, got {queue!r}")
                if queue.startswith(RESERVED_QUEUE_PREFIX):
                    raise ValueError(
                        f"queue {queue!r} starts with {RESERVED_QUEUE_PREFIX!r}, which sqla_queue reserves"
                    )
        if self.name is not None and len(self.name) > MAX_NAME_LENGTH:
            # The lease owner is the name, a random suffix and the executor's tag, in a
            # 200-character column.
            raise ValueError(f"name must be at most {MAX_NAME_LENGTH} characters, got {len(self.name)}")
        _positive_int("max_error_length", self.max_error_length)
        _positive_int("max_result_size", self.max_result_size)
        if self.max_result_size > MAX_RESULT_SIZE:
            raise ValueError(
                f"max_result_size must be at most {MAX_RESULT_SIZE} (jsonb's limit), got {self.max_result_size}"
            )
        _positive_int("observer_queue_size", self.observer_queue_size)
        if self.metrics_port is not None:
            _positive_int("metrics_port", self.metrics_port)
            if self.metrics_port > 65535:
                raise ValueError(f"metrics_port must be a TCP port (1-65535), got {self.metrics_port}")
        if not isinstance(self.schedules, tuple):
            object.__setattr__(self, "schedules", check_schedules(self.schedules))
        else:
            check_schedules(self.schedules)
        if not isinstance(self.periodic, bool):
            raise TypeError(f"periodic must be True or False, got {self.periodic!r}")
        self.retention_ages  # noqa: B018 - checks the retention
        _duration("retention_interval", self.retention_interval, positive=True)
        _positive_int("retention_batch", self.retention_batch)
        if not isinstance(self.backoff, Backoff):
            raise TypeError(f"backoff must be a sqla_queue.Backoff, got {self.backoff!r}")

    @property
    def retention_ages(self) -> dict[str, float]:
        """The retention as seconds per status (empty: none)."""
        given = self.retention
        if given is None:
            return {}
        if isinstance(given, Mapping):
            if not given:
                raise ValueError("retention must name at least one status, or be None")
            ages: dict[str, float] = {}
            for status, age in given.items():
                try:
                    wanted = JobStatus(status)
                except ValueError:
                    wanted = None
                if wanted not in FINISHED_STATUSES:
                    raise ValueError(f"retention: only finished jobs (done, failed, cancelled) can be pruned, "
                                     f"got {status!r}")
                assert wanted is not None
                ages[wanted.value] = _age(f"retention[{status!r}]", age)
            return ages
        age = _age("retention", given)
        return {JobStatus.DONE.value: age, JobStatus.CANCELLED.value: age}

    def max_batch(self, takes_turns: bool = False) -> int:
        """The most jobs one thread claims at once: ``batch_size``, else
        :data:`DEFAULT_MAX_BATCH`, or :data:`TURN_MAX_BATCH` where the table's claims take
        turns (``Operations.claims_take_turns``)."""
        return self.batch_size or (TURN_MAX_BATCH if takes_turns else DEFAULT_MAX_BATCH)

    @property
    def effective_heartbeat(self) -> float:
        return self.heartbeat_interval if self.heartbeat_interval is not None else self.lease / 3

    @property
    def heartbeat_deadline(self) -> float:
        """How long one beat may take before its connection is cut and replaced: half of
        what the lease leaves after the interval, so a beat cut at its deadline can still
        be made again on a new connection before the leases it renews lapse (the
        interval itself at the default, a third of the lease). A beat over many jobs on
        a loaded server may well take longer than a short interval, and a beat cut at
        its deadline is cancelled on the server: tied to the interval, it would never
        land."""
        return max(self.effective_heartbeat, (self.lease - self.effective_heartbeat) / 2)

    @property
    def statement_deadline(self) -> float:
        """How long an executor's claim or completion may take before its connection is
        dropped (and the call retried on a new one): half the lease. A statement stuck
        behind a frozen proxy, PgBouncer or NAT box (where TCP keepalive cannot fire)
        would otherwise hold its jobs forever, their leases renewed by a healthy heartbeat."""
        return self.lease / 2


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}")


def _duration(name: str, value: Any, *, positive: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number of seconds, got {value!r}")
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise ValueError(f"{name} must be a {'positive' if positive else 'non-negative'} "
                         f"number of seconds, got {value!r}")
    if value > 10 * 365 * 86400:
        raise ValueError(f"{name} is implausibly long: {value!r} seconds")


def _age(name: str, value: Any) -> float:
    seconds = value.total_seconds() if isinstance(value, timedelta) else value
    _duration(name, seconds, positive=True)
    return float(seconds)


def check_options(**options: Any) -> WorkerConfig:
    """A config from keyword options, raising TypeError/ValueError for bad ones."""
    known = {f.name for f in fields(WorkerConfig)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"unknown worker option(s): {', '.join(unknown)}")
    return WorkerConfig(**options)
