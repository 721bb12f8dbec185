"""The web dashboard: a Flask blueprint over one or more queue tables.

Mount it in your own app, behind your own authentication::

    from sqla_queue.dashboard import dashboard_blueprint

    app.register_blueprint(
        dashboard_blueprint(engine, [EmailJob, Task], auth=lambda: current_user.is_admin),
        url_prefix="/queue",
    )

or run it on its own: ``sqla-queue dashboard myapp.jobs:worker`` (127.0.0.1 only).

A server with no login of its own on 127.0.0.1 is still reachable from any web page the
local user opens, by DNS rebinding (the page's own name made to point at 127.0.0.1): so
the stand-alone app answers only requests whose ``Host`` is one of its own names
(``trusted_hosts``, 400 otherwise), and every POST must come from a page of the same
origin (``Origin``, or failing it ``Referer``). Mounted in your app, pass
``trusted_hosts=`` (or set Flask's ``TRUSTED_HOSTS``) for the same ``Host`` check; the
``Origin`` check is always on, and your ``auth`` is the login.

Server-rendered (Jinja templates shipped in the package), the overview's charts too (SVG):
the Content-Security-Policy of every page forbids scripts, so even a template mistake
cannot run a payload's ``<script>``. The one exception is the overview with live refresh
turned on (``?live=5``), whose policy allows the dashboard's own script file and no other
(never an inline script; :mod:`sqla_queue.dashboard.charts`). Every action is a POST
carrying a CSRF token kept in Flask's session, and runs the same fenced statements as
``sqla-queue requeue|delete`` and the cancel of :func:`sqla_queue.admin.cancel_jobs`.
"""

from __future__ import annotations

import hmac
import json
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import urlsplit

from flask import (
    Blueprint,
    Flask,
    Response,
    abort,
    current_app,
    flash,
    redirect,
    render_template,
    request,
    session,
    url_for,
)
from sqlalchemy import Engine

from .. import admin
from .. import sql as q
from ..errors import QueuesTableNotDeclared
from ..flow import declared_queues_table
from ..model import (
    JobStatus,
    QueueTable,
    check_queue,
    flow_rules,
    history_column,
    progress_column,
    queue_table,
    result_column,
)
from ..periodic import Schedule
from ..registry import declared_workers_table
from ..rules import Concurrency, RateLimit
from .api import api_blueprint
from .api_more import more_endpoints
from .bulk import add_bulk_views
from .charts import add_overview_views, overview_page
from .reads import (
    _DEFAULT_LEASE,
    _ERROR_VIEW,
    _as_text,
    _attempt,
    _job_id,
    _job_view,
    _list_page,
    _running_jobs,
    _split,
)
from .schedules import add_schedule_views
from .workflows import add_workflow_views, job_workflow

__all__ = ["LOOPBACK_HOSTS", "Auth", "create_app", "dashboard_blueprint", "serve"]

#: The names of this machine a browser uses to reach a server bound to a loopback
#: address: what the stand-alone dashboard trusts by default.
LOOPBACK_HOSTS: tuple[str, ...] = ("localhost", "127.0.0.1", "::1")

#: Called before every request of the dashboard: a true value lets it through, a Flask
#: response (a redirect to your login page) is returned as it is, anything else is a 403.
Auth = Callable[[], Any]

_CSRF_KEY = "sqla_queue_dashboard_csrf"
_CSP = (
    "default-src 'none'; style-src 'unsafe-inline'; img-src 'self' data:; form-action 'self'; "
    "frame-ancestors 'none'; base-uri 'none'"
)
_ACTIONS = ("requeue", "cancel", "delete", "requeue_matching", "pause", "resume", "limit")
_STATUSES = frozenset(s.value for s in JobStatus)


@dataclass(frozen=True)
class _Table:
    key: str
    model: Any
    qt: QueueTable

    @property
    def has_task(self) -> bool:
        return "task" in self.qt.c

    @property
    def has_payload(self) -> bool:
        return "payload" in self.qt.c

    @property
    def pausable(self) -> bool:
        """Whether its queues can be paused: it has a declared queues table."""
        return declared_queues_table(self.qt.table) is not None

    @property
    def queue_rules(self) -> tuple[Concurrency | None, RateLimit | None]:
        """The model's rules on the queue (``key="queue"``), whose limits a queue can
        replace at run time when the table has a queues table."""
        rules = flow_rules(self.qt.table) if self.pausable else ()
        return (
            next((r for r in rules if isinstance(r, Concurrency) and r.key == "queue"), None),
            next((r for r in rules if isinstance(r, RateLimit) and r.key == "queue"), None),
        )


