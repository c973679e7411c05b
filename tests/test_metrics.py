"""runtime/metrics.py without processes: reason classes, the one fleet reader, the config section.

The counts against a real run are in tests/test_observability.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
from mcp_saga.runtime import metrics
from mcp_saga.schemas.config import ConfigError, parse_config
from mcp_saga.schemas.events import InvalidEvent, decode_entry
from mcp_saga.schemas.keys import Keys
from prometheus_client import REGISTRY, CollectorRegistry

STEP = b'{"step":"s1","server":"payments","tool":"charge","result":{}}'


@pytest.fixture
def fake() -> Iterator[redis.Redis]:
    """The fleet collector's reads and its lease script, in process (fakeredis with Lua)."""
    import fakeredis

    client = fakeredis.FakeRedis()
    yield client
    client.flushall()


def exported_names(r: redis.Redis) -> set[str]:
    """Every sample name a process can export: the registry's and the fleet collector's."""
    names = {s.name for family in REGISTRY.collect() for s in family.samples}
    registry = CollectorRegistry()
    registry.register(metrics.FleetCollector(r, Keys(), interval=1))
    r.xgroup_create(Keys().events, Keys().group, id="0", mkstream=True)
    names |= {s.name for family in registry.collect() for s in family.samples}
    # Histograms and labelled counters export samples only once observed: name them by their family.
    for family in REGISTRY.collect():
        if family.name.startswith("saga_"):
            names |= {family.name, f"{family.name}_total", f"{family.name}_count", f"{family.name}_sum"}
            names.add(f"{family.name}_bucket")
    return names


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({b"type": b"nope", b"workflow": b"w", b"data": b"{}"}, "unknown-type"),
        ({b"type": b"workflow-completed", b"workflow": b"bad id", b"data": b"{}"}, "invalid-id"),
        ({b"type": b"step-completed", b"workflow": b"w", b"data": STEP.replace(b"s1", b"bad step")}, "invalid-id"),
        ({b"type": b"workflow-completed", b"workflow": b"w", b"data": b"{}", b"v": b"9"}, "version"),
        ({b"type": b"workflow-completed", b"workflow": b"w"}, "missing-field"),
        ({b"workflow": b"w", b"data": b"{}"}, "missing-field"),
        ({b"type": b"workflow-failed", b"workflow": b"w", b"data": b"{" + b" " * 300_000 + b"}"}, "too-large"),
        ({b"type": b"workflow-failed", b"workflow": b"w", b"data": b'{"reason": "\xff"}'}, "not-utf8"),
        (
            {
                b"type": b"step-completed",
                b"workflow": b"w",
                b"data": STEP[:-1] + b',"arguments":' + b'{"a":' * 200 + b"1" + b"}" * 201,
            },
            "too-deep",
        ),
        ({b"type": b"workflow-failed", b"workflow": b"w", b"data": b'{"stepsCompleted": "two"}'}, "invalid-data"),
    ],
)
def test_each_dead_letter_reason_falls_in_its_class(fields: dict[bytes, bytes], reason: str) -> None:
    with pytest.raises(InvalidEvent) as refused:
        decode_entry("1-0", fields, strict=True)  # strict: what the coordinator repairs is refused too
    assert metrics.reason_class(str(refused.value)) == reason


def test_a_reason_of_the_state_machine_is_rejected() -> None:
    assert metrics.reason_class("operator-approve for step s1, which is not awaiting approval") == "rejected"


def test_server_and_operation_labels_are_capped() -> None:
    pairs = metrics._Pairs(cap=2)
    assert pairs("a", "x") == ("a", "x") and pairs("b", "y") == ("b", "y")
    assert pairs("c", "z") == ("other", "other")
    assert pairs("a", "x") == ("a", "x")


