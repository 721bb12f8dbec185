"""The documentation site's promises that can be checked mechanically.

Every Python snippet on a page is a section of a file under ``examples/docs/``
(pymdownx.snippets includes it at build time), and every such file runs here, against a
database of its own. Command lines shown run the real parser; the tables of worker
options and statement builders list exactly what the code has.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import inspect
import os
import re
import shlex
import sys
import uuid
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from sqla_queue import WorkerConfig
from sqla_queue import sql as q
from sqla_queue.cli import build_parser

from . import console
from .helpers import Server

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
SNIPPETS = REPO / "examples" / "docs"
PAGES = sorted(DOCS.rglob("*.md"))
FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w+-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```", re.S | re.M)
INCLUDE = re.compile(r'^[ \t]*--8<-- "(?P<file>[^":]+)(?::(?P<section>[\w-]+))?"[ \t]*$', re.M)
SCRIPTS = sorted(p for p in SNIPPETS.glob("*.py") if p.name not in {"_db.py", "shop_models.py"})


def blocks(lang: str) -> Iterator[tuple[Path, str]]:
    for page in PAGES:
        for match in FENCE.finditer(page.read_text()):
            if match.group("lang") == lang:
                yield page, match.group("body")


def test_there_are_pages_and_snippets() -> None:
    assert len(PAGES) > 20 and len(SCRIPTS) >= 8
    assert sum(1 for _ in blocks("python")) > 15


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(DOCS)))
def test_every_python_block_is_included_from_a_file_the_suite_runs(page: Path) -> None:
    for match in FENCE.finditer(page.read_text()):
        if match.group("lang") != "python":
            continue
        lines = [line for line in match.group("body").splitlines() if line.strip()]
        assert lines, f"{page.name}: an empty Python block"
        for line in lines:
            include = INCLUDE.fullmatch(line)
            assert include, f"{page.name}: a Python line written inline, not included from examples/docs/: {line}"
            target = SNIPPETS / include["file"] if (SNIPPETS / include["file"]).exists() else REPO / include["file"]
            assert target.is_file(), f"{page.name}: {include['file']} does not exist"
            assert target.parent == SNIPPETS or target.is_relative_to(REPO / "alembic_templates"), target
            if include["section"]:
                source = target.read_text()
                for mark in ("start", "end"):
                    # pymdownx.snippets takes the first section of a name only: one per name
                    assert source.count(f"# --8<-- [{mark}:{include['section']}]") == 1, (page.name, line)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(DOCS)))
def test_every_snippet_include_is_inside_a_code_block(page: Path) -> None:
    """An include outside a fence renders the file's code as one paragraph of prose
    (Markdown included as Markdown, the changelog, is the exception)."""
    source = page.read_text()
    fenced = [(m.start(), m.end()) for m in FENCE.finditer(source)]
    for include in INCLUDE.finditer(source):
        if include["file"].endswith(".md"):
            continue
        assert any(start <= include.start() < end for start, end in fenced), (
            f"{page.name}: {include.group(0).strip()} is not inside a ``` block"
        )


#: Code blocks that are not included from a file under examples/docs/, each with why it
#: need not be: (page, how the block's first line starts) -> reason. Anything else must be
#: a file that a script of the suite runs.
NOT_FROM_A_FILE: dict[tuple[str, str], str] = {
    ("guides/periodic.md", "INSERT INTO tasks_schedules"):
        "the statement claim_schedule_tick() renders, shown to explain it; tests/test_periodic.py runs the builder",
    ("guides/flow.md", "... WHERE status = 'pending'"):
        "the one-queue claim's condition, abridged; tests/test_pause.py runs every claim shape",
    ("guides/flow.md", "Result  One-Time Filter"):
        "the plan it gets, abridged; tests/test_pause.py asserts the one-time filter",
    ("reference/sql.md", "Update on account_jobs"):
        "a plan PostgreSQL printed, abridged, shown to explain it; tests/test_flow.py runs the claim",
    ("reference/sql.md", "->  Index Scan using rated_jobs_claim_idx"):
        "a plan PostgreSQL printed, abridged; tests/test_rate_limits.py runs the claim",
    ("reference/sql.md", "->  Index Scan using ordered_jobs_claim_idx"):
        "a plan PostgreSQL printed, abridged; tests/test_in_order.py runs the claim",
    ("reference/sql.md", "CTE pending_keys"):
        "a plan PostgreSQL printed, abridged; tests/test_flow.py asserts the rows a fair claim reads",
    ("reference/sql.md", "UPDATE email_jobs SET status='running'"):
        "the claim statement as compiled, shown to explain it; tests/test_sql.py runs the builder",
    ("internals/job-life.md", "enqueue / enqueue_many"):
        "a drawing of the job's states, not code",
    ("operations/failover.md", "postgresql+psycopg://app@/shop?host=db1.internal"):
        "a URL naming the reader's hosts; tests/test_standby_failover.py connects with such a URL",
    ("operations/failover.md", "# postgresql.conf of the primary"):
        "settings of the reader's PostgreSQL server, not code of this project",
    ("operations/monitoring.md", "# the one to alert on"):
        "PromQL for the reader's Prometheus; the metric names are the exporter's (tests/test_prometheus.py)",
}
#: Shell blocks hold commands a reader types, not programs: sqla-queue lines run the real
#: parser (test_every_sqla_queue_command_shown_is_accepted_by_the_parser); the others
#: install, run a file of this repository, or start a server of the reader's.
SHELL_COMMANDS = ("sqla-queue ", "pip install ", "python ", "flask ", "uvicorn ", "export ", "DATABASE_URL=")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(DOCS)))
def test_every_code_block_is_a_tested_file_or_says_why_not(page: Path) -> None:
    name = str(page.relative_to(DOCS))
    for match in FENCE.finditer(page.read_text()):
        lines = [line.strip() for line in match.group("body").splitlines() if line.strip()]
        if match.group("lang") == "python" or all(INCLUDE.fullmatch(line) for line in lines):
            for line in lines:  # Python blocks: test_every_python_block_is_included_from_a_file_...
                include = INCLUDE.fullmatch(line)
                if include and not include["file"].endswith(".py"):
                    target = SNIPPETS / include["file"]
                    assert target.is_file(), f"{name}: {include['file']} is not under examples/docs/"
                    runners = [s.name for s in SCRIPTS if include["file"] in s.read_text()]
                    assert runners, f"{name}: no script of examples/docs/ reads {include['file']}"
            continue
        if match.group("lang") == "sh":
            for line in lines:
                assert line.startswith("#") or line.startswith(SHELL_COMMANDS), f"{name}: {line!r}"
            continue
        assert any(page_ == name and lines[0].startswith(start) for page_, start in NOT_FROM_A_FILE), (
            f"{name}: a {match.group('lang') or 'plain'} block written inline: make it a file under "
            f"examples/docs/ that a script runs, or say why not in NOT_FROM_A_FILE: {lines[0]!r}"
        )


def test_no_snippet_shows_the_test_harness() -> None:
    """_db (where the snippets find a database) is the suite's, not something to copy."""
    for page, body in blocks("python"):
        for include in INCLUDE.finditer(body):
            target = SNIPPETS / include["file"]
            source = target.read_text() if target.is_file() else ""
            if include["section"]:
                section = re.search(
                    rf"# --8<-- \[start:{include['section']}\]\n(.*?)# --8<-- \[end:{include['section']}\]",
                    source, re.S,
                )
                source = section.group(1) if section else ""
            assert "_db" not in source, f"{page.name}: {include.group(0).strip()} shows _db"


