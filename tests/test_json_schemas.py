"""The exported JSON Schemas match the structs they are generated from."""

from __future__ import annotations

from mcp_saga.schemas.export import OUT, render, schemas


def test_exported_schemas_are_current() -> None:
    expected = schemas()
    on_disk = {p.name for p in OUT.glob("*.json")}
    assert on_disk == set(expected), "run `python -m mcp_saga.schemas.export`"
    for name, schema in expected.items():
        assert (OUT / name).read_text() == render(schema), f"{name} is stale: run `python -m mcp_saga.schemas.export`"


def test_step_completed_schema_requires_the_contract_fields() -> None:
    schema = schemas()["event-step-completed.json"]
    definition = schema["$defs"]["StepCompleted"]
    assert set(definition["required"]) == {"step", "server", "tool", "result"}
    assert definition["properties"]["step"]["pattern"] == "^[A-Za-z0-9._:-]{1,64}$"
    assert "completedAt" in definition["properties"]


def test_the_record_schemas_say_which_fields_and_statuses_revision_2_added() -> None:
    """Issue 14's record fields are versioned like its events: each named one exists in the record."""
    for name, struct in (("compensation-record.json", "Compensation"), ("compensation-job.json", "CompensationJob")):
        schema = schemas()[name]
        wire = schema["x-saga-wire"]
        assert (wire["version"], wire["revision"]) == (1, 3), name
        properties = schema["$defs"][struct]["properties"]
        assert wire["fieldsAddedInRevision"]["2"] and set(wire["fieldsAddedInRevision"]["2"]) <= set(properties), name
    record = schemas()["compensation-record.json"]
    statuses = record["$defs"]["Compensation"]["properties"]["status"]["enum"]
    assert record["x-saga-wire"]["statusesAddedInRevision"]["2"] == ["in-doubt", "started"]
    assert {"in-doubt", "started"} <= set(statuses)


def test_revision_3_adds_the_live_declaration_read_and_says_so() -> None:
    """Issue 13's read of a live declaration is versioned: its report types, the record's `result`
    and the `declaration` kind of record and job each say they came with revision 3."""
    found = schemas()
    for name in ("event-declaration-read.json", "event-declaration-failed.json"):
        assert found[name]["x-saga-wire"]["addedInRevision"] == 3, name
    record, job = found["compensation-record.json"], found["compensation-job.json"]
    assert record["x-saga-wire"]["fieldsAddedInRevision"]["3"] == ["result"]
    assert "result" in record["$defs"]["Compensation"]["properties"]
    for schema, struct in ((record, "Compensation"), (job, "CompensationJob")):
        assert schema["x-saga-wire"]["kindsAddedInRevision"]["declaration"] == 3
        assert "declaration" in schema["$defs"][struct]["properties"]["kind"]["enum"]
