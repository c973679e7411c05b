"""The typed timeline entries, outcomes and dead letters map to exactly the stream fields operators read.

The expected fields below are what the coordinator wrote before these became structs (flat strings,
`at` with six decimals, empty details left out); a change here is a wire change and needs a version.
"""

from __future__ import annotations

from mcp_saga.coordinator.machine import timeline_entry
from mcp_saga.schemas.keys import DEAD_AT, DEAD_ID, DEAD_REASON
from mcp_saga.schemas.results import result_summary
from mcp_saga.schemas.timeline import OUTCOME_REASON_MAX, DeadLetter, Outcome, TimelineEntry


def test_a_report_entry_encodes_to_the_documented_fields() -> None:
    entry = timeline_entry(
        "compensation-attempt-failed",
        1700000000.5,
        "charge",
        server="payments",
        operation="refund_payment",
        key="saga:abc",
        attempt=1,
        dispatch=2,
        duration_ms=12.345,
        worker=None,
        error="card processor down",
        retryable=True,
        reason="",
    )
    assert entry.to_fields() == {
        "type": "compensation-attempt-failed",
        "at": "1700000000.500000",
        "step": "charge",
        "server": "payments",
        "operation": "refund_payment",
        "key": "saga:abc",
        "attempt": "1",
        "dispatch": "2",
        "duration_ms": "12.3",
        "error": "card processor down",
        "retryable": "True",
    }


def test_an_entry_reads_back_typed_from_its_stream_fields() -> None:
    entry = timeline_entry("compensation-failed", 12.0, "b", error="x", retryable=False, attempt=3, dispatch=1)
    raw = {k.encode(): v.encode() for k, v in entry.to_fields().items()}
    back = TimelineEntry.from_fields(raw, b"1-0")
    assert back.id == "1-0" and back.type == "compensation-failed" and back.step == "b"
    assert (back.retryable, back.attempt, back.dispatch, back.at) == (False, 3, 1, 12.0)
    assert back.to_fields() == entry.to_fields()
    assert back.to_json() == {"id": "1-0", **entry.to_fields()}


def test_unknown_and_unparsable_fields_are_kept_as_text() -> None:
    """An entry a newer version wrote (or a hand-edited one) still reads, and loses nothing."""
    raw = {b"type": b"shiny-new-kind", b"at": b"5.000000", b"dispatch": b"two", b"colour": b"blue"}
    entry = TimelineEntry.from_fields(raw, b"9-1")
    assert entry.type == "shiny-new-kind" and entry.dispatch is None
    assert entry.extra == {"dispatch": "two", "colour": "blue"}
    assert entry.to_fields() == {k.decode(): v.decode() for k, v in raw.items()}
    assert entry.details() == {"dispatch": "two", "colour": "blue"}
    assert TimelineEntry.from_fields({b"at": b"1"}).type == "?"


def test_an_outcome_carries_its_own_id_and_a_capped_reason() -> None:
    outcome = Outcome(
        type="workflow-needs-attention",
        workflow="w",
        at=3.0,
        step=None,
        status="needs-attention",
        reason="r" * (OUTCOME_REASON_MAX + 10),
        id="w/3.000000/2/0",
    )
    fields = outcome.to_fields()
    assert fields == {
        "type": "workflow-needs-attention",
        "workflow": "w",
        "at": "3.000000",
        "status": "needs-attention",
        "reason": "r" * OUTCOME_REASON_MAX,
        "id": "w/3.000000/2/0",
    }
    back = Outcome.from_fields({k.encode(): v.encode() for k, v in fields.items()})
    assert back.id == "w/3.000000/2/0" and back.extra == {} and back.to_fields() == fields


def test_a_dead_letter_keeps_the_refused_entry_byte_for_byte() -> None:
    original = {b"type": b"nonsense", b"data": b"\xff\xfe not utf-8", b"dead.reason": b"forged"}
    record = DeadLetter.record(b"7-0", original, "unknown event type", 10.0)
    assert record == {
        DEAD_REASON.encode(): b"unknown event type",
        DEAD_ID.encode(): b"7-0",
        DEAD_AT.encode(): b"10.000",
        b"type": b"nonsense",
        b"data": b"\xff\xfe not utf-8",
    }
    letter = DeadLetter.from_fields(b"8-0", record)
    assert (letter.id, letter.at, letter.reason, letter.original_id) == ("8-0", "10.000", "unknown event type", "7-0")
    assert letter.fields["type"] == "nonsense" and set(letter.fields) == {"type", "data"}


def test_one_summary_of_a_tool_result_serves_the_cli_and_the_console() -> None:
    """`saga inspect` and the console show a step's result through this one function."""
    assert result_summary({"structuredContent": {"tx": "T-1"}, "content": []}) == '{"tx":"T-1"}'
    text = {"content": [{"type": "text", "text": "no"}, {"type": "image"}, {"type": "text", "text": "carrier"}]}
    assert result_summary(text | {"isError": True}) == "error: no carrier"
    assert result_summary(None) == "" and result_summary("plain") == "plain" and result_summary([1]) == "[1]"
