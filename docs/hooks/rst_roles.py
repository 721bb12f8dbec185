"""Griffe extension: the package's docstrings use Sphinx roles (``:class:`~x.Y```), which
Markdown would show as they are; render them as code spans (``Y``) instead."""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|data|attr|exc|obj):`(?P<tilde>~?)(?P<target>[^`]+)`")


def _span(match: re.Match[str]) -> str:
    target = match["target"]
    if match["tilde"]:
        target = target.rsplit(".", 1)[-1]
    return f"`{target}`"


class SphinxRoles(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **_: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = ROLE.sub(_span, obj.docstring.value)
