"""The control messages, as pure logic: what a sender sends, the one parser reads back."""

from __future__ import annotations

from sqla_queue.control import Cancel, Swept, Wake, cancel_payloads, parse, swept_payloads


def test_a_sweep_sends_each_queue_plain_then_its_swept_message() -> None:
    payloads = swept_payloads(["a", "b"])
    assert payloads == ["a", "b", "sqla_queue.swept:a", "sqla_queue.swept:b"]
    assert [parse(p) for p in payloads] == [Wake("a"), Wake("b"), Swept("a"), Swept("b")]
    assert swept_payloads([]) == []


def test_a_cancel_of_many_jobs_is_several_messages_within_the_payload_limit() -> None:
    ids = range(10**9, 10**9 + 2000)
    payloads = cancel_payloads(ids)
    assert len(payloads) > 1 and all(len(p.encode()) < 8000 for p in payloads)
    found: set[str] = set()
    for p in payloads:
        message = parse(p)
        assert isinstance(message, Cancel)
        found |= message.ids
    assert found == {str(i) for i in ids}
    assert parse("sqla_queue.unknown:x") is None
