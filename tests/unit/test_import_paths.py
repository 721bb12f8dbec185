"""The import paths of the enqueue side from before it was a folder still work."""

from __future__ import annotations

import importlib
from types import ModuleType

import pytest

import sqla_queue
from sqla_queue import enqueue as enqueue_module_or_function
from sqla_queue.enqueue import options, session, unique, waker


@pytest.mark.parametrize(("old", "new"), [("session", session), ("options", options), ("unique", unique)])
def test_a_kept_module_re_exports_its_module(old: str, new: ModuleType) -> None:
    kept = importlib.import_module(f"sqla_queue.{old}")
    names = list(vars(new)["__all__"])
    assert sorted(vars(kept)["__all__"]) == sorted(names)
    for name in names:
        assert getattr(kept, name) is getattr(new, name), name


def test_the_waker_is_still_an_attribute_of_the_package() -> None:
    assert sqla_queue.waker is waker
    assert sqla_queue.waker.flush is waker.flush


def test_sqla_queue_enqueue_is_still_the_function() -> None:
    """The folder shares its name with ``enqueue()``: the package's attribute stays the function."""
    assert callable(enqueue_module_or_function)
    assert enqueue_module_or_function is session.enqueue
    assert sqla_queue.enqueue is session.enqueue
