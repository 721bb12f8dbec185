"""The package's module edges, read from the source: no import circle inside
``sqla_queue``, and the enqueue side never reaches the worker.

Pure Python (``ast``), no import of the package and no database. Every import counts,
a function-level one too (that is how a circle usually hides), except those under
``if TYPE_CHECKING:``, which never run.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = "sqla_queue"
ROOT = Path(__file__).resolve().parents[2] / PACKAGE

#: The modules of the enqueue side: what a web request that enqueues imports.
ENQUEUE_SIDE = (
    "sqla_queue.session",
    "sqla_queue.bulk",
    "sqla_queue.values",
    "sqla_queue.options",
    "sqla_queue.rows",
    "sqla_queue.outbox",
)


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement, skipping the bodies of ``if TYPE_CHECKING:``."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
            continue
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _resolve(module: str, node: ast.Import | ast.ImportFrom) -> set[str]:
    """The modules of the package that ``node``, in ``module``, imports."""
    targets: set[str] = set()
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        if node.level:
            is_package = MODULES[module].name == "__init__.py"
            base = module.split(".")
            base = base[: len(base) - node.level + (1 if is_package else 0)]
            prefix = ".".join(base + ([node.module] if node.module else []))
        else:
            prefix = node.module or ""
        # ``from pkg import name``: the submodule pkg.name when there is one, else pkg.
        names = [
            f"{prefix}.{alias.name}" if f"{prefix}.{alias.name}" in MODULES else prefix for alias in node.names
        ]
    for name in names:
        if name in MODULES:
            targets.add(name)
        elif name.startswith(PACKAGE + ".") and name.rsplit(".", 1)[0] in MODULES:
            targets.add(name.rsplit(".", 1)[0])  # a name defined in a module
    return targets


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        edges: set[str] = set()
        for node in _imports(ast.parse(path.read_text(), str(path))):
            edges |= _resolve(module, node)
        edges.discard(module)
        graph[module] = edges
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component: list[str] = []
            while True:
                item = stack.pop()
                on_stack.discard(item)
                component.append(item)
                if item == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for nxt in graph[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_the_reader_sees_the_imports_it_must() -> None:
    """The graph is built from real edges (else the tests below would pass on nothing)."""
    graph = _graph()
    assert "sqla_queue.worker" in graph["sqla_queue"]
    assert "sqla_queue.sql" in graph["sqla_queue.admin"]  # from . import sql as q
    assert "sqla_queue.driver" in graph["sqla_queue.worker.executor"]  # from ..driver import …
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]


def test_no_import_circle_in_the_package() -> None:
    assert _cycles(_graph()) == []


@pytest.mark.parametrize("module", ENQUEUE_SIDE)
def test_the_enqueue_side_never_imports_the_worker(module: str) -> None:
    graph = _graph()
    assert module in graph
    worker = {m for m in _reachable(graph, module) if m == "sqla_queue.worker" or m.startswith("sqla_queue.worker.")}
    assert not worker, f"{module} reaches {sorted(worker)}"
    assert "sqla_queue.driver" not in _reachable(graph, module), f"{module} reaches the worker's driver"


#: The services of the worker: they call the operations layer, never a statement builder.
WORKER_MODULES = sorted(m for m in MODULES if m.startswith("sqla_queue.worker."))
#: What a worker module may take from sqla_queue.sql: the value types defined there.
SQL_VALUE_TYPES = frozenset({"ClaimToken", "Backoff"})


def _sql_imports(module: str) -> list[str]:
    """What ``module`` imports of ``sqla_queue.sql``: ``"sql"`` for the module itself
    (``from .. import sql``, ``import sqla_queue.sql``), else each name taken from it."""
    found: list[str] = []
    path = MODULES[module]
    for node in _imports(ast.parse(path.read_text(), str(path))):
        if "sqla_queue.sql" not in _resolve(module, node):
            continue
        if isinstance(node, ast.ImportFrom) and node.module is not None and node.module.endswith("sql"):
            found += [alias.name for alias in node.names]
        else:
            found.append("sql")
    return found


def test_the_scan_sees_imports_of_sql() -> None:
    """The checks below would pass on nothing if the scan missed these."""
    assert "sql" in _sql_imports("sqla_queue.ops")  # from . import sql as q
    assert "is_solitary" in _sql_imports("sqla_queue.ops")  # from .sql import ClaimToken, is_solitary
    assert "Backoff" in _sql_imports("sqla_queue.worker.service")
    assert len(WORKER_MODULES) >= 10, WORKER_MODULES


@pytest.mark.parametrize("module", WORKER_MODULES)
def test_no_service_imports_the_statement_builders(module: str) -> None:
    """Only the operations layer (sqla_queue.ops) picks, compiles and binds statements."""
    taken = set(_sql_imports(module)) - SQL_VALUE_TYPES
    assert not taken, f"{module} imports {sorted(taken)} of sqla_queue.sql: call sqla_queue.ops instead"


@pytest.mark.parametrize("module", WORKER_MODULES)
def test_no_service_names_a_statement_parameter(module: str) -> None:
    """Bind names (the ``*_PARAM`` constants) belong to the operations layer."""
    source = MODULES[module].read_text()
    assert "_PARAM" not in source, f"{module} names a statement parameter"


def test_the_driver_runs_statements_without_picking_them() -> None:
    """The transport knows no statement builder: the operations layer hands it compiled ones."""
    assert _sql_imports("sqla_queue.driver") == []


def test_every_job_outcome_has_its_counter() -> None:
    """A new JobOutcome is one enum value and the WorkerStats counter of the same name:
    the hooks count each end under its outcome's name."""
    from dataclasses import fields

    from sqla_queue import JobOutcome, WorkerStats

    counters = {f.name for f in fields(WorkerStats)}
    assert {o.value for o in JobOutcome} <= counters


#: The plugins over the worker: observers a caller passes (or the package builds for a
#: worker option), never imported by the worker.
PLUGINS = ("sqla_queue.prometheus", "sqla_queue.otel")


@pytest.mark.parametrize("plugin", PLUGINS)
def test_the_worker_never_reaches_its_plugins(plugin: str) -> None:
    graph = _graph()
    assert plugin in graph
    reaching = [m for m in ["sqla_queue.worker", *WORKER_MODULES] if plugin in _reachable(graph, m)]
    assert not reaching, f"{reaching} reach {plugin}: take its observer instead"
