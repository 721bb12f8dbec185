"""docs/operations/failover.md: its code is the code of ``examples/failover.py``, which
runs; the README hands the idempotency key, not ``job.id``, to external APIs."""

from __future__ import annotations

import re
from pathlib import Path

from .helpers import Server
from .test_examples import run_example

REPO = Path(__file__).resolve().parent.parent
PAGE = REPO / "docs" / "operations" / "failover.md"


def python_blocks(markdown: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", markdown, re.S)


def test_every_python_block_of_the_page_is_in_the_example() -> None:
    example = (REPO / "examples" / "failover.py").read_text()
    blocks = python_blocks(PAGE.read_text())
    assert len(blocks) == 3
    for block in blocks:
        lines = [line for line in block.splitlines() if line.strip()]
        indented = [line for line in example.splitlines() if line.strip()]
        # The block's lines, in order and adjacent, at some indentation of the example's.
        assert any(
            [line.strip() for line in indented[at:at + len(lines)]] == [line.strip() for line in lines]
            for at in range(len(indented))
        ), f"not in examples/failover.py:\n{block}"


def test_the_example_charges_once_for_two_runs(server: Server) -> None:
    out = run_example("failover.py", server)
    assert "enqueued with idempotency key" in out
    assert "requests to the provider: 2, charges made: 1" in out


def test_the_readme_never_advises_the_job_id_as_an_idempotency_key() -> None:
    readme = (REPO / "README.md").read_text()
    assert "idempotency_key=job.id" not in readme
    assert "pass `job.id` as the idempotency key" not in readme
    assert "idempotency_key" in readme
