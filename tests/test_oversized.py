"""A tool result over the 256 KiB event cap (issue 11, item 8): the agent gets it whole, the step
is recorded with what its recovery binds, and a step whose bound values cannot be kept ends the
workflow in `needs-attention` naming the step, the tool and the cut.

End to end with the trivial example server over streamable HTTP returning 1 MB, and real
coordinator and worker processes; `fit_step` alone for the shapes in between.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis
from mcp import Client
from mcp_saga.coordinator.planner import plan_step
from mcp_saga.runtime.publish import fit_step, step_completed
from mcp_saga.runtime.recovery_wire import compensation
from mcp_saga.schemas.config import load_config
from mcp_saga.schemas.events import MAX_DATA_BYTES, encode_payload
from mcp_saga.schemas.expressions import CUT_META_KEY
from mcp_saga.schemas.keys import Keys
from processes import start_http_server
from test_reference_servers import run_unwind, saga_config
from test_worker_faults import arrivals

import mcp_saga

MB = 1_000_000


def big_step(recovery: dict, arguments: dict | None = None):
    body = {"n": 7, "data": "x" * MB, "rows": [{"id": i, "pad": "y" * 100} for i in range(50)]}
    result = {"content": [{"type": "text", "text": json.dumps(body)}], "structuredContent": body, "isError": False}
    return step_completed("1-big", "trivial", "big", arguments or {"n": 7}, result, recovery)


def test_a_step_is_cut_to_the_pointers_its_recovery_reads() -> None:
    recovery = compensation("undo", n="$response.body#/n", ids="$response.body#/rows/*/id", k="$request.body#/n")
    payload, note = fit_step(big_step(recovery))
    assert len(encode_payload(payload)) <= MAX_DATA_BYTES
    assert payload.result["structuredContent"] == {"n": 7, "rows": [{"id": i} for i in range(50)]}
    assert payload.arguments == {"n": 7}
    assert "'1-big' (trivial:big)" in note and "recorded with only what its recovery binds" in note
    plan = plan_step("wf", payload, 1, None, 0.0).compensation
    assert plan.status == "pending" and plan.arguments == {"n": 7, "ids": list(range(50)), "k": 7}


def test_a_step_whose_bound_value_cannot_be_kept_is_unrecoverable_naming_tool_and_cut() -> None:
    payload, note = fit_step(big_step(compensation("undo", blob="$response.body#/data")))
    assert "does not fit, so it cannot be undone" in note
    assert payload.result["_meta"][CUT_META_KEY]["complete"] is False
    plan = plan_step("wf", payload, 1, None, 0.0).compensation
    assert plan.status == "unrecoverable"
    assert (
        "the recorded step of 'big' was cut from" in plan.reason and f"{MAX_DATA_BYTES}-byte event cap" in plan.reason
    )


def test_oversized_arguments_are_cut_to_what_the_recovery_reads_too() -> None:
    arguments = {"n": 7, "payload": "z" * MB}
    payload, _ = fit_step(big_step(compensation("undo", n="$request.body#/n"), arguments))
    assert payload.arguments == {"n": 7} and payload.result["_meta"][CUT_META_KEY]["argumentsCut"]
    assert plan_step("wf", payload, 1, None, 0.0).compensation.arguments == {"n": 7}


def test_a_1_mb_result_is_returned_whole_and_its_step_undone(r: redis.Redis, redis_url: str, tmp_path: Path) -> None:
    seen = tmp_path / "arrivals"
    with start_http_server("mcp_saga.examples.trivial", env={"SAGA_TRIVIAL_ARRIVALS": str(seen)}) as (_, url):
        config = saga_config(tmp_path / "saga.toml", trivial={"url": url})
        # The second workflow's overlay binds the 1 MB field itself, which no event can hold.
        unkeepable = {"big": compensation("noop_undo", n="$response.body#/data")}
        overlaid = saga_config(tmp_path / "overlay.toml", trivial={"url": url, "recovery": unkeepable})
        got = {}

        def workflow(config_path: Path):
            async def calls(workflow_id: str) -> None:
                async with Client(url) as client:
                    with pytest.raises(RuntimeError, match="later step"):
                        async with mcp_saga.workflow(
                            workflow_id, redis=redis_url, servers={"trivial": client}, config=load_config(config_path)
                        ) as wf:
                            result = await wf.call("trivial", "big", {"n": 7, "size": MB})
                            got[workflow_id] = result.structured_content
                            raise RuntimeError("a later step failed")

            return calls

        assert run_unwind(r, redis_url, config, tmp_path, "big-1", workflow(config)) == b"compensated"
        assert run_unwind(r, redis_url, overlaid, tmp_path, "big-2", workflow(overlaid)) == b"needs-attention"

    assert got["big-1"] == {"n": 7, "data": "x" * MB}  # the agent got its 1 MB result
    assert arrivals(seen) == [7]  # undone once, with the one value its recovery binds
    attention = r.hget(Keys().state("big-2"), "attention").decode()
    assert attention.startswith("step 1-big: unrecoverable") and "'big' was cut from" in attention