@pytest.fixture
def scratch_database(server: Server) -> Iterator[str]:
    """An empty database: autogenerate compares the models with everything in view."""
    admin = create_engine(server.admin_url, isolation_level="AUTOCOMMIT")
    name = f"sqla_queue_docs_{uuid.uuid4().hex[:8]}"
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
        yield server.url.set(database=name).render_as_string(hide_password=False)
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    finally:
        admin.dispose()


@pytest.mark.system
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_every_snippet_file_runs(script: Path, scratch_database: str) -> None:
    """``python FILE`` in a process of its own, forked from one that imported the
    third-party packages already (``tests/console.py``)."""
    result = console.run(
        [sys.executable, str(script)], REPO, {**os.environ, "DATABASE_URL": scratch_database}, timeout=100
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip(), "each snippet file prints what it checked"


def test_every_sqla_queue_command_shown_is_accepted_by_the_parser() -> None:
    parser = build_parser()
    shown = [
        (page, line.split("#", 1)[0].strip())
        for page, body in blocks("sh")
        for line in body.splitlines()
        if line.strip().startswith("sqla-queue ")
    ]
    assert len(shown) >= 8
    for page, line in shown:
        argv = shlex.split(line)[1:]
        try:
            parser.parse_args(argv)
        except SystemExit as exc:
            raise AssertionError(f"{page.name}: {line!r} is refused by the parser") from exc


def _table_rows(page: str, heading: str) -> dict[str, list[str]]:
    """First column (without backticks, up to the first '(') -> the other cells, of the
    table under ``heading`` on ``page``."""
    source = (DOCS / page).read_text()
    section = source.split(heading, 1)[1]
    rows: dict[str, list[str]] = {}
    for line in section.splitlines()[1:]:
        if line.startswith("#"):
            break
        if not line.startswith("|") or set(line) <= set("|- "):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        name = re.sub(r"\(.*", "", cells[0].strip("`")).strip("`")
        rows[name] = cells[1:]
    return rows


def test_the_worker_options_table_lists_every_option_with_type_and_default() -> None:
    rows = _table_rows("reference/worker-options.md", "## Options")
    rows.pop("option", None)
    expected = {f.name for f in fields(WorkerConfig)} | {"session_factory", "job_context", "observers", "config"}
    assert set(rows) == expected
    for f in fields(WorkerConfig):
        kind, default, meaning, _flag = rows[f.name]
        assert kind and default and meaning, f.name
    defaults = WorkerConfig()
    for name in ("concurrency", "sweep_interval", "poll_interval", "shutdown_grace", "max_error_length"):
        number = float(re.sub(r"[^\d.]", "", rows[name][1]))
        assert number == getattr(defaults, name), (name, rows[name][1])


def test_the_worker_options_table_names_the_worker_command_s_flags() -> None:
    rows = _table_rows("reference/worker-options.md", "## Options")
    rows.pop("option", None)
    shown = {flag for *_, cell in rows.values() for flag in re.findall(r"`(--[a-z-]+)`", cell)}
    worker = build_parser().parse_args(["worker", "x:y"]).parser
    flags = {flag for action in worker._actions for flag in action.option_strings}
    options = flags - {"-h", "--help", "--log-level", "--until-idle"}  # not worker options
    assert shown == options


def test_the_builders_tables_list_every_statement_builder_once() -> None:
    listed: list[str] = []
    for heading in ("## What the worker runs", "## Single calls", "## Unique jobs", "## Administration"):
        rows = _table_rows("reference/sql.md", heading)
        rows.pop("builder", None)
        listed += rows
    assert sorted(listed) == sorted(_statement_builders())


def test_every_builder_of_sql_py_is_public_and_on_the_builders_page() -> None:
    page = (DOCS / "reference" / "sql.md").read_text()
    functions = {
        name
        for name, obj in vars(q).items()
        if inspect.isfunction(obj) and obj.__module__ == q.__name__ and not name.startswith("_")
    }
    assert functions <= set(q.__all__), functions - set(q.__all__)
    for name in functions:
        assert f"        - {name}\n" in page, name


def _statement_builders() -> set[str]:
    """The functions of the sql package that build a statement (their return annotation says so)."""
    return {
        name
        for name, obj in vars(q).items()
        if inspect.isfunction(obj) and obj.__module__ == q.__name__ and not name.startswith("_")
        and re.search(r"^((Returning)?(Select|Update|CompoundSelect|Delete|Insert)|Finishing)\b",
                      str(obj.__annotations__.get("return", "")))
    }


def _builders_the_worker_calls() -> set[str]:
    """Every ``sql.<builder>(...)`` call in the operations layer, the one package that runs
    the worker's statements (its modules import sql as a module; tests/unit/test_structure.py
    checks that no service of the worker imports it)."""
    called: set[str] = set()
    for path in sorted((REPO / "sqla_queue" / "ops").glob("*.py")):
        tree = ast.parse(path.read_text())
        aliases = {
            alias.asname or alias.name
            for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module is None and node.level == 2
            for alias in node.names if alias.name == "sql"
        }
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id in aliases):
                called.add(node.func.attr)
            if isinstance(node, ast.ImportFrom) and node.module == "sql" and node.level == 2:
                called.update(alias.name for alias in node.names)
    assert called, "no module of sqla_queue/ops/ imports sql as a module: the scan found nothing"
    return called & _statement_builders()


