"""The dashboard's JSON API, under ``/api/`` of the dashboard: what its pages read, for
scripts, and (when allowed) what their buttons do.

It is a blueprint nested in the dashboard's, so everything that guards a page guards it:
the trusted ``Host`` check, ``auth``, the ``Origin`` (or ``Referer``) of every POST. On
top, for the API:

- **Read-only unless asked.** Actions need the dashboard made with ``api_actions=True``
  and not ``read_only``; otherwise every action, and the token, is a 403.
- **A CSRF token of its own**, read with ``GET /api/csrf`` (which sets the session
  cookie it lives in) and sent back in the ``X-CSRF-Token`` header: a header, which a
  form of another site cannot send, and a response no page of another origin can read
  (no CORS headers; a request a browser marks cross-site, ``Sec-Fetch-Site``, is refused
  outright; ``Cross-Origin-Resource-Policy: same-origin`` keeps it out of another
  page's process).
- **JSON bodies only** (``Content-Type: application/json``, which no form sends).
- **Errors as JSON**, typed (``{"error": "no_such_job", "message": ..., "status":
  404}``), never an HTML page; values as JSON: datetimes in ISO 8601, keys as numbers
  or strings as the key column holds them, ``<``, ``>`` and ``&`` escaped in strings.

The reads are :mod:`.reads` and :mod:`sqla_queue.admin`, the same as the pages'; the
actions are the same fenced statements as the pages' buttons. The overview, the
schedules and the bulk actions by filter are :mod:`.api_more`'s, given to
:func:`api_blueprint` as ``more``.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import hmac
import json
import math
import secrets
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import date, datetime, time, timedelta
from decimal import Decimal
from enum import Enum
from typing import TYPE_CHECKING, Any, NoReturn

from flask import Blueprint, Response, request, session, url_for
from sqlalchemy import JSON
from werkzeug.exceptions import HTTPException, NotFound

from .. import admin
from ..errors import QueuesTableNotDeclared
from ..model import JobStatus, check_queue, has_workflows, history_column, progress_column, result_column
from ..registry import declared_workers_table
from .reads import _DEFAULT_LEASE, _ERROR_VIEW, _job_id, _job_value, _job_view, _list_page, _running_jobs, _split
from .workflows import parse_workflow_id, workflow_jobs, workflow_summary

if TYPE_CHECKING:
    from . import _Settings, _Table

__all__ = ["CSRF_HEADER", "Action", "ApiContext", "ApiMore", "api_blueprint"]

#: The request header an action carries its token in (read it from ``GET /api/csrf``).
CSRF_HEADER = "X-CSRF-Token"
_TOKEN_KEY = "sqla_queue_dashboard_api_csrf"
_STATUSES = tuple(s.value for s in JobStatus)
#: The most jobs a list returns in one response (``limit=``), and an action takes.
_MAX_LIMIT = 500
_MAX_IDS = 10_000
#: Every method is routed to every endpoint, so that a wrong one is the API's typed 405,
#: not Flask's HTML page.
_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
#: In JSON strings, so that no browser sniffing or template mistake ever reads markup.
_ESCAPES = (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"), ("\u2028", "\\u2028"), ("\u2029", "\\u2029"))


class ApiError(Exception):
    """An answer of the API other than 200: its status, its type (a stable word a script
    can test) and a message for a person."""

    def __init__(self, status: int, kind: str, message: str, *, allow: list[str] | None = None) -> None:
        super().__init__(message)
        self.status, self.kind, self.message, self.allow = status, kind, message, allow


def _fail(status: int, kind: str, message: str) -> NoReturn:
    raise ApiError(status, kind, message)


#: An action of the action endpoint: it takes the JSON body, runs what the page's button
#: runs, and says what changed.
Action = Callable[["_Settings", "_Table", Mapping[str, Any]], dict[str, Any]]
View = Callable[..., Response]


@dataclass(frozen=True)
class ApiContext:
    """What a module that adds endpoints to the API is given: the settings, the router
    (``route(rule, method)``: a wrong method a typed 405), the table of a URL (a typed
    404), whether actions are allowed."""

    settings: _Settings
    route: Callable[[str, str], Callable[[View], View]]
    entry_of: Callable[[str], _Table]
    writable: bool


@dataclass(frozen=True)
class ApiMore:
    """What such a module adds: actions of the action endpoint (under its checks), and
    the URLs and actions the index lists for a table."""

    actions: Mapping[str, Action]
    links: Callable[[_Table], dict[str, Any]]
    offered: Callable[[_Table], list[str]]


def api_blueprint(
    settings: _Settings, *, actions: bool, more: Callable[[ApiContext], ApiMore] | None = None
) -> Blueprint:
    """The API as a blueprint to nest in the dashboard's (``url_prefix="/api"``): it reads
    ``settings`` as the pages do; ``actions`` is ``api_actions`` (and ``settings.read_only``
    still refuses them); ``more`` adds the endpoints of :mod:`.api_more`."""
    api = Blueprint("api", __name__)
    writable = actions and not settings.read_only

    def route(rule: str, method: str) -> Callable[[View], View]:
        allowed = [method, "HEAD"] if method == "GET" else [method]

        def register(view: View) -> View:
            @functools.wraps(view)
            def checked(**kwargs: Any) -> Response:
                if request.method not in allowed:
                    raise ApiError(405, "method_not_allowed", f"{request.method} is not allowed here: {method} is",
                                   allow=allowed)
                return view(**kwargs)

            api.add_url_rule(rule, view.__name__, checked, methods=_METHODS, provide_automatic_options=False)
            return view

        return register

    @api.before_request
    def _same_origin_only() -> None:
        # Browsers mark every request with where it comes from; scripts send nothing.
        site = request.headers.get("Sec-Fetch-Site")
        if site is not None and site not in ("same-origin", "none"):
            _fail(403, "cross_site", f"a request from another site ({site}) is refused")

    @api.after_request
    def _headers(response: Response) -> Response:
        response.headers["Cross-Origin-Resource-Policy"] = "same-origin"
        return response

    @api.errorhandler(ApiError)
    def _api_error(error: ApiError) -> Response:
        response = _json({"error": error.kind, "message": error.message, "status": error.status}, error.status)
        if error.allow:
            response.headers["Allow"] = ", ".join(error.allow)
        return response

    @api.errorhandler(HTTPException)
    def _http_error(error: HTTPException) -> Response:
        # What the dashboard's own checks refuse (Host, Origin, auth, a NUL), and Flask's.
        status = error.code or 500
        kind = (error.name or "error").lower().replace(" ", "_").replace("'", "")
        return _json({"error": kind, "message": error.description or error.name, "status": status}, status)

    def entry_of(key: str) -> _Table:
        if key not in settings.tables:
            _fail(404, "no_such_table", f"the dashboard shows no table {key!r}")
        return settings.tables[key]

    added = more(ApiContext(settings, route, entry_of, writable)) if more is not None else None
    verbs: dict[str, Action] = {**_ACTIONS, **(added.actions if added is not None else {})}

    @route("/", "GET")
    def index() -> Response:
        def offered(entry: _Table) -> list[str]:
            base = [verb for verb in _ACTIONS if verb != "cancel_workflow" or has_workflows(entry.qt.table)]
            return base + (added.offered(entry) if added is not None else [])

        return _json({
            "read_only": not writable,
            "overview": url_for(".overview") if added is not None else None,
            "csrf": url_for(".csrf") if writable else None,
            "tables": [
                {
                    "table": key,
                    "jobs": url_for(".jobs", table=key),
                    "dead": url_for(".dead", table=key),
                    "workers": url_for(".workers", table=key),
                    **(added.links(entry) if added is not None else {}),
                    "actions": [url_for(".action", table=key, verb=verb) for verb in offered(entry)]
                    if writable else [],
                }
                for key, entry in settings.tables.items()
            ],
        })

    @route("/csrf", "GET")
    def csrf() -> Response:
        if not writable:
            _fail(403, "read_only", _read_only_message(settings.read_only))
        token = session.get(_TOKEN_KEY)
        if not isinstance(token, str):
            token = secrets.token_urlsafe(32)
            session[_TOKEN_KEY] = token
        return _json({"csrf_token": token, "header": CSRF_HEADER})

    def job_list(table: str, *, dead: bool) -> Response:
        entry = entry_of(table)
        filters, before, limit = _list_arguments(entry, dead=dead, default_limit=settings.page_size)
        page = _list_page(settings, entry, filters, before=before, limit=limit)
        query: dict[str, Any] = {
            "queue": list(filters.queues), "status": list(filters.statuses), "task": list(filters.tasks),
            "error": filters.error_contains,
        }
        # What the next page's URL carries: the filters as given, and the limit if given.
        kept = {k: v for k, v in query.items() if v and not (dead and k == "status")}
        if "limit" in request.args:
            kept["limit"] = limit
        return _json({
            "table": entry.key,
            "filters": query,
            "jobs": [_listed(dict(row._mapping)) for row in page.rows],
            "next_before": page.next_before,
            "next": url_for(".dead" if dead else ".jobs", table=entry.key, **kept, before=str(page.next_before))
            if page.next_before is not None else None,
        })

    @route("/tables/<path:table>/jobs", "GET")
    def jobs(table: str) -> Response:
        return job_list(table, dead=False)

    @route("/tables/<path:table>/dead", "GET")
    def dead(table: str) -> Response:
        return job_list(table, dead=True)

    @route("/tables/<path:table>/jobs/<job_id>", "GET")
    def job(table: str, job_id: str) -> Response:
        entry = entry_of(table)
        key = _key(entry, job_id)
        view = _job_view(settings, entry, key)
        if view is None:
            _fail(404, "no_such_job", f"no job {job_id} in {entry.key}")
        values, lengths = view
        columns = entry.qt.table.c
        shown: dict[str, Any] = {}
        truncated: dict[str, Any] = {}
        for name, value in values.items():
            if name in lengths and value is not None:  # rendered as text by PostgreSQL, cut
                bound = _ERROR_VIEW if name == "last_error" else settings.truncate
                if lengths[name] > bound:
                    value = value[:bound]
                    truncated[name] = {
                        "length": lengths[name],
                        "value": url_for(".value", table=entry.key, job_id=job_id, column=name),
                    }
                elif isinstance(columns[name].type, JSON):
                    value = json.loads(value)
            shown[name] = value
        table_ = entry.qt.table
        kept = {role: column.name for role, column in (
            ("result", result_column(table_)), ("progress", progress_column(table_)),
            ("history", history_column(table_)),
        ) if column is not None}
        return _json({"table": entry.key, "id": key, "job": shown, "truncated": truncated, "reported": kept})

    @route("/tables/<path:table>/jobs/<job_id>/values/<column>", "GET")
    def value(table: str, job_id: str, column: str) -> Response:
        entry = entry_of(table)
        key = _key(entry, job_id)
        if column not in entry.qt.table.c:
            _fail(404, "no_such_column", f"{entry.key} has no column {column!r}")
        found, whole = _job_value(settings, entry, key, column)
        if not found:
            _fail(404, "no_such_job", f"no job {job_id} in {entry.key}")
        return _json({"table": entry.key, "id": key, "column": column, "value": whole})

    @route("/tables/<path:table>/workers", "GET")
    def workers(table: str) -> Response:
        entry = entry_of(table)
        engine = settings.engine
        gone_after = settings.lease or _DEFAULT_LEASE
        recorded = None
        if declared_workers_table(entry.qt.table) is not None:
            recorded = []
            for row in admin.registered_workers(engine, entry.model):
                seen = float(row.seen_ago or 0.0)
                recorded.append({**row._mapping, "seen_ago": seen, "gone": seen > gone_after})
        running = _running_jobs(engine, entry)
        return _json({
            "table": entry.key,
            "lease": settings.lease,
            "gone_after": gone_after,
            "recorded": recorded,
            "listening": [dataclasses.asdict(w) for w in admin.listening_workers(engine, entry.model)],
            "owners": [
                {**dataclasses.asdict(owner), "running": [dict(job) for job in running.get(owner.owner, [])]}
                for owner in admin.lease_owners(engine, entry.model, lease=settings.lease)
            ],
        })

    @route("/tables/<path:table>/workflows/<workflow_id>", "GET")
    def workflow(table: str, workflow_id: str) -> Response:
        entry = entry_of(table)
        found = parse_workflow_id(workflow_id)
        summary = workflow_summary(settings, entry, found) if found and has_workflows(entry.qt.table) else None
        if summary is None:
            _fail(404, "no_such_workflow", f"no workflow {workflow_id} in {entry.key}")
        after, limit = _page_arguments(entry, settings.page_size)
        jobs, next_after = workflow_jobs(settings, entry, summary.id, after=after, limit=limit)
        kept: dict[str, Any] = {"limit": limit} if "limit" in request.args else {}
        return _json({
            "table": entry.key, "workflow": summary.id, "policies": summary.policies, "total": summary.total,
            "done": summary.done, "waiting": summary.waiting, "counts": summary.counts,
            "jobs": [dataclasses.asdict(job) for job in jobs],
            "next_after": next_after,
            "next": url_for(".workflow", table=entry.key, workflow_id=str(summary.id), **kept, after=str(next_after))
            if next_after is not None else None,
        })

    @route("/tables/<path:table>/actions/<verb>", "POST")
    def action(table: str, verb: str) -> Response:
        if not writable:
            _fail(403, "read_only", _read_only_message(settings.read_only))
        expected = session.get(_TOKEN_KEY)
        given = request.headers.get(CSRF_HEADER, "")
        if not isinstance(expected, str) or not hmac.compare_digest(expected.encode(), given.encode()):
            _fail(403, "csrf", f"missing or wrong {CSRF_HEADER} header: read the token from GET {url_for('.csrf')}")
        if not request.is_json:
            _fail(415, "unsupported_media_type", "an action's body is JSON (Content-Type: application/json)")
        body = request.get_json(silent=True)
        if not isinstance(body, dict):
            _fail(400, "bad_body", "an action's body is a JSON object")
        if _has_nul(body):
            _fail(400, "bad_body", "a NUL character in the body")
        entry = entry_of(table)
        run = verbs.get(verb)
        if run is None:
            _fail(404, "no_such_action", f"no action {verb!r}: one of {', '.join(verbs)}")
        return _json({"table": entry.key, "action": verb, **run(settings, entry, body)})

    def unknown(rest: str) -> Response:
        _fail(404, "not_found", f"no endpoint {request.path}")

    if "api" not in settings.tables:  # else the pages of a table named api (/api/jobs, …) are these paths
        api.add_url_rule("/<path:rest>", "unknown", unknown, methods=_METHODS, provide_automatic_options=False)

    return api


_LIST_ARGUMENTS = ("queue", "status", "task", "error", "before", "limit")


def _list_arguments(entry: _Table, *, dead: bool, default_limit: int) -> tuple[admin.JobFilters, Any, int]:
    """The jobs page's filters, strictly: a status, a task filter, a key or a limit that
    cannot be is a 400 (the page leaves an unknown status out)."""
    args = request.args
    known = [a for a in _LIST_ARGUMENTS if not (dead and a == "status")]
    unknown = sorted(set(args) - set(known))
    if unknown:
        _fail(400, "bad_filter", f"unknown argument(s) {', '.join(unknown)}: the filters are {', '.join(known)}")
    statuses = _split(args.getlist("status"))
    wrong = [s for s in statuses if s not in _STATUSES]
    if wrong:
        _fail(400, "bad_filter", f"no status {', '.join(wrong)}: one of {', '.join(_STATUSES)}")
    tasks = _split(args.getlist("task"))
    if tasks and not entry.has_task:
        _fail(400, "bad_filter", f"{entry.key} has no task column to filter on")
    filters = admin.JobFilters(
        queues=_split(args.getlist("queue")),
        statuses=("failed",) if dead else statuses,
        tasks=tasks,
        error_contains=args.get("error") or None,
    )
    before = args.get("before")
    key = _key(entry, before, status=400, kind="bad_filter") if before else None
    return filters, key, _limit_argument(default_limit)


def _page_arguments(entry: _Table, default_limit: int) -> tuple[Any, int]:
    """A workflow's page: ``after`` (a key) and ``limit``, strictly."""
    args = request.args
    unknown = sorted(set(args) - {"after", "limit"})
    if unknown:
        _fail(400, "bad_filter", f"unknown argument(s) {', '.join(unknown)}: a workflow's are after, limit")
    after = args.get("after")
    return (_key(entry, after, status=400, kind="bad_filter") if after else None), _limit_argument(default_limit)


