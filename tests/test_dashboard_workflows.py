"""The dashboard's workflow page, what a job's page shows of its workflow, the cancel of a
whole workflow, and the same through the JSON API: Flask's test client against real
PostgreSQL, the workflows enqueued by ``enqueue_workflow`` and run by the statement
builders a worker runs. Markup in names, payloads and errors stays text; the cancel is
refused without its token, read-only, or from another origin; a big workflow is paged
and not drawn."""

from __future__ import annotations

import html
import re
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

pytest.importorskip("flask")

from flask import Flask

from sqla_queue import Workflow, enqueue_workflow
from sqla_queue import sql as q
from sqla_queue.control import Cancel, parse
from sqla_queue.dashboard.workflows import LINKS_SHOWN
from sqla_queue.model import notify_channel

from .dashboard_helpers import XSS, act, client_of, dashboard_app, get
from .helpers import table_of
from .models import EmailJob, StepJob, StepTask

STEPS = table_of(StepTask)


def make_app(engine: Engine, **options: Any) -> Flask:
    """Workflows and plain jobs, pages of fifty, the API's actions on unless a test says otherwise."""
    return dashboard_app(engine, [StepTask, StepJob, EmailJob], **{"page_size": 50, "api_actions": True, **options})


@pytest.fixture
def client(engine: Engine) -> Iterator[Any]:
    with client_of(make_app(engine)) as client:
        yield client


def step(task: str, **payload: Any) -> StepTask:
    return StepTask(task=task, payload=payload, max_attempts=1)


def enqueued(engine: Engine, flow: Workflow) -> Workflow:
    with Session(engine, expire_on_commit=False) as session:
        enqueue_workflow(session, flow)
        session.commit()
    return flow


def claim(engine: Engine, n: int = 1, owner: str = "w:1:a/0") -> list[Any]:
    with engine.begin() as conn:
        return list(conn.execute(q.claim(StepTask, owner=owner, limit=n, lease=30)).all())


def complete(engine: Engine, row: Any, owner: str = "w:1:a/0") -> None:
    with engine.begin() as conn:
        assert conn.execute(q.complete_if_owner(StepTask, owner=owner, tokens=[(row.id, row.attempts)])).all()


def fail(engine: Engine, row: Any, error: str, owner: str = "w:1:a/0") -> None:
    with engine.begin() as conn:
        assert conn.execute(q.fail_if_owner(StepTask, owner=owner, token=(row.id, row.attempts), error=error)).all()


def statuses(engine: Engine, flow: Workflow) -> dict[int, str]:
    with engine.connect() as conn:
        return dict(conn.execute(select(STEPS.c.id, STEPS.c.status).where(STEPS.c.workflow_id == flow.id)).all())


def page_of(client: Any, path: str, status: int = 200) -> str:
    response = client.get(path)
    assert response.status_code == status, response.get_data(as_text=True)[:500]
    return str(response.get_data(as_text=True))


def cells(page: str, key: int) -> str:
    match = re.search(rf'<tr data-id="{key}">(.*?)</tr>', page, re.S)
    assert match, f"no row of job {key}"
    return match.group(1)


def linked(fragment: str, what: str) -> list[int]:
    return [int(k) for k in re.findall(rf'class="{what}" data-id="(\d+)"', fragment)]


@pytest.fixture
def diamond(engine: Engine) -> dict[str, Any]:
    """root → (left, right) → tail, and a job below tail: root done, left failed (its
    error with markup), right running; tail and last wait (policy hold)."""
    flow = Workflow(on_parent_failure="hold")
    root = flow.add(step("root", note=XSS))
    left = flow.add(step(f"left {XSS}"), after=[root])
    right = flow.add(step("right"), after=[root])
    tail = flow.add(step("tail"), after=[left, right])
    last = flow.add(step("last"), after=[tail])
    enqueued(engine, flow)
    (claimed,) = claim(engine)
    complete(engine, claimed)
    running = {r.id: r for r in claim(engine, 2)}
    fail(engine, running[left.id], f"Traceback ...\nValueError: {XSS}")
    return {"flow": flow, "root": root.id, "left": left.id, "right": right.id, "tail": tail.id, "last": last.id}


