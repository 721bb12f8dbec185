"""Commands a user types (``alembic``, ``sqla-queue``, ``flask``, ``python FILE``,
``python -m MODULE``, ``python -c CODE``), each run in a process of its own that starts in
milliseconds.

A new interpreter spends most of a second of CPU importing SQLAlchemy, psycopg, Alembic
(or FastAPI, SQLModel, Flask) before the command does anything, and the suite runs a few
hundred such commands (:func:`run`) and starts a few hundred worker processes
(:func:`start`, behind ``tests.helpers.WorkerProcess``). Here each runs in a child of a multiprocessing fork server that
imported those third-party packages once (:data:`PRELOAD`; sqla_queue's top level too,
none of its optional modules): still a process of its own, with its own modules, logging,
working folder, environment and ``sys.argv``, nothing of the test process's. It runs what
the interpreter would: a console script's entry point (read from the installed script's
metadata), a file as ``__main__`` with its folder first on ``sys.path``, a module as
``__main__`` with the current folder first, or ``-c`` code with ``""`` first; then, at
its end, it joins the non-daemon threads and runs the ``atexit`` functions. Its exit
status and output are the command's, as :func:`subprocess.run` reports them.

What differs from typing the command is only the interpreter's start; the tests that
run commands as typed, in new interpreters, keep proving that: ``fresh=True`` in
``tests/test_alembic.py``, ``tests/test_examples.py`` and ``tests/test_flask.py``, and
``tests/test_cli.py``, ``tests/test_demo.py`` and the ``subprocess`` workers of
``tests/test_worker_processes.py``.
"""

from __future__ import annotations

import atexit
import importlib.metadata
import io
import multiprocessing
import os
import runpy
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: Imported once by the fork server. A package that is not installed is skipped (the
#: fork server ignores ImportError).
PRELOAD = [
    "sqlalchemy",
    "sqlalchemy.orm",
    "sqlalchemy.ext.asyncio",
    "sqlalchemy.dialects.postgresql.psycopg",
    "psycopg",
    "alembic.config",
    "alembic.command",
    "alembic.autogenerate",
    "alembic.runtime.migration",
    "mako.template",
    "sqlmodel",
    "pydantic",
    "fastapi",
    "httpx",
    "flask",
    "flask.cli",
    "flask_sqlalchemy",
    "flask_migrate",
    "sqla_queue",
]


class Result:
    """The parts of :class:`subprocess.CompletedProcess` the tests read."""

    def __init__(self, returncode: int, stdout: str, stderr: str) -> None:
        self.returncode = returncode
        self.stdout = stdout
        self.stderr = stderr


def run(command: Sequence[str | Path], cwd: Path, env: dict[str, str], timeout: float) -> Result:
    """Run ``command`` in ``cwd`` with exactly the environment ``env``, to its end: a
    console script of this environment, or ``sys.executable`` with ``FILE``,
    ``-m MODULE`` or ``-c CODE``, then the arguments."""
    with tempfile.TemporaryDirectory() as folder:
        out, err = os.path.join(folder, "stdout"), os.path.join(folder, "stderr")
        process = _process(command, cwd, env, out, err, daemon=False)
        process.start()
        process.join(timeout)
        if process.exitcode is None:
            process.kill()
            process.join()
            raise TimeoutError(f"{command} did not exit within {timeout} s")
        # A child that failed before it opened them (it could not even start) wrote nothing.
        stdout, stderr = (Path(path).read_text() if os.path.exists(path) else "" for path in (out, err))
        return Result(process.exitcode, stdout, stderr)


class Started:
    """A command :func:`start` started: the parts of :class:`subprocess.Popen` the tests
    use (``pid``, ``poll()``, ``wait()``, ``kill()``)."""

    def __init__(self, process: Any, command: Sequence[str | Path]) -> None:
        self._process = process
        self.args = [str(part) for part in command]
        self.pid: int = process.pid

    @property
    def returncode(self) -> int | None:
        """The exit status, ``-N`` for signal N; None while it runs."""
        code: int | None = self._process.exitcode
        return code

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        code = self.returncode
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code

    def kill(self) -> None:
        if self.poll() is None:  # as Popen: never a signal to a pid that may be another's now
            self._process.kill()


def start(command: Sequence[str | Path], cwd: Path, env: dict[str, str], log: Path) -> Started:
    """Start ``command`` (as :func:`run` takes it) in the background, its standard output
    and error appended to ``log`` together (``stderr=STDOUT``). A process left running
    when the test process exits is ended then (a daemon of it)."""
    process = _process(command, cwd, env, str(log), str(log), daemon=True)
    process.start()
    return Started(process, command)


def _process(
    command: Sequence[str | Path], cwd: Path, env: dict[str, str], out: str, err: str, *, daemon: bool
) -> Any:
    parts = [str(part) for part in command]
    if Path(parts[0]) == Path(sys.executable):
        if parts[1] == "-c":
            what, path0, argv = ("code", parts[2]), "", ["-c", *parts[3:]]
        elif parts[1] == "-m":
            what, path0, argv = ("module", parts[2]), str(cwd), ["-m", *parts[3:]]
        elif not parts[1].startswith("-"):
            script = os.path.join(str(cwd), parts[1])  # as the interpreter finds it
            what, path0, argv = ("file", script), os.path.dirname(os.path.realpath(script)), parts[1:]
        else:
            raise ValueError(f"not a command this runs: {parts}")
    else:
        (entry,) = importlib.metadata.entry_points(group="console_scripts", name=Path(parts[0]).name)
        what, path0, argv = ("entry", str(entry.value)), str(Path(parts[0]).parent), parts
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context.Process(target=_child, args=(what, path0, argv, str(cwd), env, out, err), daemon=daemon)


def _child(
    what: tuple[str, str], path0: str, argv: list[str], cwd: str, env: dict[str, str], out: str, err: str
) -> None:
    """In the forked process: the command's folder, environment, ``sys.path[0]``,
    ``sys.argv`` and standard streams; the command; then the interpreter's exit steps."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None  # found again from this environment's TMPDIR, not the server's
    sys.dont_write_bytecode = bool(env.get("PYTHONDONTWRITEBYTECODE"))
    # One open file for both when they go to the same place (stderr=STDOUT): one offset.
    first = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(first, 1)
    second = first if err == out else os.open(err, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(second, 2)
    for fd in {first, second}:
        os.close(fd)
    # As the interpreter opens them: stdout to a file block-buffered, stderr line-buffered;
    # both written through at once with PYTHONUNBUFFERED.
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=unbuffered)
    sys.stderr = io.TextIOWrapper(
        io.FileIO(2, "w", closefd=False), write_through=unbuffered, line_buffering=not unbuffered,
        errors="backslashreplace",
    )
    sys.path[:] = [path0, *(p for p in sys.path if p)]  # never the test process's folder
    sys.argv = list(argv)
    kind, value = what
    code: Any = 0
    try:
        if kind == "entry":
            module, _, function = value.partition(":")
            code = getattr(__import__(module, fromlist=[function]), function)()
        elif kind == "file":
            runpy.run_path(value, run_name="__main__")
        elif kind == "module":  # sys.argv[0] becomes the module's file, as with -m
            runpy.run_module(value, run_name="__main__", alter_sys=True)
        else:
            exec(compile(value, "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    finally:
        threading._shutdown()  # type: ignore[attr-defined]  # as the interpreter exits: threads
        atexit._run_exitfuncs()  # then the atexit functions, which a forked child skips
    sys.exit(code)