class _Settings:
    def __init__(
        self,
        engine: Engine | Callable[[], Engine],
        models: Sequence[Any],
        *,
        read_only: bool,
        lease: float | None,
        page_size: int,
        truncate: int,
        trusted_hosts: Sequence[str] | None = None,
    ) -> None:
        if isinstance(models, (str, bytes)) or not models:
            raise ValueError("the dashboard needs at least one queue model")
        if page_size < 1 or truncate < 1:
            raise ValueError("page_size and truncate must be at least 1")
        self._engine = engine
        self.tables: dict[str, _Table] = {}
        for model in models:
            qt = queue_table(model)
            key = qt.table.fullname
            if key in self.tables:
                raise ValueError(f"table {key!r} is given twice")
            self.tables[key] = _Table(key, model, qt)
        self.read_only = read_only
        self.lease = lease
        self.page_size = page_size
        self.truncate = truncate
        self.trusted_hosts = _trusted_hosts(trusted_hosts)

    @property
    def engine(self) -> Engine:
        engine = self._engine
        return engine if isinstance(engine, Engine) else engine()

    def table(self, key: str) -> _Table:
        try:
            return self.tables[key]
        except KeyError:
            abort(404)


def dashboard_blueprint(
    engine: Engine | Callable[[], Engine],
    models: Sequence[Any],
    *,
    auth: Auth | None,
    read_only: bool = False,
    lease: float | None = None,
    page_size: int = 50,
    truncate: int = 2000,
    name: str = "sqla_queue_dashboard",
    trusted_hosts: Sequence[str] | None = None,
    api_actions: bool = False,
    schedules: Mapping[Any, Sequence[Schedule]] | None = None,
) -> Blueprint:
    """The dashboard as a blueprint to register in your app (``url_prefix`` of your choice).

    ``engine``: an Engine, or a function returning one (Flask-SQLAlchemy's ``lambda:
    db.engine``). ``auth`` is required so that leaving it out is a decision: ``None``
    only when something in front of the app already restricts who reaches it.
    ``read_only`` hides and refuses every action. ``lease``: your workers' lease
    (seconds), to show their last heartbeat. Values longer than ``truncate`` characters
    are cut, with a link to the full value. The app needs a ``secret_key``: the CSRF
    token lives in its session.

    ``trusted_hosts``: the names the dashboard is reached by (``Host``; ``.example.com``
    also takes its subdomains); a request naming another gets a 400, before ``auth``
    runs. ``None`` leaves the ``Host`` check to your app (Flask's ``TRUSTED_HOSTS``).
    Whatever it is, a POST whose ``Origin`` (or ``Referer``) is not the request's own
    host is refused with a 400: behind a proxy, pass the original ``Host`` on (or use
    Werkzeug's ``ProxyFix``).

    The JSON API under ``/api/`` (:mod:`sqla_queue.dashboard.api`) reads what the pages
    do; its actions are refused unless ``api_actions=True`` (and not ``read_only``).

    ``schedules``: the periodic schedules your workers run, by model (a worker's
    ``schedules``): its schedules page tells those in the code from watermark rows only,
    and runs them now. A model left out shows its rows only (the code unknown).
    """
    settings = _Settings(
        engine, models, read_only=read_only, lease=lease, page_size=page_size, truncate=truncate,
        trusted_hosts=trusted_hosts,
    )
    bp = Blueprint(name, __name__, template_folder="templates")
    api = api_blueprint(settings, actions=api_actions, more=lambda ctx: more_endpoints(ctx, schedules))
    bp.register_blueprint(api, url_prefix="/api")  # under every check of bp

    @bp.before_request
    def _authorize() -> Any:
        _check_request(settings.trusted_hosts)
        if auth is not None:
            verdict = auth()
            if isinstance(verdict, Response):
                return verdict
            if not verdict:
                abort(403)
        if not current_app.secret_key:
            raise RuntimeError("the dashboard keeps its CSRF token in Flask's session: set app.secret_key")
        return None

    @bp.after_request
    def _headers(response: Response) -> Response:
        response.headers.setdefault("Content-Security-Policy", _CSP)
        response.headers["X-Content-Type-Options"] = "nosniff"
        response.headers["Referrer-Policy"] = "same-origin"
        response.headers["Cache-Control"] = "no-store"
        return response

    @bp.context_processor
    def _context() -> dict[str, Any]:
        return {
            "tables": list(settings.tables.values()),
            "read_only": settings.read_only,
            "csrf_token": _csrf_token,
            "page": _page_url,
            "short": _short,
            "last_line": _last_line,
            "age": _age,
            "when": _when,
            "size": _size,
        }

    @bp.get("/")
    def overview() -> Response:
        return overview_page(settings)

    @bp.get("/<path:table>/jobs")
    def jobs(table: str) -> str:
        return _jobs_page(settings, settings.table(table), dead=False)

    @bp.get("/<path:table>/dead")
    def dead(table: str) -> str:
        return _jobs_page(settings, settings.table(table), dead=True)

    @bp.get("/<path:table>/job/<job_id>")
    def job(table: str, job_id: str) -> str:
        entry = settings.table(table)
        view = _job_view(settings, entry, _job_id(entry, job_id))
        if view is None:
            abort(404)
        values, lengths = view
        pk = entry.qt.pk.name
        cells = [
            (name, _full(values[name]), values[name] is None, lengths.get(name, len(_full(values[name]))))
            for name in [pk, *(n for n in values if n != pk)]
        ]
        # What the job reports, shown first, on a table that keeps it: (heading, column).
        table_ = entry.qt.table
        reported = [
            (heading, column.name)
            for heading, column in (("Result", result_column(table_)), ("Progress", progress_column(table_)))
            if column is not None
        ]
        kept = history_column(table_)
        history = None
        if kept is not None:
            history = [_attempt(e) for e in reversed(values.get(kept.name) or []) if isinstance(e, dict)]
            cells = [c for c in cells if c[0] != kept.name]
        return render_template(
            "sqla_queue_dashboard/job.html",
            table=entry,
            row=values,
            job_id=job_id,
            cells=[c for c in cells if c[0] not in {name for _, name in reported}],
            reported=[(heading, c) for heading, name in reported for c in cells if c[0] == name],
            history=history,
            limit=settings.truncate,
            error_length=lengths.get("last_error", 0),
            error_limit=_ERROR_VIEW,
            workflow=job_workflow(settings, entry, values),
        )

    @bp.get("/<path:table>/job/<job_id>/raw/<column>")
    def raw(table: str, job_id: str, column: str) -> Response:
        entry = settings.table(table)
        key = _job_id(entry, job_id)
        if column not in entry.qt.table.c:
            abort(404)
        shown = _as_text(entry.qt.table.c[column])
        if shown is not None:  # rendered by PostgreSQL, as the job page shows it
            with settings.engine.connect() as conn:
                found = conn.execute(q.get_job(entry.model, key).with_only_columns(shown)).first()
            if found is None:
                abort(404)
            text = found[0] or ""
        else:
            row = admin.get_job(settings.engine, entry.model, key)
            if row is None:
                abort(404)
            text = _full(row._mapping[column])
        # text/plain with nosniff: the browser shows the value, never renders it.
        return Response(text, mimetype="text/plain")

    @bp.get("/<path:table>/workers")
    def workers(table: str) -> str:
        entry = settings.table(table)
        engine = settings.engine
        owners = admin.lease_owners(engine, entry.model, lease=settings.lease)
        declared = declared_workers_table(entry.qt.table) is not None
        recorded = admin.registered_workers(engine, entry.model) if declared else None
        return render_template(
            "sqla_queue_dashboard/workers.html", table=entry, owners=owners, lease=settings.lease,
            recorded=recorded, gone_after=settings.lease or _DEFAULT_LEASE,
            listening=admin.listening_workers(engine, entry.model), running=_running_jobs(engine, entry),
        )

    @bp.post("/<path:table>/action")
    def action(table: str) -> Any:
        entry = settings.table(table)
        if settings.read_only:
            abort(403, "the dashboard is read-only")
        _check_csrf()
        verb = request.form.get("action", "")
        if verb not in _ACTIONS:
            abort(400, f"unknown action {verb!r}")
        ids = [_job_id(entry, value) for value in request.form.getlist("id")]
        if verb in ("pause", "resume"):
            if not entry.pausable:
                abort(400, "this table has no queues table (sqla_queue.queues_table): its queues cannot be paused")
            queue = request.form.get("queue", "")
            try:
                check_queue(queue)
            except ValueError as exc:
                abort(400, str(exc))
            change = admin.pause_queues if verb == "pause" else admin.resume_queues
            ((_, changed),) = change(settings.engine, entry.model, [queue])
            done = "paused" if verb == "pause" else "resumed"
            flash(f"{done} queue {queue}" if changed else f"queue {queue} was {done} already", "ok")
            return redirect(url_for(".overview"))
        if verb == "limit":
            queue = request.form.get("queue", "")
            try:
                check_queue(queue)
                limits = {name: _limit_field(request.form.get(name, "")) for name in ("concurrency", "rate")}
                admin.set_queue_limits(settings.engine, entry.model, [queue], **limits)
            except (ValueError, QueuesTableNotDeclared) as exc:
                abort(400, str(exc))
            shown = ", ".join(f"{name} {'the model default' if n is None else n}" for name, n in limits.items())
            flash(f"limits of queue {queue}: {shown}", "ok")
            return redirect(url_for(".overview"))
        if verb == "requeue_matching":
            # Every dead letter the dead-letter page's filter shows, on every page of it.
            form = request.form
            count = admin.requeue(
                settings.engine,
                entry.model,
                queues=list(_split(form.getlist("queue"))) or None,
                tasks=(list(_split(form.getlist("task"))) or None) if entry.has_task else None,
                error_contains=form.get("error") or None,
            )
            flash(f"requeued {count} dead-lettered job(s) matching the filter", "ok")
        elif not ids:
            flash("select at least one job", "error")
        else:
            engine = settings.engine
            if verb == "requeue":
                count = admin.requeue(engine, entry.model, ids=ids)
                flash(f"requeued {count} of {len(ids)} job(s) (only dead letters are requeued)", "ok")
            elif verb == "cancel":
                count = admin.cancel_jobs(engine, entry.model, ids=ids)
                flash(f"cancelled {count} of {len(ids)} job(s) (finished ones stay as they are)", "ok")
            else:
                chosen = admin.JobFilters(ids=tuple(ids))
                free_keys = request.form.get("free_keys") == "1"
                count = admin.delete_jobs(engine, entry.model, chosen, free_keys=free_keys)
                flash(f"deleted {count} of {len(ids)} job(s) (running jobs are never deleted)", "ok")
                kept = 0 if free_keys else admin.key_holders(engine, entry.model, chosen)
                if kept:
                    # Deleting these frees their keys, so the work could run again: ask first.
                    return render_template(
                        "sqla_queue_dashboard/confirm_free_keys.html",
                        table=entry, ids=request.form.getlist("id"), kept=kept, back=_back(entry),
                    )
        return redirect(_back(entry))

    def _guard() -> None:
        """What every action checks, besides the Host and Origin of every request."""
        if settings.read_only:
            abort(403, "the dashboard is read-only")
        _check_csrf()

    add_schedule_views(bp, settings, schedules, guard=_guard)
    add_overview_views(bp, settings)
    add_bulk_views(bp, settings, guard=_guard, split=_split, statuses=_STATUSES)
    add_workflow_views(bp, settings, guard=_guard)
    return bp


