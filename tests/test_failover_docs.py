"""The failover page's example runs (its snippets are sections of it, see test_docs), and
no page hands ``job.id`` to external APIs as an idempotency key."""

from __future__ import annotations

from pathlib import Path

import pytest

from .helpers import Server
from .test_examples import run_example

pytestmark = pytest.mark.system

REPO = Path(__file__).resolve().parent.parent
PAGE = REPO / "docs" / "operations" / "failover.md"


def test_the_example_charges_once_for_two_runs(server: Server) -> None:
    out = run_example("docs/failover.py", server)
    assert "enqueued with idempotency key" in out
    assert "requests to the provider: 2, charges made: 1" in out


def test_no_page_advises_the_job_id_as_an_idempotency_key() -> None:
    pages = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    for page in pages:
        text = page.read_text()
        assert "idempotency_key=job.id" not in text, page
        assert "`job.id` as the idempotency key" not in text, page
    assert "idempotency_key" in PAGE.read_text()
