"""Functions run in separate processes by the concurrency tests."""

from __future__ import annotations

from typing import Any

from sqlalchemy import create_engine

from sqla_queue import ClaimToken
from sqla_queue import sql as q

from .models import EmailJob

_start: Any = None


def wait_at(barrier: Any) -> None:
    """Pool initializer: remember the barrier all claimers cross together."""
    global _start
    _start = barrier


def claim_until_empty(url: str, owner: str) -> list[int]:
    """Claim small batches and complete them until nothing is left; return what it got."""
    engine = create_engine(url)
    with engine.connect():
        pass  # connect before the start line, so all claimers really race
    if _start is not None:
        _start.wait(timeout=60)
    got: list[int] = []
    try:
        while True:
            with engine.begin() as conn:
                rows = conn.execute(q.claim(EmailJob, owner=owner, limit=7)).all()
                if not rows:
                    return got
                tokens = [ClaimToken(r.id, r.attempts) for r in rows]
                done = conn.scalars(q.complete_if_owner(EmailJob, owner=owner, tokens=tokens)).all()
                assert sorted(done) == sorted(t.job_id for t in tokens)
                got.extend(r.id for r in rows)
    finally:
        engine.dispose()