def _limit_argument(default_limit: int) -> int:
    """``limit`` of a list, strictly: a whole number from 1 to the most a page holds."""
    try:
        limit = int(request.args.get("limit", default_limit))
    except ValueError:
        limit = 0
    if not 1 <= limit <= _MAX_LIMIT:
        _fail(400, "bad_filter", f"limit is a whole number from 1 to {_MAX_LIMIT}")
    return limit


def _listed(row: Mapping[str, Any]) -> dict[str, Any]:
    """A list's row: its columns, and a payload and an error as what the list reads of
    them (:func:`.reads._list_columns`): a preview when small enough (the start of a
    payload, the end of an error), and the stored size."""
    shown = {name: value for name, value in row.items() if not name.endswith("_bytes")}
    for name in ("last_error", "payload"):
        if f"{name}_bytes" in row:
            size = row[f"{name}_bytes"]
            shown[name] = None if size is None else {"preview": row[name], "bytes": int(size)}
    return shown


def _key(entry: _Table, value: str, *, status: int = 404, kind: str = "no_such_job") -> Any:
    """A job key from the URL or a body, as its column holds it; ``status`` when no job
    can have it (a key beyond the column's integers, not a UUID)."""
    try:
        return _job_id(entry, value)
    except NotFound:
        _fail(status, kind, f"not a job id of {entry.key}: {value!r}")


