"""The web dashboard: a Flask blueprint over one or more queue tables.

Mount it in your own app, behind your own authentication::

    from sqla_queue.dashboard import dashboard_blueprint

    app.register_blueprint(
        dashboard_blueprint(engine, [EmailJob, Task], auth=lambda: current_user.is_admin),
        url_prefix="/queue",
    )

or run it on its own: ``sqla-queue dashboard myapp.jobs:worker`` (127.0.0.1 only).

Server-rendered (Jinja templates shipped in the package), no JavaScript at all: the
Content-Security-Policy of every page forbids scripts, so even a template mistake cannot
run a payload's ``<script>``. Every action is a POST carrying a CSRF token kept in Flask's
session, and runs the same fenced statements as ``sqla-queue requeue|delete`` and the
cancel of :func:`sqla_queue.admin.cancel_jobs`.
"""

from __future__ import annotations

import hmac
import json
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

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
from ..model import JobStatus, QueueTable, queue_table

__all__ = ["Auth", "create_app", "dashboard_blueprint", "serve"]

#: Called before every request of the dashboard: a true value lets it through, a Flask
#: response (a redirect to your login page) is returned as it is, anything else is a 403.
Auth = Callable[[], Any]

_CSRF_KEY = "sqla_queue_dashboard_csrf"
_CSP = (
    "default-src 'none'; style-src 'unsafe-inline'; img-src 'self' data:; form-action 'self'; "
    "frame-ancestors 'none'; base-uri 'none'"
)
_ACTIONS = ("requeue", "cancel", "delete", "requeue_matching")
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
) -> Blueprint:
    """The dashboard as a blueprint to register in your app (``url_prefix`` of your choice).

    ``engine``: an Engine, or a function returning one (Flask-SQLAlchemy's ``lambda:
    db.engine``). ``auth`` is required so that leaving it out is a decision: ``None``
    only when something in front of the app already restricts who reaches it.
    ``read_only`` hides and refuses every action. ``lease``: your workers' lease
    (seconds), to show their last heartbeat. Values longer than ``truncate`` characters
    are cut, with a link to the full value. The app needs a ``secret_key``: the CSRF
    token lives in its session.
    """
    settings = _Settings(engine, models, read_only=read_only, lease=lease, page_size=page_size, truncate=truncate)
    bp = Blueprint(name, __name__, template_folder="templates")

    @bp.before_request
    def _authorize() -> Any:
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
        }

    @bp.get("/")
    def overview() -> str:
        engine = settings.engine
        sections = [(table, admin.queue_overview(engine, table.model)) for table in settings.tables.values()]
        return render_template(
            "sqla_queue_dashboard/overview.html",
            sections=sections,
            statuses=[s.value for s in JobStatus],
            chart=_chart,
        )

    @bp.get("/<path:table>/jobs")
    def jobs(table: str) -> str:
        return _jobs_page(settings, settings.table(table), dead=False)

    @bp.get("/<path:table>/dead")
    def dead(table: str) -> str:
        return _jobs_page(settings, settings.table(table), dead=True)

    @bp.get("/<path:table>/job/<job_id>")
    def job(table: str, job_id: str) -> str:
        entry = settings.table(table)
        row = admin.get_job(settings.engine, entry.model, _job_id(entry, job_id))
        if row is None:
            abort(404)
        pk = entry.qt.pk.name
        values = row._mapping
        cells = [(name, _full(values[name]), values[name] is None) for name in [pk, *(n for n in values if n != pk)]]
        return render_template(
            "sqla_queue_dashboard/job.html",
            table=entry,
            row=row._mapping,
            job_id=job_id,
            cells=cells,
            limit=settings.truncate,
        )

    @bp.get("/<path:table>/job/<job_id>/raw/<column>")
    def raw(table: str, job_id: str, column: str) -> Response:
        entry = settings.table(table)
        row = admin.get_job(settings.engine, entry.model, _job_id(entry, job_id))
        if row is None or column not in row._mapping:
            abort(404)
        # text/plain with nosniff: the browser shows the value, never renders it.
        return Response(_full(row._mapping[column]), mimetype="text/plain")

    @bp.get("/<path:table>/workers")
    def workers(table: str) -> str:
        entry = settings.table(table)
        owners = admin.lease_owners(settings.engine, entry.model, lease=settings.lease)
        return render_template("sqla_queue_dashboard/workers.html", table=entry, owners=owners, lease=settings.lease)

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

    return bp


def _job_id(entry: _Table, value: str) -> Any:
    try:
        return admin.parse_job_id(entry.model, value)
    except ValueError:
        abort(404)


def _split(values: list[str]) -> tuple[str, ...]:
    """Repeated query arguments, each also split on commas: ``?queue=a,b&queue=c``."""
    parts = (part.strip() for value in values for part in value.split(","))
    return tuple(dict.fromkeys(part for part in parts if part))


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
    page = admin.list_jobs(
        settings.engine,
        entry.model,
        filters,
        before=_job_id(entry, before) if before else None,
        limit=settings.page_size,
    )
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


def _when(value: datetime | None) -> str:
    return "-" if value is None else value.isoformat(sep=" ", timespec="seconds")


def _age(value: timedelta | None) -> str:
    return admin._age(value)


def _chart(done: list[int], failed: list[int], *, width: int = 360, height: int = 64) -> dict[str, Any]:
    """Bar geometry of the last hour: one bar per minute, done stacked under failed."""
    peak = max([d + f for d, f in zip(done, failed, strict=True)] + [0])
    top = max(peak, 1)
    step = width / max(len(done), 1)
    bars = []
    for i, (d, f) in enumerate(zip(done, failed, strict=True)):
        done_h = height * d / top
        failed_h = height * f / top
        bars.append({
            "x": round(i * step, 2),
            "w": round(max(step - 1, 1), 2),
            "done_y": round(height - done_h, 2),
            "done_h": round(done_h, 2),
            "failed_y": round(height - done_h - failed_h, 2),
            "failed_h": round(failed_h, 2),
            "minute": len(done) - i,
            "done": d,
            "failed": f,
        })
    return {"width": width, "height": height, "bars": bars, "peak": peak, "done": sum(done), "failed": sum(failed)}


def create_app(
    engine: Engine | Callable[[], Engine],
    models: Sequence[Any],
    *,
    read_only: bool = False,
    lease: float | None = None,
    auth: Auth | None = None,
    secret_key: str | None = None,
    page_size: int = 50,
) -> Flask:
    """A Flask app serving only the dashboard, at ``/``: what ``sqla-queue dashboard``
    runs. A random ``secret_key`` unless given (sessions, hence CSRF tokens, last as long
    as the process)."""
    app = Flask("sqla_queue.dashboard")
    app.secret_key = secret_key or secrets.token_hex(32)
    app.config["SESSION_COOKIE_SAMESITE"] = "Strict"
    app.register_blueprint(
        dashboard_blueprint(engine, models, auth=auth, read_only=read_only, lease=lease, page_size=page_size)
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
) -> None:
    """Serve :func:`create_app` with Werkzeug's threaded server until interrupted; prints
    (or passes to ``ready``) the address once it listens (``port=0``: a free port)."""
    from werkzeug.serving import make_server

    app = create_app(engine, models, read_only=read_only, lease=lease)
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