def _trusted_hosts(hosts: Sequence[str] | None) -> tuple[str, ...] | None:
    """``hosts`` lower-cased, without brackets or ports; ValueError when one is no name."""
    if hosts is None:
        return None
    if isinstance(hosts, (str, bytes)):
        raise ValueError("trusted_hosts is a list of names, not one string")
    names = []
    for host in hosts:
        dot = host.startswith(".")
        name = _hostname(host[1:] if dot else host)
        if name is None:
            raise ValueError(f"not a host name: {host!r}")
        names.append("." + name if dot else name)
    if not names:
        raise ValueError("trusted_hosts needs at least one name (None: no Host check)")
    return tuple(names)


def _hostname(netloc: str) -> str | None:
    """The host of ``host[:port]`` (an IPv6 address in brackets or bare), lower-cased."""
    if not netloc or any(c in netloc for c in "/?#@\\ \t\r\n\x00"):
        return None
    if netloc.count(":") > 1 and not netloc.startswith("["):
        netloc = f"[{netloc}]"  # a bare IPv6 address
    try:
        parts = urlsplit("//" + netloc)
        parts.port  # noqa: B018  (raises ValueError on a bad port)
    except ValueError:
        return None
    return parts.hostname or None


def _host_trusted(netloc: str, trusted: Sequence[str]) -> bool:
    host = _hostname(netloc)
    if host is None:
        return False
    return any(host == name or (name.startswith(".") and (host == name[1:] or host.endswith(name)))
               for name in trusted)


