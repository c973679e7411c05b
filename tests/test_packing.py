"""runtime/packing.py: hiredis packs what redis-py would send, byte for byte, and nothing else changes."""

from __future__ import annotations

import math

import pytest
import redis
from hypothesis import given
from hypothesis import strategies as st
from mcp_saga.runtime.connect import connect
from mcp_saga.runtime.packing import HiredisPacker, pack_with_hiredis
from mcp_saga.schemas.config import RedisSettings
from redis.connection import Connection
from redis.exceptions import DataError

REDIS_PY = Connection()  # its own packer: what the server received before
HIREDIS = Connection(command_packer=HiredisPacker())

ARGS = st.one_of(
    st.text(),
    st.binary(),
    st.integers(),
    st.floats(allow_nan=False),
    st.binary().map(memoryview),
)


@given(st.sampled_from(["SET", "EVALSHA", "CONFIG GET", b"CLIENT SETNAME"]), st.lists(ARGS, max_size=20))
def test_every_argument_packs_as_redis_py_packs_it(name: str | bytes, args: list) -> None:
    command = (name, *args)
    assert b"".join(HIREDIS.pack_command(*command)) == b"".join(REDIS_PY.pack_command(*command))
    assert b"".join(HIREDIS.pack_commands([command, command])) == b"".join(REDIS_PY.pack_commands([command, command]))


def test_what_redis_py_refuses_is_still_refused_and_the_rest_falls_back() -> None:
    for bad in (True, None, object()):
        with pytest.raises(DataError):
            HIREDIS.pack_command("SET", "k", bad)
    for odd in (bytearray(b"ab"), "\udcff".encode("utf-8", "surrogatepass"), math.inf, -0.0):
        assert b"".join(HIREDIS.pack_command("SET", "k", odd)) == b"".join(REDIS_PY.pack_command("SET", "k", odd))
    with pytest.raises(UnicodeEncodeError):  # a lone surrogate: redis-py's own error, as before
        HIREDIS.pack_command("SET", "k", "\udcff")


def test_the_processes_clients_pack_with_hiredis_and_work(redis_url: str) -> None:
    client = connect(redis_url, RedisSettings())
    try:
        with client.pipeline() as pipe:  # a MULTI, as RQ's bookkeeping sends
            pipe.set("packing:a", "ü").hset("packing:h", mapping={"n": 1, "x": 1.5}).get("packing:a")
            assert pipe.execute()[2] == "ü".encode()
        assert client.hgetall("packing:h") == {b"n": b"1", b"x": b"1.5"}
        connection = client.connection_pool.get_connection()
        try:
            assert isinstance(connection._command_packer, HiredisPacker)
        finally:
            client.connection_pool.release(connection)
    finally:
        client.delete("packing:a", "packing:h")
        client.close()


def test_a_client_with_another_encoding_keeps_redis_pys_packer(redis_url: str) -> None:
    client = pack_with_hiredis(redis.Redis.from_url(redis_url, encoding="latin-1"))
    assert "command_packer" not in client.connection_pool.connection_kwargs
    client.close()
