"""Commands in the Redis protocol, packed by hiredis's C code instead of redis-py's Python.

redis-py's packer (with hiredis installed) still runs its encoder over each argument in Python
before handing the tuple to hiredis: for a compensation job's RQ bookkeeping (two MULTIs of some
20 commands each) and for the coordinator's loads and commits that is tens to hundreds of
microseconds a round trip, on the paths from a failure to its compensation. hiredis 3 encodes str
(UTF-8), bytes, memoryview, int and float exactly as redis-py does (a test holds them together),
so `HiredisPacker` hands the arguments over as they are, and leaves everything else (bool, None,
bytearray, a str that is not UTF-8-encodable) to redis-py's own packer, which refuses or encodes it
as ever.
"""

from __future__ import annotations

from typing import Any

from redis import Redis
from redis.connection import Encoder, PythonRespSerializer

try:
    import hiredis
except ImportError:  # pragma: no cover - a dependency of redis[hiredis]
    hiredis = None

Arg = bytes | str | int | float
# redis-py's threshold above which a value is sent as a chunk of its own (its packer's fallback).
BUFFER_CUTOFF = 6000


def pack(args: tuple[Arg, ...] | list[Arg]) -> bytes:
    """One command in RESP (an array of bulk strings), packed by hiredis's C code."""
    return hiredis.pack_command(tuple(args))  # type: ignore[no-any-return]


class HiredisPacker:
    """A redis-py `command_packer` (a connection option) for clients with the default encoding (UTF-8)."""

    def __init__(self) -> None:
        self.fallback = PythonRespSerializer(BUFFER_CUTOFF, Encoder("utf-8", "strict", False).encode)

    def pack(self, *args: Any) -> list[bytes]:
        first = args[0]
        # redis-py's rule: a command name with spaces ('CONFIG GET') is sent as separate arguments.
        if isinstance(first, str):
            if " " in first:
                args = (*first.encode().split(), *args[1:])
        elif b" " in first:
            args = (*first.split(), *args[1:])
        try:
            return [hiredis.pack_command(args)]
        except (TypeError, UnicodeError):
            return self.fallback.pack(*args)  # type: ignore[no-any-return]


def pack_with_hiredis(client: Redis) -> Redis:
    """Let the client's future connections pack with `HiredisPacker`, where its encoding is redis-py's
    default (UTF-8, strict) and no packer of the caller's is set; returns the client."""
    kwargs = client.connection_pool.connection_kwargs
    encoding = str(kwargs.get("encoding", "utf-8")).lower().replace("-", "").replace("_", "")
    default = encoding == "utf8" and kwargs.get("encoding_errors", "strict") == "strict"
    if hiredis is not None and default and kwargs.get("command_packer") is None:
        kwargs["command_packer"] = HiredisPacker()
    return client
