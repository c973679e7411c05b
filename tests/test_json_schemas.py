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