def _read_only_message(read_only: bool) -> str:
    if read_only:
        return "the dashboard is read-only"
    return "the API is read-only: make the dashboard with api_actions=True (--api-actions) to allow actions"


def _has_nul(value: Any) -> bool:
    """A NUL character anywhere in a JSON value: no text column holds one."""
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any(_has_nul(k) or _has_nul(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_nul(v) for v in value)
    return False


# --- actions: each takes the body, runs what the page's button runs, and says what changed


def _ids(entry: _Table, body: Mapping[str, Any]) -> list[Any]:
    ids = body.get("ids")
    if not isinstance(ids, list) or not ids:
        _fail(400, "bad_body", '"ids" is a non-empty list of job ids')
    if len(ids) > _MAX_IDS:
        _fail(400, "bad_body", f"at most {_MAX_IDS} ids in one action")
    keys = []
    for value in ids:
        if isinstance(value, bool) or not isinstance(value, int | str):
            _fail(400, "bad_body", f"not a job id: {value!r}")
        keys.append(_key(entry, str(value), status=400, kind="bad_body"))
    return list(dict.fromkeys(keys))


def _names(body: Mapping[str, Any], field: str) -> list[str] | None:
    """A filter of names: a list of strings, or one string of comma-separated names."""
    value = body.get(field)
    if value is None:
        return None
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        _fail(400, "bad_body", f'"{field}" is a list of names')
    return list(_split(value)) or None


def _queue(body: Mapping[str, Any]) -> str:
    queue = body.get("queue")
    try:
        check_queue(queue)
    except ValueError as exc:
        _fail(400, "bad_body", str(exc))
    assert isinstance(queue, str)
    return queue


def _requeue(settings: _Settings, entry: _Table, body: Mapping[str, Any]) -> dict[str, Any]:
    ids = _ids(entry, body)
    return {"requested": len(ids), "requeued": admin.requeue(settings.engine, entry.model, ids=ids)}


def _cancel(settings: _Settings, entry: _Table, body: Mapping[str, Any]) -> dict[str, Any]:
    ids = _ids(entry, body)
    return {"requested": len(ids), "cancelled": admin.cancel_jobs(settings.engine, entry.model, ids=ids)}


def _delete(settings: _Settings, entry: _Table, body: Mapping[str, Any]) -> dict[str, Any]:
    ids = _ids(entry, body)
    free_keys = body.get("free_keys", False)
    if not isinstance(free_keys, bool):
        _fail(400, "bad_body", '"free_keys" is true or false')
    chosen = admin.JobFilters(ids=tuple(ids))
    deleted = admin.delete_jobs(settings.engine, entry.model, chosen, free_keys=free_keys)
    kept = 0 if free_keys else admin.key_holders(settings.engine, entry.model, chosen)
    # Deleting a finished job that holds its unique key lets the same work run again:
    # kept unless asked again with "free_keys": true, as the page asks first.
    return {"requested": len(ids), "deleted": deleted, "kept_holding_keys": kept}


def _requeue_matching(settings: _Settings, entry: _Table, body: Mapping[str, Any]) -> dict[str, Any]:
    error = body.get("error")
    if error is not None and not isinstance(error, str):
        _fail(400, "bad_body", '"error" is a text')
    tasks = _names(body, "task")
    if tasks and not entry.has_task:
        _fail(400, "bad_body", f"{entry.key} has no task column to filter on")
    count = admin.requeue(settings.engine, entry.model, queues=_names(body, "queue"), tasks=tasks,
                          error_contains=error or None)
    return {"requeued": count}


def _pause_or_resume(pause: bool) -> Action:
    def run(settings: _Settings, entry: _Table, body: Mapping[str, Any]) -> dict[str, Any]:
        if not entry.pausable:
            _fail(400, "not_pausable",
                  f"{entry.key} has no queues table (sqla_queue.queues_table): its queues cannot be paused")
        queue = _queue(body)
        change = admin.pause_queues if pause else admin.resume_queues
        ((_, changed),) = change(settings.engine, entry.model, [queue])
        return {"queue": queue, "paused": pause, "changed": changed}

    return run


def _limit(settings: _Settings, entry: _Table, body: Mapping[str, Any]) -> dict[str, Any]:
    queue = _queue(body)
    limits = {name: body.get(name) for name in ("concurrency", "rate")}
    for name, limit in limits.items():
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)):
            _fail(400, "bad_body", f'"{name}" is a whole number, or null for the model\'s')
    try:
        admin.set_queue_limits(settings.engine, entry.model, [queue], **limits)
    except (ValueError, QueuesTableNotDeclared) as exc:
        _fail(400, "bad_body", str(exc))
    return {"queue": queue, **limits}


