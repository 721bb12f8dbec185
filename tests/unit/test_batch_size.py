"""Batch sizing, as a pure function: the handlers' speed sets the claim size."""

from __future__ import annotations

import pytest

from sqla_queue.worker.executor import BATCH_TARGET_SECONDS, batch_size


def test_fast_handlers_get_batches_up_to_the_maximum() -> None:
    per_job, size = batch_size(None, 0.00001, max_batch=100)
    assert per_job == 0.00001
    assert size == 100


def test_slow_handlers_run_one_job_at_a_time() -> None:
    assert batch_size(None, BATCH_TARGET_SECONDS * 3, max_batch=100)[1] == 1


def test_the_size_aims_the_batch_at_the_target_time() -> None:
    _, size = batch_size(None, BATCH_TARGET_SECONDS / 10, max_batch=100)
    assert size == 10


@pytest.mark.parametrize("took", [0.0, 1e-12])
def test_a_handler_that_takes_no_time_does_not_divide_by_zero(took: float) -> None:
    assert batch_size(None, took, max_batch=50)[1] == 50


def test_one_odd_job_moves_the_estimate_by_a_third_only() -> None:
    per_job, _ = batch_size(0.001, 1.0, max_batch=100)
    assert per_job == pytest.approx(0.7 * 0.001 + 0.3 * 1.0)
    per_job, size = batch_size(per_job, 0.001, max_batch=100)
    assert per_job == pytest.approx(0.7 * (0.7 * 0.001 + 0.3) + 0.3 * 0.001)
    assert size == 1  # still slow on average: the next batch stays small


def test_a_maximum_of_one_is_respected() -> None:
    assert batch_size(None, 0.00001, max_batch=1)[1] == 1


def test_claims_that_take_turns_may_grow_larger_batches_by_default() -> None:
    from sqla_queue.worker.config import DEFAULT_MAX_BATCH, TURN_MAX_BATCH, WorkerConfig

    assert (DEFAULT_MAX_BATCH, TURN_MAX_BATCH) == (32, 128)
    assert WorkerConfig().max_batch() == WorkerConfig().max_batch(takes_turns=False) == 32
    assert WorkerConfig().max_batch(takes_turns=True) == 128
    assert WorkerConfig(batch_size=5).max_batch(takes_turns=True) == WorkerConfig(batch_size=5).max_batch() == 5