def test_reports_count_in_their_series_each_time_and_beyond_the_cap_under_other(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`reported` looks each report's label children up once; a second report of the same labels,
    and a pair past the cap, must still count where `.labels(...)` per call would have counted them."""
    from mcp_saga.schemas.events import CompensationFailed, CompensationRefused, CompensationSucceeded

    monkeypatch.setattr(metrics, "_pairs", metrics._Pairs(cap=1))
    monkeypatch.setattr(metrics, "_report_series", {})
    common = {"step": "s", "dispatch": 1, "idempotency_key": "k", "arguments_digest": "d", "worker": "w"}

    def sample(name: str, **labels: str) -> float:
        return REGISTRY.get_sample_value(name, labels) or 0.0

    def counts() -> tuple[float, ...]:
        return (
            sample("saga_compensation_attempts_total", server="cap-a", operation="undo", outcome="succeeded"),
            sample("saga_compensation_attempts_total", server="cap-a", operation="undo", outcome="retrying"),
            sample("saga_compensation_attempts_total", server="cap-a", operation="undo", outcome="refused"),
            sample("saga_compensation_attempts_total", server="other", operation="other", outcome="succeeded"),
            sample("saga_compensation_attempt_duration_seconds_count", server="cap-a", operation="undo"),
            sample("saga_compensation_attempts_used_count", outcome="succeeded"),
        )

    failed = CompensationFailed(
        **common, attempt=1, final=False, server="cap-a", operation_id="undo", duration_ms=5.0, error="x",
        retryable=True,
    )  # fmt: skip
    refused = CompensationRefused(**common, attempt=1, final=True, server="cap-a", operation_id="undo", reason="r")
    before = counts()
    for server in ("cap-a", "cap-a", "cap-b", "cap-b"):
        metrics.reported(
            CompensationSucceeded(
                **common, attempt=2, final=True, server=server, operation_id="undo", duration_ms=5.0, result={}
            )
        )
    metrics.reported(failed)
    metrics.reported(refused)
    after = counts()
    assert [b - a for a, b in zip(before, after, strict=True)] == [2, 1, 1, 2, 3, 4]
    assert ("cap-b", "undo", "succeeded") not in metrics._report_series  # `other` is not cached: the cap holds


def test_the_counting_retry_counts_errors_and_recoveries_and_keeps_redis_pys_retries() -> None:
    """A call that succeeds at once skips the counting; the first error is replayed into redis-py's
    loop, so its failure handler, retry budget and backoff are as without the counting."""
    from redis.backoff import NoBackoff
    from redis.exceptions import ConnectionError as RedisConnectionError

    retry = metrics.CountingRetry("retry-test", NoBackoff(), 2)

    def sample(name: str) -> float:
        return REGISTRY.get_sample_value(name, {"component": "retry-test"}) or 0.0

    def flaky(errors: int, kind: type[Exception] = RedisConnectionError) -> tuple[object, list[Exception]]:
        left, handled = [errors], []

        def do() -> str:
            if left[0]:
                left[0] -= 1
                raise kind("down")
            return "ok"

        return do, handled

    def counts() -> tuple[float, float]:
        return sample("saga_redis_errors_total"), sample("saga_redis_reconnects_total")

    before = counts()
    do, handled = flaky(0)
    assert retry.call_with_retry(do, handled.append) == "ok" and handled == []
    assert counts() == before
    do, handled = flaky(2)
    assert retry.call_with_retry(do, handled.append) == "ok" and len(handled) == 2
    assert counts() == (before[0] + 2, before[1] + 1)
    do, handled = flaky(3)  # one attempt and two retries, all failing: redis-py's budget, then its error
    with pytest.raises(RedisConnectionError):
        retry.call_with_retry(do, handled.append)
    assert len(handled) == 3 and counts() == (before[0] + 5, before[1] + 1)
    failures: list[int] = []
    do, _ = flaky(1)
    assert retry.call_with_retry(do, lambda _, n: failures.append(n), with_failure_count=True) == "ok"
    assert failures == [1]
    do, handled = flaky(1)  # an error the caller says not to retry: raised at once, not counted
    with pytest.raises(RedisConnectionError):
        retry.call_with_retry(do, handled.append, is_retryable=lambda _: False)
    assert handled == [] and counts() == (before[0] + 6, before[1] + 2)


def test_only_one_process_reads_the_fleet_gauges(fake: redis.Redis) -> None:
    keys = Keys()
    fake.zadd(keys.index("needs-attention"), {"wf-1": 1.0, "wf-2": 2.0})
    one, two = (metrics.FleetCollector(fake, keys, interval=60, instance=name) for name in ("one", "two"))
    first, second = list(one.collect()), list(two.collect())
    assert [f.samples[0].value for f in first if f.name == "saga_fleet_reader"] == [1]
    assert [f.samples[0].value for f in second if f.name == "saga_fleet_reader"] == [0]
    assert [f.name for f in second] == ["saga_fleet_reader"]  # the other exports none of the gauges
    (workflows,) = [f for f in first if f.name == "saga_workflows"]
    assert {s.labels["status"]: s.value for s in workflows.samples}["needs-attention"] == 2
    fake.delete(keys.metrics_reader)  # the reader died and its lease ran out
    two._next = 0.0
    assert [f.samples[0].value for f in two.collect() if f.name == "saga_fleet_reader"] == [1]


def test_the_metrics_section_is_validated() -> None:
    assert parse_config({}).metrics.port is None  # off by default
    assert parse_config({"metrics": {"port": 9464}}).metrics.port == 9464
    with pytest.raises(ConfigError, match=r"metrics.port: Input should be less than or equal to 65535"):
        parse_config({"metrics": {"port": 70000}})
    with pytest.raises(ConfigError, match=r"metrics.token_env"):
        parse_config({"metrics": {"token_env": "not a name"}})
    with pytest.raises(ConfigError, match="SAGA_UNSET_TOKEN"):
        parse_config({"metrics": {"token_env": "SAGA_UNSET_TOKEN"}}).metrics.token()


def test_a_bad_metrics_port_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    from mcp_saga.cli.main import main

    assert main(["coordinator", "--redis", "redis://127.0.0.1:1/0", "--metrics-port", "70000"]) == 2
    assert "--metrics-port 70000: a port is 1-65535" in capsys.readouterr().err


def test_held_reports_count_by_the_batch_and_before_any_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker's reports are counted `HOLD_REPORTS` at a time (runtime/metrics.py `reported`), and
    whatever reads the registry (a scrape's exposition, `get_sample_value`) sees every one of them."""
    from mcp_saga.schemas.events import CompensationSucceeded
    from prometheus_client import generate_latest

    monkeypatch.setattr(metrics, "_report_series", {})
    report = CompensationSucceeded(
        step="s", dispatch=1, idempotency_key="k", arguments_digest="d", worker="w", attempt=1, final=True,
        server="held-a", operation_id="undo", duration_ms=5.0, result={},
    )  # fmt: skip
    child = metrics.OUTCOMES.labels("held-a", "undo", "succeeded")

    def counted() -> float:  # the series itself, read without collecting the registry
        return child._value.get()

    generate_latest(REGISTRY)
    start = counted()
    for _ in range(metrics.HOLD_REPORTS - 1):
        metrics.reported(report)
    assert counted() == start  # held
    metrics.reported(report)
    assert counted() == start + metrics.HOLD_REPORTS  # the batch, counted together
    metrics.reported(report)
    assert counted() == start + metrics.HOLD_REPORTS
    series = 'saga_compensation_attempts_total{operation="undo",outcome="succeeded",server="held-a"}'
    line = f"{series} {start + metrics.HOLD_REPORTS + 1}"
    assert line in generate_latest(REGISTRY).decode()  # a scrape counts what is held first
    metrics.reported(report)
    labels = {"server": "held-a", "operation": "undo", "outcome": "succeeded"}
    assert REGISTRY.get_sample_value("saga_compensation_attempts_total", labels) == start + metrics.HOLD_REPORTS + 2