def test_the_table_of_what_the_worker_runs_lists_exactly_its_statements() -> None:
    rows = _table_rows("reference/sql.md", "## What the worker runs")
    rows.pop("builder", None)
    worker = _builders_the_worker_calls()
    assert len(worker) >= 10, worker  # the scan finds the worker's statements
    assert set(rows) == worker


def test_the_cli_reference_is_rendered_from_the_parser() -> None:
    spec = importlib.util.spec_from_file_location("cli_reference", DOCS / "hooks" / "cli_reference.py")
    assert spec and spec.loader
    cli_reference = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli_reference)
    page = (DOCS / "reference" / "cli.md").read_text()
    assert cli_reference.MARKER in page
    rendered = cli_reference.cli_reference()
    parser = build_parser()
    subcommands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in subcommands.choices.items():
        assert f"## `sqla-queue {name}`" in rendered
        for action in sub._actions:
            for flag in action.option_strings:
                assert flag in rendered, (name, flag)


#: Public names the API page renders from elsewhere: for the docs' reader (griffe) the
#: folder sqla_queue/enqueue/ shadows the function of the same name.
RENDERED_AS = {"enqueue": "sqla_queue.enqueue.enqueue"}


def test_every_public_name_is_on_the_api_page() -> None:
    import sqla_queue

    page = (DOCS / "reference" / "api.md").read_text()
    missing = [name for name in sqla_queue.__all__ if not name.startswith("_")
               and f"::: {RENDERED_AS.get(name, f'sqla_queue.{name}')}\n" not in page]
    assert not missing, missing


