"""The size rule of unique keys (no database)."""

from __future__ import annotations

import pytest

from sqla_queue import EnqueueError
from sqla_queue.enqueue._rules import MAX_KEY_BYTES, check_key_size


def test_keys_up_to_the_limit_in_utf8_bytes_pass() -> None:
    check_key_size("a" * MAX_KEY_BYTES, "ref")
    check_key_size("é" * (MAX_KEY_BYTES // 2), "ref")  # two bytes each
    check_key_size(10**30, "ref")  # not text: nothing to measure


@pytest.mark.parametrize("key", ["a" * (MAX_KEY_BYTES + 1), "é" * (MAX_KEY_BYTES // 2 + 1), "😀" * 674])
def test_longer_keys_are_refused_naming_the_column_and_the_size(key: str) -> None:
    with pytest.raises(EnqueueError, match=rf"^ref is a unique key of {len(key.encode())} bytes"):
        check_key_size(key, "ref")
