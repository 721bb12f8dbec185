"""MkDocs hook: the command-line reference, rendered from the real argparse parser.

A page holding the line ``<!-- cli-reference -->`` gets, in its place, the ``--help`` of
``sqla-queue`` and of each of its subcommands (nested ones included), as the installed
parser prints them, so the reference cannot drift from the code.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

MARKER = "<!-- cli-reference -->"


def _subparsers(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return list(action.choices.items())
    return []


def _render(parser: argparse.ArgumentParser, command: str, level: int) -> list[str]:
    out = [f"{'#' * level} `{command}`", "", "```text", parser.format_help().rstrip(), "```", ""]
    for name, sub in _subparsers(parser):
        out += _render(sub, f"{command} {name}", min(level + 1, 4))
    return out


def cli_reference() -> str:
    from sqla_queue.cli import build_parser

    os.environ["COLUMNS"] = "100"  # argparse wraps to the terminal's width: pin it
    return "\n".join(_render(build_parser(), "sqla-queue", 2))


def on_page_markdown(markdown: str, **_: Any) -> str:
    if MARKER in markdown:
        return markdown.replace(MARKER, cli_reference())
    return markdown
