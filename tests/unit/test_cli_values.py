"""Command-line values checked before any statement: job ids within the key's range,
retention ages with a unit and within PostgreSQL's timestamps (no database)."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from sqlalchemy import Integer, SmallInteger
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from sqla_queue import JobMixin, admin
from sqla_queue.cli import DurationError, parse_age, parse_duration

from ..models import EmailJob, UuidJob


class _Base(DeclarativeBase):
    pass


class _IntJob(_Base, JobMixin):
    __tablename__ = "cli_values_int_jobs"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)


class _SmallJob(_Base, JobMixin):
    __tablename__ = "cli_values_small_jobs"
    id: Mapped[int] = mapped_column(SmallInteger, primary_key=True)


@pytest.mark.parametrize(
    ("model", "lowest", "highest"),
    [(EmailJob, -(2**63), 2**63 - 1), (_IntJob, -(2**31), 2**31 - 1), (_SmallJob, -(2**15), 2**15 - 1)],
)
def test_job_ids_are_refused_beyond_the_keys_integer_type(model: type, lowest: int, highest: int) -> None:
    assert admin.parse_job_id(model, str(lowest)) == lowest
    assert admin.parse_job_id(model, str(highest)) == highest
    for beyond in (lowest - 1, highest + 1, 10**20):
        with pytest.raises(ValueError, match="out of range"):
            admin.parse_job_id(model, str(beyond))


def test_other_job_ids_are_as_before() -> None:
    key = uuid.uuid4()
    assert admin.parse_job_id(UuidJob, str(key)) == key
    with pytest.raises(ValueError, match="a whole number"):
        admin.parse_job_id(EmailJob, "x")


@pytest.mark.parametrize(("text", "days"), [("7d", 7), ("2w", 14), ("12h", 0.5), ("1.5d", 1.5), ("365000d", 365000)])
def test_ages_take_their_unit(text: str, days: float) -> None:
    assert parse_age(text) == timedelta(days=days)


@pytest.mark.parametrize(
    ("text", "problem"),
    [("7", "give the unit of '7'"), (" 30 ", "give the unit of ' 30 '"), ("365001d", "age too long"),
     ("99999999d", "age too long"), ("soon", "not a duration"), ("-1d", "must not be negative")],
)
def test_bad_ages_are_refused(text: str, problem: str) -> None:
    with pytest.raises(DurationError, match=problem.replace("(", r"\(")):
        parse_age(text)


def test_a_bare_number_is_still_seconds_for_intervals() -> None:
    """--lease 60, --poll-interval 5: intervals of a worker, seconds by default as before."""
    assert parse_duration("60") == timedelta(seconds=60)