def test_the_sqlmodel_column_table_lists_every_column_of_the_mixin() -> None:
    from sqlalchemy.orm import DeclarativeBase

    from sqla_queue.model import JobMixin

    class Base(DeclarativeBase):
        pass

    class Probe(Base, JobMixin):
        __tablename__ = "docs_probe_jobs"

    rows = _table_rows("guides/sqlmodel.md", "The table gets:")
    rows.pop("field", None)
    assert set(rows) == {column.name for column in Probe.__table__.columns}


def test_the_pages_count_the_mixin_s_partial_indexes_right() -> None:
    from sqlalchemy.orm import DeclarativeBase

    from sqla_queue.model import JobMixin, queue_table

    class Base(DeclarativeBase):
        pass

    class Counted(Base, JobMixin):
        __tablename__ = "docs_counted_jobs"

    words = {"two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7}
    table = queue_table(Counted).table
    partial = [index for index in table.indexes if index.dialect_options["postgresql"]["where"] is not None]
    counts = [
        (page.name, match.group(1))
        for page in PAGES
        for match in re.finditer(r"\b(\w+) partial indexes", page.read_text().replace("\n", " "))
        if match.group(1).lower() in words
    ]
    assert counts, "the pages say how many partial indexes a queue table has"
    for page_name, word in counts:
        assert words[word.lower()] == len(partial), (page_name, word, len(partial))
