"""How a user names a Sentinel-managed Redis, and the errors a mistake gets (runtime/sentinel.py, [redis])."""

from __future__ import annotations

import argparse

import pytest
import redis
from mcp_saga.cli.args import CliError, redis_url
from mcp_saga.runtime.connect import connect, connect_async
from mcp_saga.runtime.durability import Durability, NotReplicated, topology_changed
from mcp_saga.runtime.publish import Publisher
from mcp_saga.runtime.redis_checks import healing_condition
from mcp_saga.runtime.sentinel import (
    AsyncFollowingConnection,
    FollowingConnection,
    FollowingSSLConnection,
    parse_sentinel_url,
    redact,
    resolve_url,
    sentinel_url,
)
from mcp_saga.schemas.config import ConfigError, RedisSettings, parse_config
from mcp_saga.schemas.events import WorkflowCompleted


def test_a_sentinel_url_names_the_sentinels_the_master_and_the_database() -> None:
    target = parse_sentinel_url("redis+sentinel://:s3cret@10.0.0.5:26379,10.0.0.6,[::1]:26380/orders/2")
    assert target.sentinels == (("10.0.0.5", 26379), ("10.0.0.6", 26379), ("::1", 26380))
    assert (target.master, target.db, target.password, target.tls) == ("orders", 2, "s3cret", False)
    assert "s3cret" not in target.describe()
    assert parse_sentinel_url("redis+sentinels://h:1/m?sentinel_password=x").tls
    assert parse_sentinel_url("redis+sentinels://h:1/m?sentinel_password=x").sentinel_password == "x"


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("redis+sentinel://h:26379", "name the monitored primary"),
        ("redis+sentinel://h:26379/", "name the monitored primary"),
        ("redis+sentinel://h:99999/m", "is not host:port"),
        ("redis+sentinel://h:1,/m", "is not host:port"),
        ("redis+sentinel://h:1/m/x", "only a database number"),
        ("redis+sentinel://h:1/m?master=n", "unknown option"),
    ],
)
def test_a_malformed_sentinel_url_is_refused_naming_the_setting(url: str, says: str) -> None:
    with pytest.raises(ConfigError, match=says) as raised:
        resolve_url(url, RedisSettings())
    assert "--redis / REDIS_URL" in str(raised.value)


def test_the_config_form_is_the_same_url_and_both_at_once_is_a_mistake() -> None:
    settings = parse_config({"redis": {"sentinels": ["10.0.0.5:26379", "10.0.0.6:26379"], "master": "m"}}).redis
    assert sentinel_url(settings) == "redis+sentinel://10.0.0.5:26379,10.0.0.6:26379/m/0"
    assert resolve_url(None, settings) == sentinel_url(settings)
    with pytest.raises(ConfigError, match=r"both .* and \[redis\] sentinels") as raised:
        resolve_url("redis://:pw@h:6379/0", settings)
    assert "pw" not in str(raised.value)
    assert resolve_url("redis://h:6379/0", RedisSettings()) == "redis://h:6379/0"
    assert resolve_url(None, RedisSettings()) is None


