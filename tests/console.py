"""Console commands (``alembic``, ``sqla-queue``, ``flask``, ``python -c``) run in a fresh
process that starts in milliseconds instead of a second.

A console script started as a new interpreter spends most of a second of CPU importing
SQLAlchemy, Alembic, psycopg and sqla_queue before it does anything, and the Alembic tests
run about a hundred of them. Here each command runs in a child of a multiprocessing fork
server that imported those packages once (:data:`PRELOAD`): still a process of its own
(its own modules, logging, working folder and environment; nothing of the test process
but the imported packages), running the console script's own entry point, read from the
installed script's metadata, with the given arguments, in the project folder. The output
and exit status are the command's, as :func:`subprocess.run` would report them. What
differs from typing the command is only the interpreter's start, which the tests that run
the real scripts (``fresh=True`` in ``tests/test_alembic.py``, and ``tests/test_cli.py``)
keep proving.
"""

from __future__ import annotations

import importlib.metadata
import multiprocessing
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: Imported once by the fork server: what the commands import before they do anything.
#: A package that is not installed is skipped (the fork server ignores ImportError).
PRELOAD = [
    "sqlalchemy",
    "sqlalchemy.orm",
    "sqlalchemy.dialects.postgresql.psycopg",
    "psycopg",
    "alembic.config",
    "alembic.command",
    "alembic.autogenerate",
    "alembic.runtime.migration",
    "mako.template",
    "sqla_queue",
    "sqla_queue.alembic",
    "sqla_queue.alembic_ops",
    "sqla_queue.cli",
    "sqlmodel",
    "flask",
    "flask.cli",
    "flask_sqlalchemy",
    "flask_migrate",
]


def _context() -> Any:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context


def _entry_point(script: str) -> str:
    """``module:function`` of an installed console script (``alembic``, ``flask``, …)."""
    (found,) = importlib.metadata.entry_points(group="console_scripts", name=script)
    return str(found.value)


def _child(entry: str | None, argv: list[str], cwd: str, env: dict[str, str], out: str, err: str) -> None:
    """In the forked process: the command's folder, environment, ``sys.path[0]``,
    ``sys.argv`` and standard streams, then its entry point (or the ``-c`` code)."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.dont_write_bytecode = bool(env.get("PYTHONDONTWRITEBYTECODE"))
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115 - the process's own, to its end
    sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
    # As the interpreter sets it: the script's folder first, or "" (the current folder)
    # for -c; never the test process's own current folder.
    sys.path[:] = [argv[0] if entry is None else os.path.dirname(argv[0])] + [p for p in sys.path if p]
    if entry is None:  # ["", "-c", CODE, *args]
        sys.argv = ["-c", *argv[3:]]
        exec(compile(argv[2], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        return
    sys.argv = list(argv)
    module, _, function = entry.partition(":")
    main = getattr(__import__(module, fromlist=[function]), function)
    sys.exit(main())


class Result:
    """What :func:`subprocess.run` returns, the parts the tests read."""

    def __init__(self, returncode: int, stdout: str, stderr: str) -> None:
        self.returncode = returncode
        self.stdout = stdout
        self.stderr = stderr


def run(command: Sequence[str | Path], cwd: Path, env: dict[str, str], timeout: float) -> Result:
    """Run ``command`` (a console script of this environment's ``bin``, or ``python -c``)
    in a forked process; its exit status and output."""
    parts = [str(part) for part in command]
    if Path(parts[0]) == Path(sys.executable):
        if parts[1] != "-c":
            raise ValueError(f"only python -c runs forked: {parts}")
        entry, argv = None, ["", *parts[1:]]
    else:
        entry, argv = _entry_point(Path(parts[0]).name), parts
    with tempfile.TemporaryDirectory() as folder:
        out, err = os.path.join(folder, "stdout"), os.path.join(folder, "stderr")
        process = _context().Process(target=_child, args=(entry, argv, str(cwd), env, out, err))
        process.start()
        process.join(timeout)
        if process.exitcode is None:
            process.kill()
            process.join()
            raise TimeoutError(f"{parts} did not exit within {timeout} s")
        code = process.exitcode
        stdout, stderr = Path(out).read_text(), Path(err).read_text()
    return Result(code, stdout, stderr)
