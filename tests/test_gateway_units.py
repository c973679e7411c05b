"""The gateway's pure rules and its refusal logic, without processes: identity, step ids, config, auth, recorder."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from mcp_saga.gateway.app import BearerAuth, gateway_token
from mcp_saga.gateway.identity import NoWorkflow, resolve_workflow, session_workflow
from mcp_saga.gateway.proxy import step_id
from mcp_saga.gateway.recorder import NotRecordable, Recorder
from mcp_saga.runtime.publish import started_entry, step_entry
from mcp_saga.schemas.config import ConfigError, parse_config
from mcp_saga.schemas.events import STEP_ID, WORKFLOW_META_KEY, check_workflow_id, decode_entry
from mcp_saga.schemas.records import forward_key


def test_identity_order_is_meta_then_header_then_session() -> None:
    headers = {"saga-workflow": "from-header"}
    assert resolve_workflow({WORKFLOW_META_KEY: "from-meta"}, headers, "gw-s") == ("from-meta", "meta")
    assert resolve_workflow({}, headers, "gw-s") == ("from-header", "header")
    assert resolve_workflow(None, None, "gw-s") == ("gw-s", "session")
    with pytest.raises(NoWorkflow, match="names no workflow"):
        resolve_workflow(None, {}, None)


@pytest.mark.parametrize("bad", ["", "has space", "-dash", "x" * 201, 42, "a\n"])
def test_invalid_ids_are_refused_wherever_they_come_from(bad: Any) -> None:
    with pytest.raises(NoWorkflow, match="invalid workflow id"):
        resolve_workflow({WORKFLOW_META_KEY: bad}, None, "gw-s")
    if isinstance(bad, str):
        with pytest.raises(NoWorkflow, match="invalid workflow id"):
            resolve_workflow(None, {"saga-workflow": bad}, "gw-s")


def test_session_and_step_ids_fit_the_contract() -> None:
    assert session_workflow("abc123") == "gw-abc123"
    assert check_workflow_id(session_workflow("not valid/" * 40))
    import re

    for tool in ("charge_payment", "weird tool/name", "x" * 200):
        step = step_id(12345, tool, "a1b2c3")
        assert re.fullmatch(STEP_ID.strip("^$"), step) and step.endswith(".a1b2c3")


def test_gateway_config_is_validated() -> None:
    settings = parse_config({}).gateway
    assert (settings.host, settings.tools, settings.on_session_end) == ("127.0.0.1", False, "leave")
    for bad, message in [
        ({"on_idle": "explode"}, "on_idle"),
        ({"port": 70000}, "port"),
        ({"token_env": "not a name"}, "token_env"),
        ({"host": "0.0.0.0", "allow_anonymous": True}, "loopback"),
        ({"surprise": 1}, "unknown field"),
    ]:
        with pytest.raises(ConfigError, match=message):
            parse_config({"gateway": bad})


def test_the_token_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    config = parse_config({"gateway": {"token_env": "GW_TEST_TOKEN"}})
    monkeypatch.delenv("GW_TEST_TOKEN", raising=False)
    with pytest.raises(ConfigError, match="GW_TEST_TOKEN"):
        gateway_token(config)
    monkeypatch.setenv("GW_TEST_TOKEN", "s3cret")
    assert gateway_token(config) == "s3cret"
    assert gateway_token(parse_config({"gateway": {"allow_anonymous": True, "token_env": "GW_NONE"}})) is None


def test_bearer_auth_refuses_before_the_app_runs() -> None:
    reached: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        reached.append(scope["path"])

    async def call(headers: list[tuple[bytes, bytes]]) -> int:
        sent: list[dict[str, Any]] = []

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        await BearerAuth(app, "tok")({"type": "http", "path": "/mcp/payments", "headers": headers}, None, send)
        return sent[0]["status"] if sent else 200

    assert asyncio.run(call([])) == 401
    assert asyncio.run(call([(b"authorization", b"Bearer nope")])) == 401
    assert asyncio.run(call([(b"authorization", b"Bearer tok")])) == 200
    assert reached == ["/mcp/payments"]


class FlakyRedis:
    """XADD fails `failures` times, then works; PING answers as `up` says."""

    def __init__(self, failures: int, up: bool = True) -> None:
        self.failures, self.up, self.added = failures, up, []

    async def xadd(self, stream: str, fields: dict[bytes, bytes]) -> bytes:
        if self.failures:
            self.failures -= 1
            raise ConnectionError("redis went away")
        self.added.append(fields)
        return b"1-0"

    async def ping(self) -> bool:
        if not self.up:
            raise ConnectionError("down")
        return True


def _fields(step: str, workflow: str = "wf") -> dict[bytes, bytes]:
    return step_entry(workflow, step, "payments", "charge_payment", {"n": 1}, {"structuredContent": {"id": step}})


def test_a_failed_write_is_retried_in_order() -> None:
    async def run() -> FlakyRedis:
        redis = FlakyRedis(failures=2)
        recorder = Recorder(redis, retry_for=5.0)  # type: ignore[arg-type]
        recorder.step("wf", "a", _fields("a"))
        recorder.step("wf", "b", _fields("b"))
        await recorder.flush("wf")
        await recorder.admit("wf")  # written in the end: calls go on
        return redis

    added = asyncio.run(run()).added
    assert [decode_entry("0-0", f).data.step for f in added] == ["a", "b"]


def test_a_step_never_written_refuses_its_workflow_and_redis_down_refuses_all() -> None:
    async def run() -> None:
        redis = FlakyRedis(failures=1000)
        recorder = Recorder(redis, retry_for=0.2)  # type: ignore[arg-type]
        recorder.step("wf", "a", _fields("a"))
        await recorder.flush("wf")
        with pytest.raises(NotRecordable, match="could not record"):
            await recorder.admit("wf")
        await recorder.admit("other")  # Redis answers PING: other workflows go on
        redis.up = False
        assert not await recorder.ping()
        with pytest.raises(NotRecordable, match="Redis is unreachable"):
            await recorder.admit("other")
        redis.up = True
        await recorder.admit("other")  # healed: admitted again

    asyncio.run(run())


def test_a_step_is_built_and_written_after_the_answer_and_the_next_call_waits_for_it() -> None:
    async def run() -> None:
        redis = FlakyRedis(failures=2)  # the step's first two writes fail: it is retried
        recorder = Recorder(redis, retry_for=5.0)  # type: ignore[arg-type]
        answered: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        built: list[str] = []

        def entry() -> dict[bytes, bytes]:
            built.append("a")
            return _fields("a")

        recorder.completed("wf", "a", entry, after=answered)
        await asyncio.sleep(0.01)
        assert built == [] and redis.added == []  # the client has no answer yet: nothing built or sent
        answered.set_result(None)
        await recorder.admit("wf")  # the next call goes out only once step a is in Redis
        assert built == ["a"] and [decode_entry("0-0", f).data.step for f in redis.added] == ["a"]

    asyncio.run(run())


def test_a_step_whose_entry_cannot_be_built_refuses_its_workflow() -> None:
    async def run() -> None:
        recorder = Recorder(FlakyRedis(failures=0))  # type: ignore[arg-type]

        def entry() -> dict[bytes, bytes]:
            raise ValueError("over the event cap")

        recorder.completed("wf", "a", entry)
        with pytest.raises(NotRecordable, match="over the event cap"):
            await recorder.admit("wf")
        assert recorder.workflows["wf"].steps == 1  # still counted: the call did complete upstream

    asyncio.run(run())


def test_idle_workflows_get_the_policy_once_and_are_forgotten() -> None:
    async def run() -> FlakyRedis:
        redis = FlakyRedis(failures=0)
        recorder = Recorder(redis)  # type: ignore[arg-type]
        recorder.step("idle-wf", "a", _fields("a", "idle-wf"))
        await recorder.admit("ended-wf")
        await recorder.complete("ended-wf")
        assert set(recorder.idle(0.0)) == {"idle-wf", "ended-wf"}
        for workflow in recorder.idle(0.0):
            await recorder.apply_policy(workflow, "fail", "idle")
            recorder.forget(workflow)
        assert recorder.workflows == {}  # memory stays bounded
        return redis

    added = [decode_entry("0-0", f) for f in asyncio.run(run()).added]
    by_workflow: dict[str, list[str]] = {}
    for event in added:  # order is kept per workflow (steps before the terminal event), not across them
        by_workflow.setdefault(event.workflow, []).append(event.type)
    assert by_workflow == {"idle-wf": ["step-completed", "workflow-failed"], "ended-wf": ["workflow-completed"]}
    assert added[-1].data.steps_completed == 1 and "idle" in added[-1].data.reason


def test_an_intent_is_written_before_the_call_and_an_error_answer_is_no_completed_step() -> None:
    async def run() -> tuple[FlakyRedis, Recorder]:
        redis = FlakyRedis(failures=0)
        recorder = Recorder(redis)  # type: ignore[arg-type]
        intent = started_entry("wf", "a", "payments", "charge_payment", {"n": 1})
        await recorder.started("wf", "a", intent)
        assert len(redis.added) == 1  # acknowledged before started() returned: before the call goes out
        error = step_entry("wf", "a", "payments", "charge_payment", {"n": 1}, {"isError": True, "content": []})
        recorder.completed("wf", "a", error, failed=True)
        await recorder.fail("wf", "the call failed")
        return redis, recorder

    redis, _ = asyncio.run(run())
    started, settled, failed = (decode_entry("0-0", f) for f in redis.added)
    assert (started.type, started.data.forward_key) == ("step-started", forward_key("wf", "a"))
    assert settled.data.result["isError"] is True
    assert failed.data.steps_completed == 0  # the failed call is not a completed step


def test_an_intent_redis_refuses_refuses_the_call() -> None:
    async def run() -> None:
        recorder = Recorder(FlakyRedis(failures=1))  # type: ignore[arg-type]
        with pytest.raises(NotRecordable, match="it was not forwarded"):
            await recorder.started("wf", "a", started_entry("wf", "a", "payments", "charge_payment", {}))

    asyncio.run(run())


def test_the_http_side_sends_a_responses_writes_of_one_step_together() -> None:
    """uvicorn writes a response's head and body apart; the gateway's transport sends them as one write."""
    from mcp_saga.gateway.app import _Coalescing

    class Transport:
        def __init__(self) -> None:
            self.writes: list[bytes] = []
            self.closed = False

        def write(self, data: bytes) -> None:
            self.writes.append(data)

        def close(self) -> None:
            self.closed = True

        def get_extra_info(self, name: str) -> str:
            return f"info:{name}"

    async def run() -> Transport:
        real = Transport()
        transport = _Coalescing(real)  # type: ignore[arg-type]
        transport.write(b"HTTP/1.1 200 OK\r\n\r\n")
        transport.write(b"body")
        assert real.writes == []  # held until the loop's next step
        await asyncio.sleep(0)
        assert real.writes == [b"HTTP/1.1 200 OK\r\n\r\nbody"]
        transport.write(b"last words")
        transport.close()  # what was held goes out before the close
        assert transport.get_extra_info("peername") == "info:peername"
        return real

    real = asyncio.run(run())
    assert real.writes[-1] == b"last words" and real.closed


def test_transport_checks_are_remembered_only_for_headers_that_passed() -> None:
    """The pass-through keeps the SDK's Host / Origin verdict per header values: a request whose
    values passed before skips the check, and one with other values is still refused each time."""
    from mcp.server.transport_security import TransportSecurityMiddleware, TransportSecuritySettings
    from mcp_saga.gateway.passthrough import PassThrough
    from mcp_saga.gateway.proxy import Gateway
    from mcp_saga.runtime.http_client import Upstreams

    config = parse_config({"servers": {"pay": {"url": "http://127.0.0.1:9/mcp"}}})
    settings = TransportSecuritySettings(
        enable_dns_rebinding_protection=True, allowed_hosts=["127.0.0.1:*"], allowed_origins=["http://127.0.0.1:*"]
    )
    gateway = Gateway(config, Recorder(FlakyRedis(0)))  # type: ignore[arg-type]
    endpoint = PassThrough(gateway, "pay", Upstreams(), TransportSecurityMiddleware(settings))

    async def status(host: bytes, origin: bytes) -> int:
        sent: list[dict[str, Any]] = []

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        async def receive() -> dict[str, Any]:
            return {"type": "http.disconnect"}

        scope = {"type": "http", "method": "GET", "headers": [(b"host", host), (b"origin", origin)]}
        await endpoint(scope, receive, send)
        return sent[0]["status"]

    good, evil = b"http://127.0.0.1:5000", b"http://evil.example"
    assert asyncio.run(status(b"127.0.0.1:5000", evil)) == 403
    assert not endpoint._passed
    assert asyncio.run(status(b"127.0.0.1:5000", good)) == 502  # passed the checks; the upstream is down
    assert len(endpoint._passed) == 1
    assert asyncio.run(status(b"127.0.0.1:5000", good)) == 502
    assert asyncio.run(status(b"127.0.0.1:5000", evil)) == 403
    assert asyncio.run(status(b"evil.example", good)) == 421
    assert len(endpoint._passed) == 1
