"""The geometry of a workflow's picture on the dashboard: depths, columns, edges and its
bounds. Pure logic, no database."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("flask")

from sqla_queue.dashboard.graph import PER_COLUMN, PICTURE_EDGES, PICTURE_JOBS, depths, picture


def job(key: int, *parents: int, status: str = "pending", waiting_on: int = 0) -> tuple[Any, ...]:
    return (key, f"task {key}", status, waiting_on, list(parents) or None)


def url(key: Any) -> str:
    return f"/t/job/{key}"


def test_a_job_is_one_column_right_of_its_deepest_parent() -> None:
    # 1 → 2 → 4, 1 → 3, (3, 4) → 5: 5 is below 4, two columns from 3.
    assert depths({1: [], 2: [1], 3: [1], 4: [2], 5: [3, 4]}) == {1: 0, 2: 1, 3: 1, 4: 2, 5: 3}
    # A parent outside the jobs given (none here) counts as none; listed in any order.
    assert depths({5: [4, 3], 4: [2], 3: [9], 2: []}) == {5: 2, 4: 1, 3: 0, 2: 0}


def test_a_cycle_written_in_by_hand_ends_instead_of_looping() -> None:
    found = depths({1: [3], 2: [1], 3: [2]})
    assert set(found) == {1, 2, 3}


def test_the_picture_places_boxes_by_depth_and_joins_each_parent_to_its_children() -> None:
    drawn = picture([job(1, status="done"), job(2, 1, status="failed"), job(3, 1),
                     job(4, 2, 3, waiting_on=1)], url)
    assert drawn is not None
    boxes = {b["key"]: b for b in drawn["boxes"]}
    assert [boxes[k]["depth"] for k in (1, 2, 3, 4)] == [0, 1, 1, 2]
    assert boxes[2]["x"] == boxes[3]["x"] > boxes[1]["x"] and boxes[4]["x"] > boxes[2]["x"]
    assert boxes[2]["y"] != boxes[3]["y"]
    assert boxes[4]["waiting"] and not boxes[3]["waiting"] and boxes[4]["url"] == "/t/job/4"
    assert boxes[2]["fill"] != boxes[1]["fill"]  # failed and done look apart
    assert {(e["from"], e["to"]) for e in drawn["edges"]} == {(1, 2), (1, 3), (2, 4), (3, 4)}
    assert drawn["depth"] == 3
    assert drawn["width"] >= boxes[4]["x"] + drawn["box_w"] and drawn["height"] >= boxes[3]["y"] + drawn["box_h"]


def test_a_tall_column_wraps_and_the_picture_stays_within_its_bounds() -> None:
    fan = [job(0)] + [job(n, 0) for n in range(1, PER_COLUMN + 6)]
    drawn = picture(fan, url)
    assert drawn is not None
    columns = sorted({b["x"] for b in drawn["boxes"] if b["depth"] == 1})
    assert len(columns) == 2  # PER_COLUMN boxes, then the rest beside them
    assert max(b["y"] for b in drawn["boxes"]) < drawn["height"]
    too_many = [job(0)] + [job(n, 0) for n in range(1, PICTURE_JOBS + 1)]
    assert picture(too_many, url) is None
    dense = [job(n, *range(n)) for n in range(80)]  # 3,160 edges between 80 jobs
    assert sum(n for n in range(80)) > PICTURE_EDGES and picture(dense, url) is None
    assert picture([], url) is None


def test_a_label_is_cut_to_fit_its_box() -> None:
    drawn = picture([(1, "a-very-long-task-name-that-does-not-fit", "pending", 0, None)], url)
    assert drawn is not None
    (box,) = drawn["boxes"]
    assert box["label"].endswith("…") and len(box["label"]) == 22
    assert "a-very-long-task-name-that-does-not-fit" in box["title"]
