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

# This module is the public face: import the builders from here. They live in private
# modules, one per stage of a job's life, over a shared base (the shape of SQLAlchemy's
# sql/expression.py over its _dml_constructors.py and _selectable_constructors.py):
#
#   _base.py         parameter names, durations and the clock, queue and kind filters,
#                    the one fence of every transition after a claim (_token_fence),
#                    the freshness guard (still_fresh)
#   _claim.py        claim, claim_template (from the head, or after a cursor),
#                    claim_candidates, fail_unclaimable
#   _transitions.py  complete, retry, fail, release, snooze (templates and single calls),
#                    complete-then-claim
#   _cancel.py       cancel: pending and running jobs, or pending ones only
#   _history.py      each attempt's history, appended by the statement that ends it
#   _leases.py       the heartbeat's extension, owned tokens, lost claims, the sweep, next due
#   _sessions.py     the session lock a listening worker holds, and the sweep's test that a
#                    job's worker's session ended
#   _inspect.py      job filters, listings, counts, lease owners, listening workers, whether
#                    an isolated job waits
#   _retention.py    requeue, delete, prune, archive
#   _unique.py       the keyed insert, a key's holder, the rows that keep their key
#   _schedules.py    the watermark of each periodic schedule
#   _flow.py         pausing and resuming a queue, per-queue limits set at run time, and the
#                    condition every claim adds
#   _limits.py       the claim under flow rules (limits, sequences, fair claims), the lock
#                    its claims take turns on, and each rule's busiest keys
#   _results.py      results: their encoding and storing by the completion, the NOTIFY of
#                    finished ids on a table that keeps them, the read of one job's result
#   _workflows.py    dependencies: the countdown and release of children, the policy of a
#                    workflow whose job failed, a workflow's jobs and a job's parents
#   _finish.py       the one wrapper of every statement that ends jobs (results, workflows)
#   _workers.py      the workers table: a worker's row recorded, forgotten, listed, pruned
#   _activity.py     activity over time: jobs finished per queue and bucket, pickup latency
#                    and run time, waiting jobs; recorded into the activity table, read back
#   _notify.py       pg_notify: the one NOTIFY builder every sender uses (an expression, or
#                    the SQL text of a simple-protocol query on the psycopg cursor)
#
# No statement module grows past 400 lines (tests/unit/test_structure.py): a stage that
# outgrows it splits. The value types live with the model (ClaimToken, sqla_queue.model)
# and in sqla_queue.retry (Backoff); both stay exported here.

from __future__ import annotations

