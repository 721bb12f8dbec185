"""The ``sqla-queue`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["main"]


def _add_alembic_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``sqla-queue alembic init DIR``: a migrations folder from ``alembic_templates/``."""
    alembic = subparsers.add_parser("alembic", help="Alembic migrations for queue tables")
    alembic_commands = alembic.add_subparsers(dest="alembic_command", required=True)
    init = alembic_commands.add_parser("init", help="create a migrations folder wired for sqla_queue")
    init.add_argument("directory")
    init.set_defaults(func=_not_yet)


def _not_yet(args: argparse.Namespace) -> int:
    print("not implemented yet", file=sys.stderr)
    return 2


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
