"""WorkerConfig's derived timings (pure arithmetic, no database)."""

from __future__ import annotations

import pytest

from sqla_queue.worker.config import WorkerConfig


@pytest.mark.parametrize(
    ("lease", "interval", "deadline"),
    [
        (60.0, None, 20.0),  # the default interval, a third of the lease: the interval
        (15.0, 0.5, 7.25),  # a short interval: a slow beat over many jobs still lands
        (1.0, 0.3, 0.35),
        (1.0, 0.9, 0.9),  # never shorter than the interval
    ],
)
def test_a_beat_may_take_half_what_the_lease_leaves_after_the_interval(
    lease: float, interval: float | None, deadline: float
) -> None:
    config = WorkerConfig(lease=lease, heartbeat_interval=interval)
    assert config.heartbeat_deadline == pytest.approx(deadline)
