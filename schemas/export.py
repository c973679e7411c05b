"""Write the JSON Schemas of the wire contract to `schemas/json/` (`python -m mcp_saga.schemas.export`).

Publishers in other languages validate against these files; a test regenerates them and fails
when the committed copies are stale, so the files and the structs can never drift apart.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import msgspec
from mcp_saga.schemas.events import ADDED_IN_REVISION, CONTRACT_REVISION, PAYLOAD_TYPES, WIRE_VERSION
from mcp_saga.schemas.records import (
    JOB_FIELDS_OF_REVISION_2,
    KINDS_ADDED_IN_REVISION,
    OPEN,
    RECORD_FIELDS_OF_REVISION_2,
    RECORD_FIELDS_OF_REVISION_3,
    Compensation,
    CompensationJob,
)
from mcp_saga.schemas.recovery import Recovery

OUT = Path(__file__).resolve().parent / "json"


def schemas() -> dict[str, dict[str, Any]]:
    """File name -> schema, for every event payload, the recovery object and the stored records."""
    found: dict[str, dict[str, Any]] = {}
    for name, payload in PAYLOAD_TYPES.items():
        schema = msgspec.json.schema(payload)
        schema["title"] = f"saga:events entry `data` for type={name}"
        schema["x-saga-wire"] = {
            "version": WIRE_VERSION,
            "revision": CONTRACT_REVISION,
            "addedInRevision": ADDED_IN_REVISION.get(name, 1),
        }
        found[f"event-{name}.json"] = schema
    recovery = Recovery.model_json_schema(by_alias=True)
    recovery["title"] = "SEP-3172 ToolAnnotations.recovery"
    found["recovery.json"] = recovery
    record, job = msgspec.json.schema(Compensation), msgspec.json.schema(CompensationJob)
    revision = {"version": WIRE_VERSION, "revision": CONTRACT_REVISION}
    record["x-saga-wire"] = {
        **revision,
        "fieldsAddedInRevision": {"2": list(RECORD_FIELDS_OF_REVISION_2), "3": list(RECORD_FIELDS_OF_REVISION_3)},
        "statusesAddedInRevision": {"2": sorted(OPEN)},
        "kindsAddedInRevision": KINDS_ADDED_IN_REVISION,
    }
    job["x-saga-wire"] = {
        **revision,
        "fieldsAddedInRevision": {"2": list(JOB_FIELDS_OF_REVISION_2)},
        "kindsAddedInRevision": KINDS_ADDED_IN_REVISION,
    }
    found["compensation-record.json"], found["compensation-job.json"] = record, job
    return found


def render(schema: dict[str, Any]) -> str:
    return json.dumps(schema, indent=2, sort_keys=True) + "\n"


def main() -> int:
    OUT.mkdir(exist_ok=True)
    for name, schema in schemas().items():
        (OUT / name).write_text(render(schema))
    print(f"wrote {len(schemas())} schemas to {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
