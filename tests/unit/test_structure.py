"""The package's module edges, read from the source: no import circle inside
``sqla_queue``, the enqueue side (``sqla_queue/enqueue/``) never reaches the worker, nor
the worker it but through its facade, the worker never imports the statement package,
and each statement module stays small.

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

def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()
#: The modules of the enqueue side (sqla_queue/enqueue/): what a web request that enqueues imports.
ENQUEUE_SIDE = sorted(m for m in MODULES if m == "sqla_queue.enqueue" or m.startswith("sqla_queue.enqueue."))
#: Where the worker meets the enqueue side: ``Worker`` and ``AsyncWorker`` hand their
#: handlers a ``QueueSession`` and their scheduler ``enqueue_values``.
WORKER_FACADES = frozenset({"sqla_queue.worker", "sqla_queue.worker.aio"})


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


def test_the_enqueue_side_is_its_folder() -> None:
    assert len(ENQUEUE_SIDE) >= 11, ENQUEUE_SIDE  # the package and its ten modules
    assert {"sqla_queue.enqueue.session", "sqla_queue.enqueue.waker", "sqla_queue.enqueue._rules"} <= set(ENQUEUE_SIDE)


@pytest.mark.parametrize("module", ENQUEUE_SIDE)
def test_the_enqueue_side_never_imports_the_worker(module: str) -> None:
    graph = _graph()
    assert module in graph
    worker = {m for m in _reachable(graph, module) if m == "sqla_queue.worker" or m.startswith("sqla_queue.worker.")}
    assert not worker, f"{module} reaches {sorted(worker)}"
    assert "sqla_queue.driver" not in _reachable(graph, module), f"{module} reaches the worker's driver"


def test_what_the_enqueue_side_stands_on_never_imports_it() -> None:
    """The modules below the enqueue side (the model, the statement builders, the periodic
    module they read the watermark table from, …) never import it back: importing one of
    its modules runs ``sqla_queue/enqueue/__init__.py``, which imports them all."""
    graph = _graph()
    below = set().union(*(_reachable(graph, m) for m in ENQUEUE_SIDE)) - set(ENQUEUE_SIDE)
    assert {"sqla_queue.model", "sqla_queue.sql", "sqla_queue.periodic"} <= below
    upward = {m: sorted(_reachable(graph, m) & set(ENQUEUE_SIDE)) for m in sorted(below)}
    assert not {m: up for m, up in upward.items() if up}


def test_the_worker_meets_the_enqueue_side_only_in_its_facade() -> None:
    """No service of the worker, nor what they import (operations, driver, tasks,
    schedules), reaches the enqueue side: only ``Worker`` and ``AsyncWorker`` do, handing
    in what their services need of it."""
    graph = _graph()
    services = {m for m in MODULES if m.startswith("sqla_queue.worker.")} - WORKER_FACADES
    worker_side = set(services).union(*(_reachable(graph, m) for m in services))
    assert {"sqla_queue.ops", "sqla_queue.periodic", "sqla_queue.tasks"} <= worker_side
    assert not worker_side & WORKER_FACADES, "a service imports the worker's facade"
    reached = {m: sorted(_reachable(graph, m) & set(ENQUEUE_SIDE)) for m in sorted(worker_side)}
    assert not {m: up for m, up in reached.items() if up or m in ENQUEUE_SIDE}


#: The services of the worker: they call the operations layer, never a statement builder.
WORKER_MODULES = sorted(m for m in MODULES if m.startswith("sqla_queue.worker."))
#: The statement package: sqla_queue.sql, its public face, over its private modules.
STATEMENT_PACKAGE = "sqla_queue.sql"


def _in_statement_package(module: str) -> bool:
    return module == STATEMENT_PACKAGE or module.startswith(STATEMENT_PACKAGE + ".")


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
    assert "sql" in _sql_imports("sqla_queue.ops.queue")  # from .. import sql as q
    assert "is_solitary" in _sql_imports("sqla_queue.ops.queue")  # from ..sql import ClaimToken, is_solitary
    assert "cancel_jobs" in _sql_imports("sqla_queue.cancel")  # from .sql import _queue_names, cancel_jobs
    assert "sqla_queue.sql._notify" in _graph()["sqla_queue.driver"]  # a private module of the package
    assert len(WORKER_MODULES) >= 10, WORKER_MODULES


@pytest.mark.parametrize("module", ["sqla_queue.worker", *WORKER_MODULES])
def test_no_worker_module_imports_the_statement_package(module: str) -> None:
    """Only the operations layer (sqla_queue.ops) picks, compiles and binds statements; the
    worker's value types live in sqla_queue.model (ClaimToken) and sqla_queue.retry (Backoff)."""
    taken = sorted(m for m in _graph()[module] if _in_statement_package(m))
    assert not taken, (
        f"{module} imports {taken}: call sqla_queue.ops, and take ClaimToken from sqla_queue.model, "
        "Backoff from sqla_queue.retry"
    )


@pytest.mark.parametrize("module", WORKER_MODULES)
def test_no_service_names_a_statement_parameter(module: str) -> None:
    """Bind names (the ``*_PARAM`` constants) belong to the operations layer."""
    source = MODULES[module].read_text()
    assert "_PARAM" not in source, f"{module} names a statement parameter"


#: The most lines a private module of the statement package may have (``__init__``, the
#: public face of re-exports, aside): a stage of a job's life that outgrows it splits.
STATEMENT_MODULE_LINES = 400
STATEMENT_MODULES = sorted(m for m in MODULES if m.startswith(STATEMENT_PACKAGE + "."))


def test_the_statement_package_is_split_by_stage() -> None:
    """The checks below would pass on nothing if the package were one module again."""
    assert MODULES[STATEMENT_PACKAGE].name == "__init__.py"
    assert len(STATEMENT_MODULES) >= 8, STATEMENT_MODULES


@pytest.mark.parametrize("module", STATEMENT_MODULES)
def test_statement_modules_stay_under_their_size(module: str) -> None:
    lines = len(MODULES[module].read_text().splitlines())
    assert lines <= STATEMENT_MODULE_LINES, (
        f"{module} has {lines} lines, more than {STATEMENT_MODULE_LINES}: split it by stage"
    )


def test_the_driver_runs_statements_without_picking_them() -> None:
    """The transport knows no statement builder: the operations layer hands it compiled ones.
    Of the statement package it takes the NOTIFY builder alone, as every sender does."""
    assert _sql_imports("sqla_queue.driver") == []
    assert {m for m in _graph()["sqla_queue.driver"] if _in_statement_package(m)} == {"sqla_queue.sql._notify"}


def test_every_job_outcome_has_its_counter() -> None:
    """A new JobOutcome is one enum value and the WorkerStats counter of the same name:
    the hooks count each end under its outcome's name."""
    from dataclasses import fields

    from sqla_queue import JobOutcome, WorkerStats

    counters = {f.name for f in fields(WorkerStats)}
    assert {o.value for o in JobOutcome} <= counters


#: The plugins over the worker: observers a caller passes (or the package builds for a
#: worker option), never imported by the worker.
PLUGINS = ("sqla_queue.prometheus", "sqla_queue.otel", "sqla_queue.sentry")


@pytest.mark.parametrize("plugin", PLUGINS)
def test_the_worker_never_reaches_its_plugins(plugin: str) -> None:
    graph = _graph()
    assert plugin in graph
    reaching = [m for m in ["sqla_queue.worker", *WORKER_MODULES] if plugin in _reachable(graph, m)]
    assert not reaching, f"{reaching} reach {plugin}: take its observer instead"