def test_the_workflow_page_shows_counts_jobs_their_edges_and_a_picture(client: Any, diamond: dict[str, Any]) -> None:
    flow = diamond["flow"]
    page = page_of(client, f"/step_tasks/workflow/{flow.id}")
    counts = dict(re.findall(r'data-status="(\w+)">(\d+)<', page))
    assert counts == {"pending": "2", "running": "1", "failed": "1", "cancelled": "0"}
    assert 'data-done="1" data-total="5">1 / 5<' in page and 'data-waiting="2"' in page
    assert '<b id="workflow-policy">hold</b>' in page
    root, left, right, tail, last = (diamond[k] for k in ("root", "left", "right", "tail", "last"))
    row = cells(page, tail)
    assert linked(row, "parent") == [left, right] and linked(row, "child") == [last]
    assert '<span class="status status-failed">failed</span>' in row.split('class="children"')[0]
    assert re.search(r'<td class="num">2</td>', row)  # waiting on both
    assert linked(cells(page, root), "child") == [left, right] and linked(cells(page, root), "parent") == []
    assert "ValueError: &lt;script&gt;" in cells(page, left)  # the error's last line, as text
    # The picture: a box per job at its depth, an edge per parent.
    boxes = dict(re.findall(r'<a href="[^"]+" class="box" data-job="(\d+)" data-status="\w+" data-depth="(\d+)"', page))
    assert boxes == {str(root): "0", str(left): "1", str(right): "1", str(tail): "2", str(last): "3"}
    edges = set(re.findall(r'data-from="(\d+)" data-to="(\d+)"', page))
    assert edges == {(str(a), str(b)) for a, b in [(root, left), (root, right), (left, tail), (right, tail),
                                                    (tail, last)]}
    assert f'href="/step_tasks/job/{tail}" class="box"' in page
    # No markup of a job's name, payload or error reaches the page as markup.
    assert XSS not in page and "left &lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt;" in page
    assert "9999" not in page


def test_a_job_s_page_links_its_workflow_parents_and_children_and_says_it_waits(
    client: Any, diamond: dict[str, Any], alone: int
) -> None:
    flow = diamond["flow"]
    page = page_of(client, f"/step_tasks/job/{diamond['tail']}")
    section = page.split('<dl class="kv" id="workflow">')[1].split("</dl>")[0]
    assert f'href="/step_tasks/workflow/{flow.id}" id="workflow-link"' in section and "hold" in section
    parents = section.split('id="parents"')[1].split("</dd>")[0]
    assert linked(parents, "parent") == [diamond["left"], diamond["right"]]
    assert "status-failed" in parents and "status-running" in parents
    assert linked(section.split('id="children"')[1], "child") == [diamond["last"]]
    assert '<span id="waiting-on">waiting on 2 of 2 job(s)</span>' in page
    assert "9999" not in page  # the sentinel is no date: "waiting" in the columns too
    assert re.search(r"<dt>run_after</dt>\s*<dd>\s*<span class=\"mono\">waiting</span>", page)
    root = page_of(client, f"/step_tasks/job/{diamond['root']}")
    assert linked(root.split('id="children"')[1], "child") == [diamond["left"], diamond["right"]]
    assert "waiting-on" not in root and "run after 20" in root
    assert XSS not in root and "&lt;script&gt;" in root  # its payload, as text
    jobs = page_of(client, "/step_tasks/jobs?status=pending")
    assert "9999" not in jobs and cells(jobs, diamond["tail"]).count(">waiting<") == 1
    # A table without workflows, a job enqueued alone: no section.
    page = page_of(client, f"/step_tasks/job/{alone}")
    assert 'id="workflow"' not in page and "run after 20" in page


@pytest.fixture
def alone(engine: Engine) -> int:
    """A job of the workflow table enqueued alone, in no workflow."""
    with Session(engine) as session:
        job = StepTask(task="alone", payload={})
        session.add(job)
        session.commit()
        return job.id


def test_a_job_cancelled_while_it_waited_says_it_was_never_released(engine: Engine, client: Any) -> None:
    flow = Workflow()  # the policy "cancel": the root's failure cancels what waits below it
    root = flow.add(step("root"))
    child = flow.add(step("child"), after=[root])
    enqueued(engine, flow)
    (claimed,) = claim(engine)
    fail(engine, claimed, "boom")
    assert statuses(engine, flow)[child.id] == "cancelled"
    page = page_of(client, f"/step_tasks/job/{child.id}")
    assert "run after never released" in page and "9999" not in page
    assert ">never released<" in cells(page_of(client, "/step_tasks/jobs"), child.id)