from ..model import ClaimToken
from ..retry import MAX_BACKOFF_SECONDS as MAX_BACKOFF_SECONDS
from ..retry import Backoff
from ._activity import ACTIVITY_COLUMNS as ACTIVITY_COLUMNS
from ._activity import ACTIVITY_SAMPLE_PARAM as ACTIVITY_SAMPLE_PARAM
from ._activity import ACTIVITY_SINCE_PARAM as ACTIVITY_SINCE_PARAM
from ._activity import ACTIVITY_UNTIL_PARAM as ACTIVITY_UNTIL_PARAM
from ._activity import (
    activity_marks,
    activity_rows,
    finished_activity,
    prune_activity,
    record_activity,
    waiting_jobs,
)
from ._base import AFTER_KEY_PARAM as AFTER_KEY_PARAM
from ._base import AFTER_KEYS_PARAM as AFTER_KEYS_PARAM
from ._base import AFTER_PRIORITIES_PARAM as AFTER_PRIORITIES_PARAM
from ._base import AFTER_PRIORITY_PARAM as AFTER_PRIORITY_PARAM
from ._base import AFTER_RUN_AFTER_PARAM as AFTER_RUN_AFTER_PARAM
from ._base import AFTER_RUN_AFTERS_PARAM as AFTER_RUN_AFTERS_PARAM
from ._base import ATTEMPT_PARAM as ATTEMPT_PARAM
from ._base import ATTEMPTS_PARAM as ATTEMPTS_PARAM
from ._base import CANCELLED as CANCELLED
from ._base import CHANNEL_PARAM as CHANNEL_PARAM
from ._base import DELAYS_PARAM as DELAYS_PARAM
from ._base import DONE as DONE
from ._base import DONE_FLAG_COLUMN as DONE_FLAG_COLUMN
from ._base import ERROR_PARAM as ERROR_PARAM
from ._base import ERRORS_PARAM as ERRORS_PARAM
from ._base import FAILED as FAILED
from ._base import FRESH_PARAM as FRESH_PARAM
from ._base import HEAD_PRIORITY as HEAD_PRIORITY
from ._base import IDS_PARAM as IDS_PARAM
from ._base import JOB_PARAM as JOB_PARAM
from ._base import KEY_PARAM as KEY_PARAM
from ._base import LEASE_PARAM as LEASE_PARAM
from ._base import LIMIT_PARAM as LIMIT_PARAM
from ._base import ONE_PROGRESS_PARAM as ONE_PROGRESS_PARAM
from ._base import OWNER_PARAM as OWNER_PARAM
from ._base import PENDING as PENDING
from ._base import PROGRESS_PARAM as PROGRESS_PARAM
from ._base import RESULT_PARAM as RESULT_PARAM
from ._base import RESULTS_PARAM as RESULTS_PARAM
from ._base import RUNNING as RUNNING
from ._base import SCHEDULE_PARAM as SCHEDULE_PARAM
from ._base import SINCE_PARAM as SINCE_PARAM
from ._base import SKIP_PARAM as SKIP_PARAM
from ._base import TASK_NAMES_PARAM as TASK_NAMES_PARAM
from ._base import TASK_TIMEOUTS_PARAM as TASK_TIMEOUTS_PARAM
from ._base import TICK_PARAM as TICK_PARAM
from ._base import TIMEOUT_PARAM as TIMEOUT_PARAM
from ._base import Duration as Duration
from ._base import QueueModel as QueueModel
from ._base import _queue_names as _queue_names
from ._base import delay_from_insert, has_timeouts, seconds_interval, still_fresh
from ._bulk import BULK_BATCH as BULK_BATCH
from ._bulk import BULK_STATUSES as BULK_STATUSES
from ._bulk import BulkAction as BulkAction
from ._bulk import bulk_count, cancel_batch, delete_batch, requeue_batch
from ._cancel import cancel_jobs, cancel_pending
from ._claim import claim, claim_candidates, claim_template, fail_unclaimable
from ._flow import pause_queue, paused_queues, queue_limits, resume_queue, set_queue_limits
from ._inspect import DEPTH_STATUSES as DEPTH_STATUSES
from ._inspect import (
    finished_per_minute,
    get_job,
    isolated_waiting,
    job_filter,
    lease_owners,
    list_jobs,
    listening_workers,
    queue_depth,
    queue_stats,
)
from ._leases import RECENTLY_DUE_SECONDS as RECENTLY_DUE_SECONDS
from ._leases import SOLITARY_REASON as SOLITARY_REASON
from ._leases import (
    extend_leases_if_owner,
    extend_unlocked_leases_if_owner,
    is_solitary,
    next_run_after,
    owned_tokens,
    release_lost_claims,
    sweep_expired,
    token_states,
)
from ._limits import CANDIDATES_PER_JOB as CANDIDATES_PER_JOB
from ._limits import flow_lock, flow_lock_key, rule_counts
from ._results import job_result, result_encoder
from ._retention import DELETABLE_STATUSES as DELETABLE_STATUSES
from ._retention import Ages as Ages
from ._retention import archive_finished, delete_jobs, prune_finished, prune_lock_key, requeue_failed
from ._schedules import (
    claim_schedule_run,
    claim_schedule_tick,
    pause_schedule,
    resume_schedule,
    schedule_states,
    schedule_tick_template,
)
from ._sessions import SESSION_MARK as SESSION_MARK
from ._sessions import WORKER_LOCK_SPACE as WORKER_LOCK_SPACE
from ._sessions import hold_worker_lock, worker_lock_owner
from ._transitions import (
    complete_if_owner,
    complete_many_if_owner,
    complete_many_if_owner_then_claim,
    complete_template,
    fail_if_owner,
    fail_many_if_owner,
    release_if_owner,
    release_many_if_owner,
    retry_if_owner,
    retry_many_if_owner,
    snooze_if_owner,
    snooze_many_if_owner,
)
from ._unique import insert_unique, keeps_unique_key, unique_holder
from ._workers import forget_worker, prune_workers, record_worker, worker_rows
from ._workflows import CASCADE_REASON as CASCADE_REASON
from ._workflows import for_leaves as for_leaves
from ._workflows import parents_of, settle_edges, wake_values, workflow_jobs

__all__ = [
    "Backoff",
    "ClaimToken",
    "archive_finished",
    "bulk_count",
    "cancel_batch",
    "cancel_jobs",
    "cancel_pending",
    "job_result",
    "record_worker",
    "forget_worker",
    "prune_workers",
    "worker_rows",
    "record_activity",
    "prune_activity",
    "activity_marks",
    "activity_rows",
    "finished_activity",
    "waiting_jobs",
    "result_encoder",
    "claim",
    "claim_schedule_run",
    "claim_schedule_tick",
    "claim_candidates",
    "claim_template",
    "complete_if_owner",
    "complete_many_if_owner",
    "complete_many_if_owner_then_claim",
    "complete_template",
    "delay_from_insert",
    "delete_batch",
    "delete_jobs",
    "extend_leases_if_owner",
    "extend_unlocked_leases_if_owner",
    "fail_if_owner",
    "fail_many_if_owner",
    "fail_unclaimable",
    "finished_per_minute",
    "flow_lock",
    "flow_lock_key",
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
    "pause_queue",
    "pause_schedule",
    "paused_queues",
    "prune_finished",
    "queue_depth",
    "queue_limits",
    "prune_lock_key",
    "queue_stats",
    "release_if_owner",
    "release_lost_claims",
    "release_many_if_owner",
    "requeue_batch",
    "requeue_failed",
    "resume_queue",
    "resume_schedule",
    "rule_counts",
    "retry_if_owner",
    "retry_many_if_owner",
    "schedule_states",
    "schedule_tick_template",
    "seconds_interval",
    "set_queue_limits",
    "snooze_if_owner",
    "snooze_many_if_owner",
    "still_fresh",
    "sweep_expired",
    "hold_worker_lock",
    "worker_lock_owner",
    "parents_of",
    "settle_edges",
    "wake_values",
    "workflow_jobs",
    "token_states",
    "unique_holder",
]


def _public_face() -> None:
    """The builders say they are ``sqla_queue.sql``'s, as they were before the split: in
    ``repr()``, ``help()``, pickles, and the checks that every builder is documented."""
    for name in __all__:
        value = globals()[name]
        if getattr(value, "__module__", "").startswith(__name__ + "._"):
            value.__module__ = __name__


_public_face()
