"""The Alembic guide's Flask-Migrate snippet, run: ``flask db init`` and ``flask db
migrate`` write the queue table, and a second ``migrate`` with nothing changed writes no
file. Autogenerate compares the models with the whole database: run it on an empty one.

    python examples/docs/alembic_guide.py    # DATABASE_URL, or an embedded server
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from flask import Flask
from flask_sqlalchemy import SQLAlchemy

from _db import database_url
from shop_models import Base


def tour(url: str) -> None:
    here = Path.cwd()
    folder = Path(tempfile.mkdtemp(prefix="sqla_queue_docs_migrate_"))
    try:
        app = Flask(__name__)
        app.config["SQLALCHEMY_DATABASE_URI"] = url
        db = SQLAlchemy(app, model_class=Base)
        # --8<-- [start:flask-migrate]
        from flask_migrate import Migrate

        from sqla_queue.alembic import compose

        migrate = Migrate(app, db, transaction_per_migration=True,
                          process_revision_directives=compose(skip_empty=True))
        # --8<-- [end:flask-migrate]
        assert migrate.directory == "migrations"  # relative to the current directory
        cli = app.test_cli_runner()
        os.chdir(folder)
        steps = (["db", "init"], ["db", "migrate", "-m", "shop"], ["db", "upgrade"],
                 ["db", "migrate", "-m", "nothing"], ["db", "downgrade", "base"])
        for args in steps:
            result = cli.invoke(args=args)
            assert result.exit_code == 0 and result.exception is None, (args, result.output, result.exception)
        (migration,) = (folder / "migrations" / "versions").glob("*.py")  # the empty one was skipped
        body = migration.read_text()
        assert "create_table('email_jobs'" in body and "email_jobs_claim_idx" in body, body
        print(f"{migration.name}: the queue table and its indexes; no file for the empty revision")
        with app.app_context():
            db.engine.dispose()
    finally:
        os.chdir(here)
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    with database_url() as url:
        tour(url)