def test_cancel_the_workflow_through_its_confirm_page(
    engine: Engine, client: Any, diamond: dict[str, Any], alone: int,
    listener: psycopg.Connection[tuple[object, ...]],
) -> None:
    flow = diamond["flow"]
    page = page_of(client, f"/step_tasks/workflow/{flow.id}")
    assert f'href="/step_tasks/workflow/{flow.id}/cancel" id="cancel-workflow"' in page
    confirm = page_of(client, f"/step_tasks/workflow/{flow.id}/cancel")
    assert 'data-unfinished="3"' in confirm and "1 running" in confirm
    assert statuses(engine, flow)[diamond["tail"]] == "pending"  # showing it changed nothing
    fields = dict(re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)">', confirm))
    listener.execute(f'LISTEN "{notify_channel(STEPS)}"')
    response = client.post(f"/step_tasks/workflow/{flow.id}/cancel", data=fields)
    assert response.status_code == 302 and response.headers["Location"] == f"/step_tasks/workflow/{flow.id}"
    found = statuses(engine, flow)
    assert [found[diamond[k]] for k in ("root", "left", "right", "tail", "last")] == [
        "done", "failed", "cancelled", "cancelled", "cancelled"]
    told = [parse(n.payload) for n in listener.notifies(timeout=5, stop_after=1)]
    assert told == [Cancel(frozenset({str(diamond["right"])}))]  # the running job's worker is told
    after = page_of(client, f"/step_tasks/workflow/{flow.id}")
    assert f"cancelled 3 job(s) of workflow {flow.id}" in after and 'id="cancel-workflow"' not in after
    with engine.connect() as conn:  # another job of the table: untouched
        assert conn.scalar(select(STEPS.c.status).where(STEPS.c.id == alone)) == "pending"


def test_the_cancel_is_refused_without_token_from_another_origin_and_read_only(
    engine: Engine, client: Any, diamond: dict[str, Any]
) -> None:
    flow = diamond["flow"]
    path = f"/step_tasks/workflow/{flow.id}/cancel"
    before = statuses(engine, flow)
    assert client.post(path, data={}).status_code == 400  # no token
    assert client.post(path, data={"csrf_token": "forged"}).status_code == 400
    page_of(client, path)  # the session's token
    with client.session_transaction() as session:
        token = session["sqla_queue_dashboard_csrf"]
    forged = client.post(path, data={"csrf_token": token}, headers={"Origin": "http://evil.example"})
    assert forged.status_code == 400
    assert client.post(path, data={"csrf_token": token}, headers={"Origin": ""}).status_code == 400
    with client_of(make_app(engine, read_only=True)) as other:
        assert other.get(path).status_code == 403
        assert other.post(path, data={"csrf_token": token}).status_code == 403
        assert 'id="cancel-workflow"' not in page_of(other, f"/step_tasks/workflow/{flow.id}")
    assert statuses(engine, flow) == before


def test_what_names_no_workflow_is_a_404(client: Any, diamond: dict[str, Any]) -> None:
    page_of(client, f"/step_tasks/workflow/{uuid.uuid4()}", 404)
    page_of(client, "/step_tasks/workflow/not-a-uuid", 404)
    page_of(client, f"/email_jobs/workflow/{diamond['flow'].id}", 404)  # a table without workflows
    page_of(client, f"/step_tasks/workflow/{diamond['flow'].id}?after=x", 404)


def test_a_big_workflow_is_paged_counted_and_not_drawn(engine: Engine) -> None:
    """A fan-out of 1 → 499: no picture, the jobs fifty a page, the root's children the
    first few and how many more."""
    flow = Workflow()
    root = flow.add(step("root"))
    for n in range(499):
        flow.add(step(f"leaf {n}"), after=[root])
    enqueued(engine, flow)
    with make_app(engine, page_size=50).test_client() as client:
        page = page_of(client, f"/step_tasks/workflow/{flow.id}")
        assert 'id="no-picture"' in page and "<svg" not in page
        assert 'data-status="pending">500<' in page and 'data-waiting="499"' in page and 'data-total="500"' in page
        assert len(re.findall(r"<tr data-id=", page)) == 50
        root_row = cells(page, root.id)
        assert len(linked(root_row, "child")) == LINKS_SHOWN and f"and {499 - LINKS_SHOWN} more" in root_row
        seen = [int(k) for k in re.findall(r'<tr data-id="(\d+)"', page)]
        pages = 1
        while (nxt := re.search(r'<a href="([^"]+)" id="next-page">', page)) is not None:
            page = page_of(client, html.unescape(nxt.group(1)))
            seen += [int(k) for k in re.findall(r'<tr data-id="(\d+)"', page)]
            pages += 1
        assert pages == 10 and seen == sorted(statuses(engine, flow))


