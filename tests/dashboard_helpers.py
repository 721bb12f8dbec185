"""Small helpers for the dashboard's tests (``tests/test_dashboard*.py``): the app and its
test client, rows added and read back, a page's CSRF token, the JSON API's requests, and
the refusals every API action must meet.

Only how an app and a client are made lives here: each test module still says, in its
``client`` fixture or ``make_app``, which models and options its dashboard serves.
Imports Flask: a module imports this after its ``pytest.importorskip("flask")``. No name
here begins with ``test``: pytest would collect such a function, imported into a test
module, as a test.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import Any

from flask import Flask
from flask.testing import FlaskClient
from sqlalchemy import Engine, insert, select

from sqla_queue import Schedule
from sqla_queue import sql as q
from sqla_queue.dashboard import create_app

from .helpers import table_of
from .models import TASK_SCHEDULES, EmailJob, Task

#: The Origin a browser sends from the dashboard's own pages (the test client's host):
#: without it, the dashboard refuses every POST.
ORIGIN = "http://localhost"
#: Markup that must come out as text wherever a value is shown.
XSS = "<script>alert('x')</script>"
#: The schedules of ``Task`` in the code, for the schedules page and its API.
HOURLY = Schedule("hourly", every=3600, values={"task": "report", "payload": {"kind": "hourly"}}, queue="reports")
NIGHTLY = Schedule(f"nightly {XSS}", "30 2 * * *", timezone="Europe/Paris", values={"task": "nightly", "payload": {}})


# -- the app and its client ------------------------------------------------------------------


def dashboard_app(engine: Engine, models: Sequence[Any], **options: Any) -> Flask:
    """``create_app`` in Flask's testing mode: an error in a view reaches the test as
    itself, not as a 500 page."""
    app = create_app(engine, list(models), **options)
    app.testing = True
    return app


@contextmanager
def client_of(app: Flask, origin: str | None = ORIGIN) -> Iterator[FlaskClient]:
    """A test client of ``app`` whose requests carry ``origin`` (none: no Origin header),
    as a browser's from the dashboard's pages do."""
    with app.test_client() as client:
        if origin is not None:
            client.environ_base["HTTP_ORIGIN"] = origin
        yield client


def page_token(page: str) -> str | None:
    """The CSRF token of the forms on ``page``; None where it has none (a read-only
    dashboard shows no action's form)."""
    match = re.search(r'name="csrf_token" value="([^"]+)"', page)
    return match.group(1) if match else None


# -- rows ------------------------------------------------------------------------------------


def add(engine: Engine, table: Any, **values: Any) -> Any:
    """A row of ``table``, committed: its key."""
    with engine.begin() as conn:
        return conn.execute(insert(table).values(**values).returning(table.c.id)).scalar_one()


def add_rows(engine: Engine, table: Any, n: int = 1, **values: Any) -> list[Any]:
    """``n`` rows of ``table`` alike, committed: their keys, in order."""
    with engine.begin() as conn:
        made = insert(table).values(**values).returning(table.c.id, sort_by_parameter_order=True)
        return list(conn.scalars(made, [{}] * n))


def status_of(engine: Engine, table: Any, key: Any) -> str | None:
    """The status of row ``key``; None where it is gone."""
    with engine.connect() as conn:
        return conn.scalar(select(table.c.status).where(table.c.id == key))


def statuses(engine: Engine, table: Any, keys: Sequence[Any]) -> list[str | None]:
    """The statuses of ``keys``, in their order; None for a row that is gone."""
    with engine.connect() as conn:
        found: dict[Any, str] = dict(conn.execute(select(table.c.id, table.c.status).where(
            table.c.id.in_(keys))).all())
    return [found.get(k) for k in keys]


def watermark(engine: Engine, name: str, tick: datetime) -> None:
    """Schedule ``name`` of ``Task`` ticked at ``tick``, as a worker records it."""
    with engine.begin() as conn:
        conn.execute(q.claim_schedule_tick(Task, schedule=name, tick=tick))


def schedule_state(engine: Engine, name: str) -> Any:
    """The watermark row of ``Task``'s schedule ``name``; None where it has none."""
    with engine.connect() as conn:
        return conn.execute(q.schedule_states(Task).where(TASK_SCHEDULES.c.name == name)).one_or_none()


# -- filters ---------------------------------------------------------------------------------


def check_one_and_several_values(engine: Engine, shown: Callable[..., list[Any]]) -> dict[str, Any]:
    """Jobs of ``EmailJob`` and ``Task`` that each filter, of one value and of several,
    tells apart, and what ``shown(query, table="email_jobs")`` (the keys a listing of
    ``table`` shows for the query string, newest first) must answer: the pages and the API
    filter alike. The jobs' keys by name."""
    jobs, tasks = table_of(EmailJob), table_of(Task)
    a = add(engine, jobs, queue="a")
    b = add(engine, jobs, queue="b", status="failed", last_error="SMTP timeout")
    c = add(engine, jobs, queue="c", status="done", last_error="smtp REFUSED 100%")
    add(engine, tasks, task="resize", queue="x")
    t2 = add(engine, tasks, task="crop", queue="x")
    t3 = add(engine, tasks, task="send", queue="x")
    assert shown("queue=a") == [a]
    assert shown("queue=a,c") == [c, a]
    assert shown("queue=a&queue=b") == [b, a]
    assert shown("status=failed") == [b]
    assert shown("status=failed&status=pending") == [b, a]
    assert shown("status=done,pending") == [c, a]
    assert shown("error=smtp") == [c, b]  # case-insensitive
    assert shown("error=100%25") == [c]  # % is literal
    assert shown("error=10_%25") == []  # so is _
    assert shown("queue=b&status=failed&error=timeout") == [b]
    assert shown("task=crop", "tasks") == [t2]
    assert shown("task=crop,send", "tasks") == [t3, t2]
    assert shown("task=crop&task=send&queue=x", "tasks") == [t3, t2]
    return {"a": a, "b": b, "c": c, "t2": t2, "t3": t3}


# -- the JSON API ----------------------------------------------------------------------------


def get(client: Any, path: str, status: int = 200, **kwargs: Any) -> Any:
    """The JSON of ``GET /api{path}``, which must answer ``status`` as JSON."""
    response = client.get("/api" + path, **kwargs)
    assert response.status_code == status, response.get_data(as_text=True)[:500]
    assert response.mimetype == "application/json", response.get_data(as_text=True)[:500]
    return response.get_json()


def token(client: Any) -> str:
    """The API's CSRF token of this client's session."""
    value = get(client, "/csrf")["csrf_token"]
    assert isinstance(value, str) and len(value) >= 32
    return value


def act(client: Any, table: str, verb: str, body: Any, *, csrf: str | None, headers: dict[str, str] | None = None,
        status: int = 200) -> Any:
    """POST an action; its JSON answer, which must have ``status``."""
    sent = {"Content-Type": "application/json", **({"X-CSRF-Token": csrf} if csrf is not None else {}),
            **(headers or {})}
    response = client.post(f"/api/tables/{table}/actions/{verb}", data=json.dumps(body), headers=sent)
    assert response.status_code == status, response.get_data(as_text=True)[:500]
    assert response.mimetype == "application/json", response.get_data(as_text=True)[:500]
    return response.get_json()


#: Each way an API action is refused: (what the request lacks or forges, the status, the
#: error's kind). ``refuse_every_action`` sends each.
API_REFUSALS = [
    ("no token", 403, "csrf"),
    ("a wrong token", 403, "csrf"),
    ("read-only dashboard", 403, "read_only"),
    ("API actions not allowed", 403, "read_only"),
    ("forged Host", 400, "bad_request"),
    ("forged Origin", 400, "bad_request"),
    ("no Origin", 400, "bad_request"),
    ("cross-site", 403, "cross_site"),
    ("a form's body", 415, "unsupported_media_type"),
]
#: A refusal the pages' token meets: the token of the pages' forms is not the API's.
PAGE_TOKEN_REFUSAL = ("the page's token", 403, "csrf")


def refusal_options(refusal: str) -> dict[str, Any]:
    """The options of the dashboard a refusal is sent to: read-only, or the API's actions
    off; none for the others."""
    return {"read-only dashboard": {"read_only": True}, "API actions not allowed": {"api_actions": False}}.get(
        refusal, {})


def refuse_every_action(client: Any, refusal: str, status: int, kind: str, actions: Sequence[tuple[str, str, Any]],
                        form: dict[str, str]) -> None:
    """Send each of ``actions`` (table, verb, JSON body) as ``refusal`` says, from a
    client of a dashboard made with ``refusal_options(refusal)``: each must be answered
    ``status`` with the error ``kind``. ``form`` is the body sent as a form instead."""
    # The token this session would be given (none where actions are refused).
    real = "x" * 43 if refusal_options(refusal) else token(client)
    csrf: str | None = {"no token": None, "a wrong token": "x" * 43}.get(refusal, real)
    if refusal == "the page's token":  # the pages' token is not the API's
        csrf = page_token(client.get("/email_jobs/jobs").get_data(as_text=True))
        assert csrf is not None
    headers = {
        "forged Host": {"Host": "attacker.example", "Origin": "http://attacker.example"},
        "forged Origin": {"Origin": "http://evil.example"},
        "no Origin": {"Origin": ""},
        "cross-site": {"Sec-Fetch-Site": "cross-site"},
    }.get(refusal, {})
    for table, verb, body in actions:
        if refusal == "a form's body":
            response = client.post(f"/api/tables/{table}/actions/{verb}", data=form, headers={"X-CSRF-Token": real})
            assert response.status_code == status and response.get_json()["error"] == kind, verb
            continue
        answer = act(client, table, verb, body, csrf=csrf, headers=headers, status=status)
        assert answer["error"] == kind and answer["status"] == status, (verb, answer)


def run_every_action(client: Any, actions: Sequence[tuple[str, str, Any]]) -> list[Any]:
    """Each of ``actions`` allowed, with this session's token: their answers."""
    csrf = token(client)
    return [act(client, table, verb, body, csrf=csrf) for table, verb, body in actions]