def _check_request(trusted: Sequence[str] | None) -> None:
    """Refuse what DNS rebinding and cross-site posts send, and values no column holds.

    A ``Host`` outside ``trusted`` is a page of another site that resolved its own name
    to this server. A POST must come from one of the dashboard's own pages: its
    ``Origin`` (every browser sends one on a POST; ``Referer`` where it does not) names
    the request's own host. A NUL character fits in no text column: refused here rather
    than by PostgreSQL halfway through a request.
    """
    if trusted is not None and not _host_trusted(request.host, trusted):
        abort(400, "this dashboard is not served under that host name")
    if request.method == "POST":
        source = request.headers.get("Origin") or request.headers.get("Referer")
        origin = urlsplit(source) if source else None
        if origin is None or origin.scheme not in ("http", "https") or origin.netloc.lower() != request.host.lower():
            abort(400, "this action did not come from a page of the dashboard")
    fields = [*request.args.lists(), *(request.form.lists() if request.method == "POST" else ())]
    if "\x00" in request.path or any("\x00" in key or any("\x00" in v for v in values) for key, values in fields):
        abort(400, "a NUL character in the request")


def _jobs_page(settings: _Settings, entry: _Table, *, dead: bool) -> str:
    args = request.args
    statuses = ("failed",) if dead else tuple(s for s in _split(args.getlist("status")) if s in _STATUSES)
    filters = admin.JobFilters(
        queues=_split(args.getlist("queue")),
        statuses=statuses,
        tasks=_split(args.getlist("task")) if entry.has_task else (),
        error_contains=args.get("error") or None,
    )
    before = args.get("before")
    page = _list_page(settings, entry, filters, before=_job_id(entry, before) if before else None,
                      limit=settings.page_size)
    pk = entry.qt.pk.name
    query = {"queue": ",".join(filters.queues), "task": ",".join(filters.tasks), "error": filters.error_contains or ""}
    if not dead:
        query["status"] = ",".join(filters.statuses)
    kept: dict[str, Any] = {key: value for key, value in query.items() if value}
    endpoint = ".dead" if dead else ".jobs"
    next_url = (
        url_for(endpoint, table=entry.key, **kept, before=str(page.next_before))
        if page.next_before is not None else None
    )
    return render_template(
        "sqla_queue_dashboard/jobs.html",
        table=entry,
        dead=dead,
        filters=filters,
        rows=[row._mapping for row in page.rows],
        pk=pk,
        statuses=[s.value for s in JobStatus],
        next_url=next_url,
        first_url=url_for(endpoint, table=entry.key, **kept) if before else None,
        here=request.full_path,
    )


