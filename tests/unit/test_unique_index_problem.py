"""Comparing a unique index read from the catalog with the model's declaration (no database)."""

from __future__ import annotations

from sqlalchemy import Table

from sqla_queue.unique_index import unique_index_problem

from ..models import EmailJob, OnceJob

ACTIVE = "((unique_key IS NOT NULL) AND (((status)::text = 'pending'::text) OR ((status)::text = 'running'::text)))"


def _table(model: type) -> Table:
    table = model.__table__  # type: ignore[attr-defined]
    assert isinstance(table, Table)
    return table


def test_the_same_index_in_postgresql_words_matches() -> None:
    found = ("CREATE UNIQUE INDEX …", True, ["unique_key"], ACTIVE)
    assert unique_index_problem(_table(EmailJob), found) is None


def test_other_statuses_another_column_or_a_plain_index_do_not() -> None:
    email, once = _table(EmailJob), _table(OnceJob)
    problem = unique_index_problem(once, ("CREATE UNIQUE INDEX once_jobs_unique_idx …", True, ["unique_key"], ACTIVE))
    assert problem is not None and "database: CREATE UNIQUE INDEX once_jobs_unique_idx …" in problem
    assert "model:    CREATE UNIQUE INDEX once_jobs_unique_idx ON once_jobs (unique_key) WHERE" in problem
    assert unique_index_problem(email, ("…", True, ["other_key"], ACTIVE.replace("unique_key", "other_key")))
    assert unique_index_problem(email, ("…", False, ["unique_key"], ACTIVE))
    assert unique_index_problem(email, ("…", True, ["unique_key"], None))
    assert "no index named 'email_jobs_unique_idx'" in (unique_index_problem(email, None) or "")
