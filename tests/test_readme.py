"""The README's promises that can be checked mechanically."""

from __future__ import annotations

import re
import textwrap
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


def _readme() -> str:
    return (REPO / "README.md").read_text()


def test_the_readme_stays_short() -> None:
    assert len(_readme().splitlines()) <= 250


def test_the_install_line_names_the_distribution() -> None:
    # (tomllib is Python 3.11+; the name is the first `name =` line of [project])
    project = (REPO / "pyproject.toml").read_text().split("[project]", 1)[1]
    found = re.search(r'^name = "([^"]+)"', project, re.M)
    assert found
    name = found.group(1)
    assert re.search(rf"^pip install {re.escape(name)}\s", _readme(), re.M), name


def test_the_readme_links_work_on_the_package_index() -> None:
    """The index renders the README without the repository: no relative links."""
    links = re.findall(r"\]\(([^)]+)\)", _readme())
    assert links
    assert all(link.startswith("https://") for link in links), links


def test_the_readme_example_is_the_first_job_file_the_suite_runs() -> None:
    """examples/docs/first_job.py runs in tests/test_docs.py; the README shows its sections."""
    source = (REPO / "examples" / "docs" / "first_job.py").read_text()

    def section(name: str) -> str:
        marks = rf"^[ \t]*# --8<-- \[start:{name}\]\n(.*?)^[ \t]*# --8<-- \[end:{name}\]"
        found = re.search(marks, source, re.S | re.M)
        assert found, name
        return textwrap.dedent(found.group(1)).strip("\n")

    blocks = re.findall(r"```python\n(.*?)```", _readme(), re.S)
    assert blocks == ["\n\n".join(section(name) for name in ("model", "handler", "run")) + "\n"]
