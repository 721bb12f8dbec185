"""An Alembic project for sqla_queue tables, step by step, as you would type it.

    python examples/alembic_project/run.py     # embedded PostgreSQL if DATABASE_URL is unset;
                                               # else a scratch database beside it

1. ``sqla-queue alembic init migrations``   (Alembic's generic template, wired for sqla_queue)
2. point ``target_metadata`` at the models and ``sqlalchemy.url`` at the database
3. ``alembic revision --autogenerate``      (the queue table, its CHECK, its partial indexes)
4. ``alembic upgrade head``                 then a look at what it built
5. ``alembic downgrade base``               to leave the database as it was
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import create_engine, inspect, make_url, text

HERE = Path(__file__).resolve().parent


def sh(*command: str, cwd: Path) -> str:
    print(f"$ {' '.join(command)}")
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"{command[0]} failed:\n{result.stdout}{result.stderr}")
    return result.stdout + result.stderr


def tour(url: str) -> None:
    bin_dir = Path(sys.executable).parent
    project = Path(tempfile.mkdtemp(prefix="sqla_queue_alembic_"))
    try:
        shutil.copy(HERE / "models.py", project / "models.py")
        sh(str(bin_dir / "sqla-queue"), "alembic", "init", "migrations", cwd=project)

        env_py = project / "migrations" / "env.py"
        env_py.write_text(
            env_py.read_text().replace(
                "target_metadata = None", "from models import Base\ntarget_metadata = Base.metadata"
            )
        )
        ini = project / "alembic.ini"
        ini.write_text(
            "\n".join(
                f"sqlalchemy.url = {url.replace('%', '%%')}" if line.startswith("sqlalchemy.url") else line
                for line in ini.read_text().splitlines()
            )
        )

        sh(str(bin_dir / "alembic"), "revision", "--autogenerate", "-m", "welcome emails", cwd=project)
        (migration,) = (project / "migrations" / "versions").glob("*.py")
        body = migration.read_text()
        upgrade = body[body.index("def upgrade"):body.index("def downgrade")]
        print("-- the generated upgrade():")
        print(upgrade.rstrip())

        sh(str(bin_dir / "alembic"), "upgrade", "head", cwd=project)
        engine = create_engine(url)
        try:
            indexes = inspect(engine).get_indexes("welcome_emails")
            checks = inspect(engine).get_check_constraints("welcome_emails")
        finally:
            engine.dispose()
        print("-- welcome_emails now has:")
        for index in indexes:
            where = index.get("dialect_options", {}).get("postgresql_where", "")
            print(f"   index {index['name']} {index['column_names']} WHERE {where}")
        for check in checks:
            print(f"   check {check['name']}: {check['sqltext']}")

        sh(str(bin_dir / "alembic"), "downgrade", "base", cwd=project)
        print("-- downgraded: the database is as it was")
    finally:
        shutil.rmtree(project, ignore_errors=True)


@contextmanager
def scratch_database(url: str) -> Iterator[str]:
    """A new, empty database beside ``url``: autogenerate compares the models with the
    whole database, so the tables of another application must not be in view."""
    server = create_engine(url, isolation_level="AUTOCOMMIT")
    name = f"sqla_queue_alembic_example_{uuid.uuid4().hex[:8]}"
    with server.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield make_url(url).set(database=name).render_as_string(hide_password=False)
    finally:
        with server.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        server.dispose()


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent.parent))
    if os.environ.get("DATABASE_URL"):
        from sqla_queue.urls import psycopg_url

        with scratch_database(psycopg_url(os.environ["DATABASE_URL"]).render_as_string(hide_password=False)) as url:
            tour(url)
    else:
        from sqla_queue.embedded import EmbeddedPostgres

        with EmbeddedPostgres() as pg:
            tour(pg.url.render_as_string(hide_password=False))
