"""The one place Redis clients are made, so that every process understands the same URLs.

The coordinator, the workers, the gateway, the SDK and the `saga` commands all connect here: a
plain redis-py URL (`redis://`, `rediss://`, `unix://`), or a `redis+sentinel://` URL whose
client asks Sentinel for the current primary and follows a failover (runtime/sentinel.py).
"""

from __future__ import annotations

from typing import Any

import redis
import redis.asyncio
from mcp_saga.runtime.sentinel import is_sentinel_url, sentinel_client, sentinel_client_async


def connect(url: str, **options: Any) -> redis.Redis:
    """A blocking client for `url`; `options` are redis-py's (retry, socket_timeout, decode_responses, ...)."""
    if is_sentinel_url(url):
        return sentinel_client(url, **options)
    return redis.Redis.from_url(url, **options)


def connect_async(url: str, **options: Any) -> redis.asyncio.Redis:
    """The same over `redis.asyncio`, for the SDK and the gateway."""
    if is_sentinel_url(url):
        return sentinel_client_async(url, **options)
    return redis.asyncio.Redis.from_url(url, **options)
