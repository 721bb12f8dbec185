"""The internals map (``docs/internals/architecture.md``) kept true by tests: a row for
every module of the package and none for a module that is gone, every service on the
threads table, and every file the traced job's life names still there.

Pure reading of files: no import of the package, no database.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "sqla_queue"
MAP = REPO / "docs" / "internals" / "architecture.md"


def _section(title: str) -> str:
    """The text of the map's ``## title`` section, up to the next one."""
    text = MAP.read_text()
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"docs/internals/architecture.md has no '## {title}' section"
    return match.group(1)


def _named_modules(cell: str) -> list[str]:
    """The module paths a table cell names: ``sqla_queue/a/b.py``, then ``c.py`` beside it."""
    names: list[str] = []
    folder = ""
    for name in re.findall(r"`([^`]+)`", cell):
        if name.startswith("sqla_queue/"):
            folder = name.rsplit("/", 1)[0] if name.endswith(".py") else name.rstrip("/")
            names.append(name if name.endswith(".py") else name.rstrip("/") + "/__init__.py")
        elif name.endswith(".py") and folder:
            names.append(f"{folder}/{name}")
    return names


def _mapped() -> set[str]:
    mapped: set[str] = set()
    for line in _section("Modules").splitlines():
        if line.startswith("| `"):
            mapped.update(_named_modules(line.split("|")[1]))
    return mapped


def _modules() -> set[str]:
    return {str(p.relative_to(REPO)) for p in PACKAGE.rglob("*.py")}


def test_every_module_of_the_package_has_a_row_on_the_map() -> None:
    missing = sorted(_modules() - _mapped())
    assert not missing, f"modules without a row in docs/internals/architecture.md: {missing}"


def test_every_row_of_the_map_names_a_module_that_exists() -> None:
    stale = sorted(_mapped() - _modules())
    assert not stale, f"rows of docs/internals/architecture.md for modules that are gone: {stale}"


def _service_names() -> set[str]:
    """The ``name`` of every :class:`Service` subclass of the worker package."""
    names: set[str] = set()
    for path in (PACKAGE / "worker").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                for stmt in node.body:
                    if (
                        isinstance(stmt, ast.Assign)
                        and any(isinstance(t, ast.Name) and t.id == "name" for t in stmt.targets)
                        and isinstance(stmt.value, ast.Constant)
                        and isinstance(stmt.value.value, str)
                        and stmt.value.value != "service"
                    ):
                        names.add(stmt.value.value)
    return names


def test_the_map_counts_the_services_it_must() -> None:
    assert {"executor", "heartbeat", "listener", "sweeper", "watchdog"} <= _service_names()


def test_every_service_is_on_the_threads_table() -> None:
    table = _section("What runs where")
    missing = sorted(n for n in _service_names() if f"`{n}`" not in table)
    assert not missing, f"services missing from the threads table: {missing}"


def test_every_file_the_traces_name_exists() -> None:
    traces = _section("A job's life, traced")
    named = set(re.findall(r"`(sqla_queue/[^`]+\.py)`", traces))
    assert named, "the traces name no file"
    gone = sorted(n for n in named if not (REPO / n).is_file())
    assert not gone, f"the traces name files that are gone: {gone}"