# -- the JSON API -----------------------------------------------------------------------------


def cancel_workflow(client: Any, body: Any, *, csrf: str | None, status: int = 200,
                    headers: dict[str, str] | None = None) -> Any:
    """The API's cancel of a workflow: its JSON answer, which must have ``status``."""
    return act(client, "step_tasks", "cancel_workflow", body, csrf=csrf, headers=headers, status=status)


def test_the_api_answers_a_workflow_as_its_page_shows_it(client: Any, diamond: dict[str, Any]) -> None:
    flow = diamond["flow"]
    actions = {t["table"]: t["actions"] for t in get(client, "/")["tables"]}
    assert "/api/tables/step_tasks/actions/cancel_workflow" in actions["step_tasks"]
    assert not any(a.endswith("/cancel_workflow") for a in actions["email_jobs"])  # no workflows there
    found = get(client, f"/tables/step_tasks/workflows/{flow.id}")
    assert found["workflow"] == str(flow.id) and found["policies"] == ["hold"]
    assert (found["total"], found["done"], found["waiting"]) == (5, 1, 2)
    assert found["counts"] == {"pending": 2, "running": 1, "done": 1, "failed": 1, "cancelled": 0}
    jobs = {job["id"]: job for job in found["jobs"]}
    tail = jobs[diamond["tail"]]
    assert [p["id"] for p in tail["parents"]] == [diamond["left"], diamond["right"]]
    assert [p["status"] for p in tail["parents"]] == ["failed", "running"]
    assert [c["id"] for c in tail["children"]] == [diamond["last"]] and tail["waiting_on"] == 2
    assert jobs[diamond["left"]]["task"] == f"left {XSS}" and found["next"] is None
    raw = client.get(f"/api/tables/step_tasks/workflows/{flow.id}").get_data(as_text=True)
    assert "<script>" not in raw and "\\u003cscript\\u003e" in raw
    paged = get(client, f"/tables/step_tasks/workflows/{flow.id}?limit=2")
    assert [j["id"] for j in paged["jobs"]] == [diamond["root"], diamond["left"]]
    second = get(client, paged["next"].removeprefix("/api"))
    assert [j["id"] for j in second["jobs"]] == [diamond["right"], diamond["tail"]]
    for path, status, kind in [
        (f"/tables/step_tasks/workflows/{uuid.uuid4()}", 404, "no_such_workflow"),
        ("/tables/step_tasks/workflows/nope", 404, "no_such_workflow"),
        (f"/tables/email_jobs/workflows/{flow.id}", 404, "no_such_workflow"),
        (f"/tables/step_tasks/workflows/{flow.id}?limit=0", 400, "bad_filter"),
        (f"/tables/step_tasks/workflows/{flow.id}?status=done", 400, "bad_filter"),
    ]:
        assert get(client, path, status)["error"] == kind


def test_the_api_cancels_a_workflow_under_its_protections(
    engine: Engine, client: Any, diamond: dict[str, Any]
) -> None:
    flow = diamond["flow"]
    before = statuses(engine, flow)
    assert cancel_workflow(client, {"workflow": str(flow.id)}, csrf=None, status=403)["error"] == "csrf"
    token = get(client, "/csrf")["csrf_token"]
    assert cancel_workflow(client, {"workflow": str(flow.id)}, csrf=token, status=400,
               headers={"Origin": "http://evil.example"})["error"] == "bad_request"
    assert cancel_workflow(client, {"workflow": "nope"}, csrf=token, status=400)["error"] == "bad_body"
    with client_of(make_app(engine, read_only=True)) as other:
        assert cancel_workflow(other, {"workflow": str(flow.id)}, csrf=token, status=403)["error"] == "read_only"
    assert statuses(engine, flow) == before
    done = cancel_workflow(client, {"workflow": str(flow.id)}, csrf=token)
    assert done == {"table": "step_tasks", "action": "cancel_workflow", "workflow": str(flow.id), "cancelled": 3}
    assert sorted(statuses(engine, flow).values()) == ["cancelled"] * 3 + ["done", "failed"]
    assert cancel_workflow(client, {"workflow": str(flow.id)}, csrf=token)["cancelled"] == 0  # harmless again
