"""The gateway's pipelined Redis connection (runtime/pipelined.py), against real redis-servers."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import redis
import redis.asyncio
from mcp_saga.cli.redis_server import RedisServer
from mcp_saga.gateway.recorder import Recorder
from mcp_saga.runtime import publish
from mcp_saga.runtime.durability import Durability, NotReplicated
from mcp_saga.runtime.pipelined import Pipelined, pipelined_for
from mcp_saga.runtime.publish import AsyncPublisher, step_entry
from mcp_saga.schemas.config import RedisSettings
from mcp_saga.schemas.events import decode_entry
from mcp_saga.schemas.keys import Keys
from redis.exceptions import AuthenticationError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError


def _fields(step: str, workflow: str = "wf") -> dict[bytes, bytes]:
    return step_entry(workflow, step, "payments", "charge_payment", {"n": 1}, {"structuredContent": {"id": step}})


def test_replies_reach_their_callers_in_order_and_an_error_only_its_own(r: redis.Redis, redis_url: str) -> None:
    async def run() -> tuple[list[object], list[bytes]]:
        pipe = pipelined_for(redis_url, RedisSettings())
        assert pipe is not None
        try:
            calls = [pipe.xadd("s", {b"n": str(n).encode()}) for n in range(20)]
            calls.insert(7, pipe.execute("NO-SUCH-COMMAND"))
            replies = await asyncio.gather(*calls, return_exceptions=True)
            return replies, [await pipe.execute("PING")]
        finally:
            await pipe.aclose()

    replies, pong = asyncio.run(run())
    assert isinstance(replies.pop(7), ResponseError)
    ids = [entry_id for entry_id, _ in r.xrange("s")]
    assert replies == ids  # each caller got the id of its own entry
    assert [fields[b"n"] for _, fields in r.xrange("s")] == [str(n).encode() for n in range(20)]
    assert pong == [b"PONG"]


def test_a_broken_connection_fails_what_was_in_flight_and_the_next_command_reconnects(
    r: redis.Redis, redis_url: str
) -> None:
    async def run() -> int:
        pipe = pipelined_for(redis_url, RedisSettings())
        assert pipe is not None
        try:
            await pipe.execute("CLIENT", "SETNAME", "pipelined-under-test")
            killer = redis.asyncio.Redis.from_url(redis_url)
            blocked = asyncio.ensure_future(pipe.execute("BLPOP", "nothing-here", 5))  # in flight at the kill
            await asyncio.sleep(0.05)
            for client in await killer.client_list():
                if client.get("name") == "pipelined-under-test":
                    await killer.client_kill_filter(_id=client["id"])
            await killer.aclose()
            with pytest.raises(RedisConnectionError):
                await blocked
            await pipe.xadd("s", {b"after": b"1"})
            return pipe.connects
        finally:
            await pipe.aclose()

    assert asyncio.run(run()) == 2
    assert [fields for _, fields in r.xrange("s")] == [{b"after": b"1"}]


def test_a_stopped_redis_fails_the_write_within_the_reply_timeout(private_redis: RedisServer) -> None:
    """SIGSTOP, as a hung Redis: the write fails (no caller waits forever), and works again after SIGCONT."""
    assert private_redis.process is not None
    pid = private_redis.process.pid

    async def run() -> float:
        pipe = Pipelined("127.0.0.1", private_redis.port, reply_timeout=0.3)
        try:
            await pipe.ping()
            os.kill(pid, signal.SIGSTOP)
            start = time.monotonic()
            try:
                with pytest.raises(RedisTimeoutError):
                    await pipe.xadd("s", {b"a": b"1"})
                waited = time.monotonic() - start
            finally:
                os.kill(pid, signal.SIGCONT)
            await pipe.xadd("s", {b"b": b"2"})
            return waited
        finally:
            await pipe.aclose()

    assert asyncio.run(run()) < 5.0  # bounded by the reply timeout (0.3 s), whatever the load
    assert {b"b": b"2"} in [fields for _, fields in redis.Redis(port=private_redis.port).xrange("s")]


def test_the_url_names_the_database_and_the_password(private_redis: RedisServer) -> None:
    admin = redis.Redis(port=private_redis.port)
    admin.config_set("requirepass", "s3cret")
    url = f"redis://:s3cret@127.0.0.1:{private_redis.port}/3"

    async def run() -> None:
        pipe = pipelined_for(url, RedisSettings())
        assert pipe is not None
        try:
            await pipe.xadd("s", {b"a": b"1"})
        finally:
            await pipe.aclose()
        wrong = pipelined_for(f"redis://:wrong@127.0.0.1:{private_redis.port}/0", RedisSettings())
        assert wrong is not None
        with pytest.raises(AuthenticationError):  # redis-py's own error for it
            await wrong.ping()
        await wrong.aclose()

    asyncio.run(run())
    assert redis.Redis(port=private_redis.port, password="s3cret", db=3).xlen("s") == 1


def test_what_it_does_not_serve_keeps_redis_py() -> None:
    assert (
        pipelined_for("redis://127.0.0.1:6379/0", RedisSettings(cluster=True, queue_url="redis://127.0.0.1:6380/0"))
        is None
    )
    assert pipelined_for("redis+sentinel://127.0.0.1:26379/mymaster", RedisSettings()) is None
    assert pipelined_for("rediss://127.0.0.1:6379/0", RedisSettings()) is None
    assert pipelined_for("redis://127.0.0.1:6379/0?socket_timeout=3", RedisSettings()) is None
    assert pipelined_for("unix:///tmp/redis.sock?db=2", RedisSettings()) is not None


def test_durability_sends_wait_with_the_write_and_an_unconfirmed_event_is_not_acknowledged(
    r: redis.Redis, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(publish, "NOT_REPLICATED_RETRY_FOR", 0.1)

    async def run() -> None:
        pipe = pipelined_for(redis_url, RedisSettings())
        assert pipe is not None
        try:
            none_needed = AsyncPublisher(
                redis.asyncio.Redis.from_url(redis_url), durability=Durability(0, 10), pipe=pipe
            )
            await none_needed.add("wf", _fields("a"))  # WAIT 0 answers at once: acknowledged
            one_needed = AsyncPublisher(
                redis.asyncio.Redis.from_url(redis_url), durability=Durability(1, 10), pipe=pipe
            )
            with pytest.raises(NotReplicated):  # this Redis has no replica
                await one_needed.add("wf", _fields("b"))
        finally:
            await pipe.aclose()

    asyncio.run(run())
    steps = [decode_entry(i.decode(), f).data.step for i, f in r.xrange(Keys().events)]  # type: ignore[union-attr]
    assert steps[0] == "a" and set(steps[1:]) == {"b"}  # re-sent while unconfirmed, never acknowledged


def test_the_recorder_writes_steps_over_it_in_order_and_retries_one_whose_write_broke(
    r: redis.Redis, redis_url: str
) -> None:
    async def run() -> None:
        pipe = pipelined_for(redis_url, RedisSettings())
        assert pipe is not None
        recorder = Recorder(redis.asyncio.Redis.from_url(redis_url), retry_for=5.0, pipe=pipe)
        try:
            await pipe.ping()
            for step in ("a", "b", "c"):
                recorder.step("wf", step, _fields(step))
            await recorder.flush("wf")
            await pipe.aclose()  # the connection is gone: the next step's write starts the retrying task
            recorder.step("wf", "d", _fields("d"))
            recorder.step("wf", "e", _fields("e"))
            await recorder.flush("wf")
            await recorder.admit("wf")  # every step written: calls go on
        finally:
            await pipe.aclose()

    asyncio.run(run())
    steps = [decode_entry(i.decode(), f).data.step for i, f in r.xrange(Keys().events)]  # type: ignore[union-attr]
    assert steps == ["a", "b", "c", "d", "e"]