def _cancel_workflow(settings: _Settings, entry: _Table, body: Mapping[str, Any]) -> dict[str, Any]:
    if not has_workflows(entry.qt.table):
        _fail(400, "bad_body", f"{entry.key} keeps no workflows")
    value = body.get("workflow")
    workflow = parse_workflow_id(value) if isinstance(value, str) else None
    if workflow is None:
        _fail(400, "bad_body", '"workflow" is a workflow\'s id (a UUID)')
    return {"workflow": workflow, "cancelled": len(admin.cancel(settings.engine, entry.model, workflow=workflow))}


#: Every action of the dashboard's action endpoint, by the name its form sends.
_ACTIONS: dict[str, Action] = {
    "requeue": _requeue,
    "cancel": _cancel,
    "delete": _delete,
    "requeue_matching": _requeue_matching,
    "pause": _pause_or_resume(True),
    "resume": _pause_or_resume(False),
    "limit": _limit,
    "cancel_workflow": _cancel_workflow,
}


# --- JSON


def _json(data: Any, status: int = 200) -> Response:
    text = json.dumps(_plain(data), ensure_ascii=False)
    for char, escaped in _ESCAPES:
        text = text.replace(char, escaped)  # only inside strings: no JSON syntax uses them
    return Response(text, status=status, mimetype="application/json")


def _plain(value: Any) -> Any:
    """``value`` as JSON holds it: datetimes in ISO 8601, durations in seconds, UUIDs and
    decimals as strings (exact), bytes in base64, anything else unknown as its text."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, datetime | date | time):
        return value.isoformat()
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, uuid.UUID | Decimal):
        return str(value)
    if isinstance(value, Enum):
        return _plain(value.value)
    if isinstance(value, Mapping):
        return {k if isinstance(k, str) else str(_plain(k)): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_plain(v) for v in value]
    if isinstance(value, bytes | bytearray | memoryview):
        return base64.b64encode(bytes(value)).decode("ascii")
    return str(value)
