"""The README's promises that can be checked mechanically."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def quick_start_commands() -> list[str]:
    readme = (REPO / "README.md").read_text()
    block = re.search(r"## Quick start.*?```sh\n(.*?)```", readme, re.S)
    assert block, "the README needs a Quick start with a sh block"
    return [line for line in block.group(1).splitlines() if line.strip()]


def test_the_first_command_runs_the_demo_and_the_second_the_tests() -> None:
    demo, tests = quick_start_commands()
    assert "sqla_queue.demo" in demo and "pytest" in tests


def test_ci_runs_exactly_the_readme_commands() -> None:
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    for command in quick_start_commands():
        assert command in ci, f"{command!r} is in the README but .ci/run does not run it"
