"""Where the documentation's snippets run: ``DATABASE_URL``, or else an embedded server
started for the run and removed after it (``pip install 'sqla-queue[embedded]'``)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from sqla_queue.urls import psycopg_url


@contextmanager
def database_url() -> Iterator[str]:
    if os.environ.get("DATABASE_URL"):
        yield psycopg_url(os.environ["DATABASE_URL"]).render_as_string(hide_password=False)
        return
    from sqla_queue.embedded import EmbeddedPostgres

    with EmbeddedPostgres() as pg:
        yield pg.url.render_as_string(hide_password=False)