def _back(entry: _Table) -> str:
    """Where an action returns to: the page it was sent from, if it is one of ours."""
    target = request.form.get("next", "")
    prefix = url_for(".overview")
    if target.startswith(prefix) and not target.startswith("//") and "\\" not in target:
        return target
    return url_for(".jobs", table=entry.key)


def _csrf_token() -> str:
    token = session.get(_CSRF_KEY)
    if not isinstance(token, str):
        token = secrets.token_urlsafe(32)
        session[_CSRF_KEY] = token
    return token


def _check_csrf() -> None:
    expected = session.get(_CSRF_KEY)
    given = request.form.get("csrf_token", "")
    if not isinstance(expected, str) or not hmac.compare_digest(expected.encode(), given.encode()):
        abort(400, "missing or wrong CSRF token: reload the page and try again")


def _page_url(endpoint: str, table: _Table, **args: Any) -> str:
    return url_for(endpoint, table=table.key, **args)


def _full(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, Mapping | list):
        return json.dumps(value, indent=2, ensure_ascii=False, default=str)
    if isinstance(value, datetime):
        return value.isoformat(sep=" ")
    return str(value)


def _short(value: Any, width: int = 80) -> str:
    text = " ".join(_full(value).split())
    return text if len(text) <= width else text[: width - 1] + "…"


def _last_line(value: str | None, width: int = 100) -> str:
    """An error's last line (the exception and its message, under the traceback)."""
    lines = [line for line in (value or "").strip().splitlines() if line.strip()]
    return _short(lines[-1], width) if lines else ""


def _size(stored: int | None) -> str:
    """A stored size, for a value too big to preview in a list."""
    value = float(stored or 0)
    for unit in ("bytes", "kB", "MB"):
        if value < 1024 or unit == "MB":
            return f"{value:.0f} {unit}" if unit == "bytes" else f"{value:.1f} {unit}"
        value /= 1024
    return ""


def _when(value: datetime | None) -> str:
    return "-" if value is None else value.isoformat(sep=" ", timespec="seconds")


def _age(value: timedelta | None) -> str:
    return admin._age(value)


def create_app(
    engine: Engine | Callable[[], Engine],
    models: Sequence[Any],
    *,
    read_only: bool = False,
    lease: float | None = None,
    auth: Auth | None = None,
    secret_key: str | None = None,
    page_size: int = 50,
    trusted_hosts: Sequence[str] = LOOPBACK_HOSTS,
    api_actions: bool = False,
    schedules: Mapping[Any, Sequence[Schedule]] | None = None,
) -> Flask:
    """A Flask app serving only the dashboard, at ``/``: what ``sqla-queue dashboard``
    runs. A random ``secret_key`` unless given (sessions, hence CSRF tokens, last as long
    as the process). Only requests naming one of ``trusted_hosts`` are answered (by
    default this machine's loopback names: see the module's docstring)."""
    app = Flask("sqla_queue.dashboard")
    app.secret_key = secret_key or secrets.token_hex(32)
    app.config["SESSION_COOKIE_SAMESITE"] = "Strict"
    app.register_blueprint(
        dashboard_blueprint(
            engine, models, auth=auth, read_only=read_only, lease=lease, page_size=page_size,
            trusted_hosts=trusted_hosts, api_actions=api_actions, schedules=schedules,
        )
    )
    return app


def serve(
    engine: Engine,
    models: Sequence[Any],
    *,
    host: str = "127.0.0.1",
    port: int = 8787,
    read_only: bool = False,
    lease: float | None = None,
    ready: Callable[[str], None] | None = None,
    trusted_hosts: Sequence[str] | None = None,
    api_actions: bool = False,
    schedules: Mapping[Any, Sequence[Schedule]] | None = None,
) -> None:
    """Serve :func:`create_app` with Werkzeug's threaded server until interrupted; prints
    (or passes to ``ready``) the address once it listens (``port=0``: a free port).

    ``trusted_hosts``: the names browsers reach it by; by default the loopback names on
    a loopback address, else ``host`` itself. On every address (``0.0.0.0``, ``::``)
    they must be given: ValueError otherwise."""
    from werkzeug.serving import make_server

    app = create_app(
        engine, models, read_only=read_only, lease=lease, trusted_hosts=served_hosts(host, trusted_hosts),
        api_actions=api_actions,
        schedules=schedules,
    )
    server = make_server(host, port, app, threaded=True)
    shown = f"[{host}]" if ":" in host else host
    address = f"http://{shown}:{server.server_port}/"
    if ready is not None:
        ready(address)
    else:
        print(f"sqla_queue dashboard on {address} (Ctrl-C to stop)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


def served_hosts(host: str, trusted_hosts: Sequence[str] | None = None) -> tuple[str, ...]:
    """The names a dashboard bound to ``host`` answers to: ``trusted_hosts`` when given,
    else this machine's loopback names for a loopback address, else ``host`` itself.
    ValueError for a wildcard address without ``trusted_hosts`` (no name to trust)."""
    if trusted_hosts is not None:
        names = _trusted_hosts(trusted_hosts)
        assert names is not None
        return names
    bare = host.strip("[]").lower()
    if bare in ("", "0.0.0.0", "::"):
        raise ValueError(
            f"the dashboard listens on every address ({host or '*'}): name the hosts it is reached by "
            "(trusted_hosts, --trusted-host)"
        )
    if bare in LOOPBACK_HOSTS or bare.startswith("127."):
        return LOOPBACK_HOSTS if bare in LOOPBACK_HOSTS else (*LOOPBACK_HOSTS, bare)
    names = _trusted_hosts([bare])
    assert names is not None
    return names


def _limit_field(value: str) -> int | None:
    """A limit from the form: blank is the model's (None), else a whole number."""
    value = value.strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"a limit must be a whole number, got {value!r}") from None
