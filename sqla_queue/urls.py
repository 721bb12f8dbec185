"""Engine URLs: ``postgresql://`` means psycopg 3 wherever sqla_queue builds an engine.

SQLAlchemy maps a bare ``postgresql://`` (and never ``postgres://``) to psycopg2, which
sqla_queue does not install; the URLs people copy from their hosting provider usually
have one of those two forms. The URL of an engine *you* create is left alone.
"""

from __future__ import annotations

from sqlalchemy import URL, make_url

__all__ = ["psycopg_url"]

_BARE: frozenset[str] = frozenset({"postgresql", "postgres"})


def psycopg_url(url: str | URL) -> URL:
    """``url`` with the psycopg dialect when it names PostgreSQL without a driver.

    Raises :class:`sqlalchemy.exc.ArgumentError` for text that is not a URL at all.
    """
    parsed = make_url(url)
    if parsed.drivername in _BARE:
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed
