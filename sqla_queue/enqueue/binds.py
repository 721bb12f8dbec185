"""What an enqueue call was handed: a session or connection of some kind, resolved.

``enqueue()``, ``enqueue_many()``, ``enqueue_values()`` and ``notify_on_commit()`` take a
``Session``, a ``scoped_session`` (Flask-SQLAlchemy's ``db.session``), an ``AsyncSession``
or an ``async_scoped_session``; this is where each stands for the session it means.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.ext.asyncio import async_scoped_session
from sqlalchemy.orm import Session, scoped_session

__all__ = ["resolve_session", "sync_session"]


def resolve_session(session: Any) -> Any:
    """A ``scoped_session`` or ``async_scoped_session`` stands for its current session."""
    return session() if isinstance(session, (scoped_session, async_scoped_session)) else session


def sync_session(session: Any) -> Session:
    """The synchronous ``Session`` of ``session`` (an ``AsyncSession`` wraps one)."""
    session = resolve_session(session)
    sync = getattr(session, "sync_session", session)
    if not isinstance(sync, Session):
        raise TypeError(f"expected a SQLAlchemy Session, got {type(session).__qualname__}")
    return sync
