"""The ``sqla-queue`` command line."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

__all__ = ["main"]


def _add_alembic_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``sqla-queue alembic init DIR``: a migrations folder from ``alembic_templates/``."""
    alembic = subparsers.add_parser("alembic", help="Alembic migrations for queue tables")
    alembic_commands = alembic.add_subparsers(dest="alembic_command", required=True)
    init = alembic_commands.add_parser("init", help="create a migrations folder wired for sqla_queue")
    init.add_argument("directory", help="the migrations folder to create (must be empty or absent)")
    init.add_argument(
        "-c", "--config", default="alembic.ini", help="the alembic.ini to write, unless it exists"
    )
    init.add_argument(
        "--package", action="store_true", help="write __init__.py files into the folders"
    )
    init.set_defaults(func=_alembic_init)


def _alembic_init(args: argparse.Namespace) -> int:
    # Imported here: the other commands need not load Alembic.
    from alembic.util import CommandError

    from .alembic import init

    try:
        init(args.directory, config_file=args.config, package=args.package)
    except CommandError as exc:
        print(f"sqla-queue: {exc}", file=sys.stderr)
        return 1
    print(f"Then set target_metadata in {os.path.join(args.directory, 'env.py')}.")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sqla-queue", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_alembic_commands(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