@pytest.mark.parametrize(
    ("section", "says"),
    [
        ({"sentinels": ["h:1"]}, "master is not"),
        ({"master": "m"}, "needs sentinels"),
        ({"sentinels": ["h"], "master": "m"}, r"redis\.sentinels: entry 0"),
        ({"sentinels": ["redis://h:1"], "master": "m"}, r"redis\.sentinels: entry 0"),
        ({"wait_replicas": -1}, r"redis\.wait_replicas"),
        ({"wait_timeout_ms": 0}, r"redis\.wait_timeout_ms"),
        ({"cluster": True, "queue_url": "redis://q:1/0", "sentinels": ["h:1"], "master": "m"}, "keep one"),
    ],
)
def test_config_mistakes_name_the_field(section: dict, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        parse_config({"redis": section})


def test_the_cli_takes_the_config_sentinels_when_no_url_is_given(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("REDIS_URL", raising=False)
    config = tmp_path / "saga.toml"
    config.write_text('[redis]\nsentinels = ["127.0.0.1:26379"]\nmaster = "mymaster"\n')
    assert redis_url(argparse.Namespace(config=str(config))) == "redis+sentinel://127.0.0.1:26379/mymaster/0"
    with pytest.raises(ConfigError, match="keep one"):
        redis_url(argparse.Namespace(config=str(config), redis="redis://127.0.0.1:6379/0"))
    with pytest.raises(CliError, match="no Redis"):
        redis_url(argparse.Namespace())


def test_clients_for_a_sentinel_url_follow_the_primary_on_every_connect() -> None:
    sync = connect("redis+sentinel://:pw@127.0.0.1:1/m/3", RedisSettings())
    assert sync.connection_pool.connection_class is FollowingConnection
    assert sync.connection_pool.connection_kwargs["db"] == 3
    assert sync.connection_pool.connection_kwargs["password"] == "pw"
    assert (
        connect("redis+sentinels://127.0.0.1:1/m", RedisSettings()).connection_pool.connection_class
        is FollowingSSLConnection
    )
    assert (
        connect_async("redis+sentinel://127.0.0.1:1/m", RedisSettings()).connection_pool.connection_class
        is AsyncFollowingConnection
    )
    assert type(connect("redis://127.0.0.1:1/0", RedisSettings()).connection_pool) is redis.ConnectionPool


def test_redact_hides_passwords() -> None:
    assert redact("redis://user:pw@h:1/0") == "redis://user:***@h:1/0"
    assert redact("redis+sentinel://:pw@h:1,g:2/m") == "redis+sentinel://:***@h:1,g:2/m"
    assert redact("redis://h:1/0") == "redis://h:1/0"


def test_a_write_too_few_replicas_confirmed_is_a_condition_to_wait_out() -> None:
    with pytest.raises(NotReplicated) as raised:
        Durability(replicas=2, timeout_ms=10).check(1)
    assert healing_condition(raised.value) == "NOREPLICAS"
    # What Redis answers under `min-replicas-to-write` is the same condition.
    assert healing_condition(redis.ResponseError("NOREPLICAS Not enough good replicas to write.")) == "NOREPLICAS"
    assert Durability.of(RedisSettings()) is None
    # A durable write on a cluster that met MOVED or a dead node: the same, once the topology is refreshed.
    assert healing_condition(topology_changed(redis.exceptions.MovedError("3999 127.0.0.1:6381"))) == "TRYAGAIN"
    assert Durability.of(RedisSettings(wait_replicas=1, wait_timeout_ms=50)) == Durability(1, 50)


def test_a_publisher_with_durability_sends_wait_with_each_event_and_refuses_an_unconfirmed_one(
    r: redis.Redis, monkeypatch
) -> None:
    """The test server has no replica: WAIT answers 0, so the event is sent again, then refused."""
    import mcp_saga.runtime.publish as publish

    monkeypatch.setattr(publish, "NOT_REPLICATED_RETRY_FOR", 0.1)
    with pytest.raises(NotReplicated, match="workflow-completed of 'w-1'"):
        Publisher(r, durability=Durability(replicas=1, timeout_ms=1)).publish("w-1", WorkflowCompleted())
    assert r.xlen("saga:events") >= 2  # re-sent while unconfirmed: the coordinator folds copies to no change
    assert Publisher(r).publish("w-2", WorkflowCompleted())  # without durability, no WAIT


def test_a_coordinator_with_durability_dispatches_and_acknowledges_nothing_the_replicas_did_not_confirm(
    r: redis.Redis,
) -> None:
    """The test server has no replica, so every WAIT falls short: the batch stays pending, no job is queued.

    Without durability the same batch is committed, dispatched and acknowledged (the control).
    """
    from mcp_saga.coordinator.consumer import Coordinator
    from mcp_saga.schemas.events import StepCompleted, WorkflowFailed, entry_fields
    from mcp_saga.schemas.keys import Keys
    from rq import Queue

    keys = Keys()
    recovery = {"strategy": "compensation", "compensatingOperation": {"operationId": "undo", "parameters": {}}}
    step = StepCompleted(step="a", server="svc", tool="do", result={"structuredContent": {}}, recovery=recovery)
    for payload in (step, WorkflowFailed(reason="boom")):
        r.xadd(keys.events, entry_fields("durable-1", payload))
    settings = {"coordinator": {"block_ms": 10}}
    durable = Coordinator(r, parse_config({**settings, "redis": {"wait_replicas": 1, "wait_timeout_ms": 10}}), "d")
    durable.ensure_group()
    with pytest.raises(NotReplicated):
        durable.step()
    assert healing_condition(NotReplicated("NOREPLICAS x")) == "NOREPLICAS"  # the run loop waits it out
    assert Queue(keys.queue, connection=r).count == 0
    assert r.xpending(keys.events, keys.group)["pending"] == 2  # nothing acknowledged

    plain = Coordinator(r, parse_config(settings), "d")  # the same consumer: its pending entries first
    plain.process(plain._read("0"), redelivered=True)
    assert Queue(keys.queue, connection=r).count == 1
    assert r.xpending(keys.events, keys.group)["pending"] == 0
