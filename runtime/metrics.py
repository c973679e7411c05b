"""Prometheus metrics of every mcp-saga process, each defined once here, and its `/metrics` endpoint.

Two kinds, so that a dashboard can add them up across a fleet:

- **What this process did** (counters and histograms: events consumed, transitions, compensation
  outcomes, Redis errors): each process counts its own, and `sum` over processes is the fleet's.
- **What Redis holds** (gauges: workflows by status, queue depth, consumer-group lag and pending,
  the oldest pending event's age): every coordinator could read them, but then summing would
  multiply them. So only one process exports them, whichever holds the short lease
  `saga:metrics:reader` (SET NX PX, renewed on each read); it reads Redis at most once per
  `[metrics] fleet_interval`, whatever the number of scrapers. The others export none of these
  series, so both `sum` and `max` over the fleet give the right figure; `saga_fleet_reader` says
  which process is reading.

Labels are bounded: event types, statuses and dead-letter reason classes are fixed sets; server
and operation names come from events, so each process keeps the first `LABEL_CAP` distinct pairs
and counts the rest under `other`. No workflow or step id is ever a label.

The call sites in the coordinator and the workers are one line each; everything else is here.
"""

from __future__ import annotations

import re
import socket
import threading
import time
from collections import Counter as Tally
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from importlib import metadata, resources
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import make_server

from mcp_saga.runtime.logs import get_logger
from mcp_saga.schemas.events import PAYLOAD_TYPES, CompensationRefused, Payload, Report
from mcp_saga.schemas.keys import Keys
from prometheus_client import REGISTRY, Counter, Gauge, Histogram, Info, make_wsgi_app
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import ThreadingWSGIServer, _SilentHandler
from prometheus_client.registry import Collector
from redis.backoff import AbstractBackoff
from redis.retry import Retry

if TYPE_CHECKING:
    from mcp_saga.schemas.config import MetricsSettings
    from mcp_saga.schemas.records import CompensationJob
    from redis import Redis

log = get_logger("metrics")

LABEL_CAP = 200  # distinct (server, operation) pairs a process labels before it says `other`
OTHER = "other"
TERMINAL = ("compensated", "needs-attention", "completed")

# Per-process ---------------------------------------------------------------------------------

HOLD_REPORTS = 32  # a worker's reports counted at a time (`reported`)
_held: deque[tuple[str | None, str | None, str, float | None, int, bool]] = deque()


class _HeldReports(Collector):
    """Counts the held reports before the registry collects the series they count in: it is
    registered before them, and the registry collects in the order of registration."""

    def describe(self) -> list[Any]:
        return []  # no series of its own (and the registry need not collect it to find that out)

    def collect(self) -> Iterator[Any]:
        _count_held()
        return iter(())


REGISTRY.register(_HeldReports())


EVENTS = Counter("saga_events_consumed", "Events a coordinator read from saga:events, by type", ["type"])
DEAD_LETTERS = Counter("saga_dead_letters", "Events moved to saga:dead-letter, by reason class", ["reason"])
TRANSITIONS = Counter(
    "saga_workflow_transitions",
    "Workflow status changes committed (`from` is `new` for a new workflow)",
    ["from", "to"],
)
CAS_CONFLICTS = Counter("saga_cas_conflicts", "Commits lost to another coordinator's change (then folded again)")
BATCH_SECONDS = Histogram(
    "saga_batch_duration_seconds",
    "Time a coordinator spent on one batch of events, from decode to acknowledgement",
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
)
BATCH_EVENTS = Histogram(
    "saga_batch_events", "Events per non-empty batch", buckets=(1, 2, 5, 10, 25, 50, 100, 250, 1000, 10_000)
)
SETTLE_SECONDS = Histogram(
    "saga_workflow_settle_seconds",
    "From a workflow's first event to its terminal status, by that status",
    ["status"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600, 86_400),
)
DISPATCHED = Counter("saga_compensations_dispatched", "Compensation jobs a coordinator queued", ["server", "operation"])
OUTCOMES = Counter(
    "saga_compensation_attempts",
    "Compensation attempts a worker reported, by outcome: succeeded, failed (final), retrying, refused",
    ["server", "operation", "outcome"],
)
ATTEMPTS_USED = Histogram(
    "saga_compensation_attempts_used",
    "Attempts a compensation dispatch took until its final report, by outcome",
    ["outcome"],
    buckets=(1, 2, 3, 4, 5, 7, 10, 20, 50, 100),
)
ATTEMPT_SECONDS = Histogram(
    "saga_compensation_attempt_duration_seconds",
    "Duration of one compensation attempt, mostly its tools/call",
    ["server", "operation"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
REDIS_ERRORS = Counter("saga_redis_errors", "Redis commands that failed (connection or timeout)", ["component"])
REDIS_RECONNECTS = Counter("saga_redis_reconnects", "Recoveries after Redis errors", ["component"])
HEARTBEAT = Gauge(
    "saga_coordinator_heartbeat_timestamp_seconds", "When this coordinator last went round its loop (Unix time)"
)
BUILD = Info("saga_build", "mcp-saga version and the component this process runs")

# The bounded reason classes of a dead letter, by the start of `decode_entry`'s (and the machine's) message.
_REASONS = (
    ("unknown-type", re.compile(r"unknown event type")),
    (
        "invalid-id",
        re.compile(r"invalid workflow id|.* invalid step id|[\w-]+ data: Expected `str` matching .* at `\$\.step`$"),
    ),
    ("version", re.compile(r"unsupported wire version")),
    ("missing-field", re.compile(r"missing field")),
    ("too-large", re.compile(r"data is \d+ bytes")),
    ("not-utf8", re.compile(r"field '?\w+'? is not valid UTF-8")),
    ("too-deep", re.compile(r".* nested deeper")),
    ("invalid-data", re.compile(r"[\w-]+ data: ")),
)
EVENT_TYPES = frozenset(PAYLOAD_TYPES)


def reason_class(reason: str) -> str:
    """The dead-letter reason as one of a fixed set (`rejected`: the state machine refused it)."""
    for name, pattern in _REASONS:
        if pattern.match(reason):
            return name
    return "rejected"


class _Pairs:
    """The first LABEL_CAP distinct (server, operation) pairs keep their names; the rest are `other`."""

    def __init__(self, cap: int = LABEL_CAP) -> None:
        self.cap, self.seen, self.lock = cap, set[tuple[str, str]](), threading.Lock()

    def __call__(self, server: str | None, operation: str | None) -> tuple[str, str]:
        pair = (server or "", operation or "")
        if pair in self.seen:
            return pair
        with self.lock:
            if len(self.seen) < self.cap:
                self.seen.add(pair)
                return pair
        return OTHER, OTHER


_pairs = _Pairs()


# Coordinator hooks ---------------------------------------------------------------------------


def observe_batch(
    entries: list[tuple[bytes, dict[bytes, bytes]]],
    dead: Iterable[tuple[Any, Any, str]],
    views: Iterable[Any],
    created: int,
    conflicts: int,
    started: float,
) -> None:
    """One batch of a coordinator: events by type, dead letters, transitions, conflicts, duration."""
    if not entries:
        return
    for kind, n in Tally(f.get(b"type", b"").decode(errors="replace") for _, f in entries).items():
        EVENTS.labels(kind if kind in EVENT_TYPES else "invalid").inc(n)
    for _, _, reason in dead:
        DEAD_LETTERS.labels(reason_class(reason)).inc()
    if created:
        TRANSITIONS.labels("new", "running").inc(created)
    transitions(views)
    if conflicts:
        CAS_CONFLICTS.inc(conflicts)
    BATCH_EVENTS.observe(len(entries))
    BATCH_SECONDS.observe(time.perf_counter() - started)


def transitions(views: Iterable[Any]) -> None:
    """Committed workflow views (coordinator.machine.WorkflowView) whose status changed."""
    for view in views:
        state = view.state
        if state.status == view.loaded_status:
            continue
        TRANSITIONS.labels(view.loaded_status or "new", state.status).inc()
        if state.status in TERMINAL and state.created_at:
            SETTLE_SECONDS.labels(state.status).observe(max(0.0, state.updated_at - state.created_at))


def dispatched(job: CompensationJob) -> None:
    DISPATCHED.labels(*_pairs(job.server, job.operation_id)).inc()


def heartbeat() -> None:
    HEARTBEAT.set(time.time())


# Worker hooks --------------------------------------------------------------------------------


# The series one report counts in, by (server, operation, outcome) as reported: `.labels(...)`
# checks its arguments and takes the metric's lock on every call, which was a third of what
# `reported` cost per attempt. Bounded as the labels are: LABEL_CAP pairs (then `other`) x outcomes.
_report_series: dict[tuple[str | None, str | None, str], tuple[Any, Any, Any]] = {}


def _series(server: str | None, operation: str | None, outcome: str) -> tuple[Any, Any, Any]:
    """(attempts by outcome, attempt duration, attempts used) children for one report's labels."""
    found = _report_series.get((server, operation, outcome))
    if found is None:
        labels = _pairs(server, operation)
        seconds = None if outcome == "refused" else ATTEMPT_SECONDS.labels(*labels)  # a refusal called nothing
        found = (OUTCOMES.labels(*labels, outcome), seconds, ATTEMPTS_USED.labels(outcome))
        if labels != (OTHER, OTHER):  # an `other` pair stays uncached, so the cache stays within the cap
            _report_series[(server, operation, outcome)] = found
    return found


def reported(payload: Payload) -> None:
    """One attempt report of a worker: its outcome, duration and, when final, the attempts it took.

    Held, and counted `HOLD_REPORTS` at a time or when anything collects the registry (a scrape,
    `get_sample_value`: `_HeldReports` is collected first), so that no reader ever misses one:
    amid a real attempt, the counter and two histograms (their locks, their buckets' search)
    cost the worker's thread 20-25 us with cold caches, against 2-3 us in a loop (issue 17, Cost).
    """
    if not isinstance(payload, Report):
        return
    if isinstance(payload, CompensationRefused):
        outcome = "refused"
    else:
        outcome = payload.TYPE.removeprefix("compensation-") if payload.final else "retrying"
    _held.append((payload.server, payload.operation_id, outcome, payload.duration_ms, payload.attempt, payload.final))
    if len(_held) >= HOLD_REPORTS:
        _count_held()


def _count_held() -> None:
    """The held reports into their series; safe from any thread (each is taken once)."""
    while True:
        try:
            server, operation, outcome, duration_ms, attempt, final = _held.popleft()
        except IndexError:
            return
        outcomes, seconds, used = _series(server, operation, outcome)
        if seconds is not None and duration_ms is not None:
            seconds.observe(duration_ms / 1000)
        outcomes.inc()
        if final:
            used.observe(attempt)


class CountingRetry(Retry):
    """redis-py's Retry, counting the errors it absorbs and the recoveries after them.

    Every command of a worker, RQ's included (about 26 a job), passes through here, so a call
    that succeeds at once costs only its `do()`: the counting, and redis-py's loop, start at the
    first error, which is replayed into that loop so that it handles it as its own first attempt
    (the failure handler, the retry budget, the backoff are redis-py's).
    """

    def __init__(self, component: str, backoff: AbstractBackoff, retries: int) -> None:
        super().__init__(backoff, retries)
        self.component = component

    def call_with_retry(  # type: ignore[override]
        self,
        do: Callable[[], Any],
        fail: Callable[..., Any],
        is_retryable: Callable[[Exception], bool] | None = None,
        with_failure_count: bool = False,
    ) -> Any:
        try:
            return do()
        except self._supported_errors as error:
            first: Exception | None = error

        def again() -> Any:
            nonlocal first
            if first is not None:
                error, first = first, None
                raise error
            return do()

        def counted(error: Exception, *rest: Any) -> Any:
            REDIS_ERRORS.labels(self.component).inc()
            return fail(error, *rest)

        result = super().call_with_retry(again, counted, is_retryable, with_failure_count)
        REDIS_RECONNECTS.labels(self.component).inc()
        return result


# Fleet-wide gauges ---------------------------------------------------------------------------

_CLAIM = resources.files(__package__).joinpath("lua", "claim.lua").read_text()


class FleetCollector(Collector):
    """The gauges read from Redis, by one process of the fleet at a time (see the module's doc)."""

    def __init__(
        self, redis: Redis, keys: Keys, interval: float, instance: str | None = None, queue: Redis | None = None
    ) -> None:
        from mcp_saga.runtime.connect import Lua
        from mcp_saga.runtime.reader import Reader

        self.redis, self.keys, self.interval = redis, keys, interval
        self.reader = Reader(redis, keys, queue)
        self.instance = instance or f"{socket.gethostname()}-{id(self):x}"
        self._claim = Lua(redis, _CLAIM)
        self._lock = threading.Lock()
        self._next = 0.0
        self._families: list[GaugeMetricFamily] = []
        self._reading = False

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return iter(())  # read on scrape, not at registration

    def collect(self) -> Iterator[GaugeMetricFamily]:
        with self._lock:
            now = time.monotonic()
            if now >= self._next:
                self._next = now + self.interval
                try:
                    self._reading = bool(
                        self._claim(keys=[self.keys.metrics_reader], args=[self.instance, int(self.interval * 3000)])
                    )
                    self._families = self._read() if self._reading else []
                except Exception as exc:  # a scrape must answer even while Redis is away
                    REDIS_ERRORS.labels("metrics").inc()
                    log.warning("fleet gauges not read", error=str(exc))
                    self._reading, self._families = False, []
            families = list(self._families)
            reading = self._reading
        yield GaugeMetricFamily("saga_fleet_reader", "1 on the one process that exports the fleet gauges", reading)
        yield from families

    def _read(self) -> list[GaugeMetricFamily]:
        workflows = GaugeMetricFamily(
            "saga_workflows", "Workflows by status (from the status indexes)", labels=["status"]
        )
        for status, n in self.reader.counts().items():
            workflows.add_metric([status], n)
        queue = GaugeMetricFamily("saga_queue_jobs", "Compensation jobs of the RQ queue by state", labels=["state"])
        for state, n in self.reader.queue_depth().items():
            queue.add_metric([state], n)
        lag = GaugeMetricFamily("saga_consumer_group_lag", "Events not yet delivered to the group", labels=["group"])
        pending = GaugeMetricFamily(
            "saga_consumer_group_pending", "Events delivered, not acknowledged", labels=["group"]
        )
        consumers = GaugeMetricFamily("saga_consumer_group_consumers", "Consumers in the group", labels=["group"])
        oldest = GaugeMetricFamily(
            "saga_oldest_pending_age_seconds", "Age of the oldest unacknowledged event (0: none)", labels=["group"]
        )
        # One series per group, summed over the partitions (the oldest entry: the oldest of any).
        totals: dict[str, list[Any]] = {}
        for group in self.reader.groups():
            name = _text(group["name"])
            total = totals.setdefault(name, [0, 0, 0, 0.0, False])
            total[0] += group["pending"]
            total[1] = max(total[1], group["consumers"])
            if group.get("lag") is not None:  # Redis < 7 does not know it
                total[2], total[4] = total[2] + group["lag"], True
            first = self.redis.xpending(group["stream"], name)["min"] if group["pending"] else None
            age = max(0.0, time.time() - int(_text(first).partition("-")[0]) / 1000) if first else 0.0
            total[3] = max(total[3], age)
        for name, (n_pending, n_consumers, n_lag, age, has_lag) in totals.items():
            pending.add_metric([name], n_pending)
            consumers.add_metric([name], n_consumers)
            if has_lag:
                lag.add_metric([name], n_lag)
            oldest.add_metric([name], age)
        dead = GaugeMetricFamily(
            "saga_dead_letter_stream_length",
            "Entries in saga:dead-letter (every partition's)",
            sum(self.redis.xlen(part.dead_letter) for part in self.keys.every()),
        )
        return [workflows, queue, lag, pending, consumers, oldest, dead]


def _version() -> str:
    try:
        return metadata.version("mcp-saga")
    except metadata.PackageNotFoundError:  # a checkout on sys.path, not installed
        return "unknown"


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


# The endpoint --------------------------------------------------------------------------------


class MetricsServer:
    """`/metrics` in a daemon thread; `close()` stops it (tests, or a process that reconfigures)."""

    def __init__(self, httpd: ThreadingWSGIServer, thread: threading.Thread, collector: Collector | None) -> None:
        self.httpd, self.thread, self.collector = httpd, thread, collector

    @property
    def port(self) -> int:
        return self.httpd.server_port

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        if self.collector is not None:
            REGISTRY.unregister(self.collector)


def _authenticated(app: Callable, token: str | None) -> Callable:
    expected = f"Bearer {token}" if token else None

    def guarded(environ: dict[str, Any], start_response: Callable) -> Any:
        if expected is not None and environ.get("HTTP_AUTHORIZATION") != expected:
            start_response("401 Unauthorized", [("Content-Type", "text/plain"), ("WWW-Authenticate", "Bearer")])
            return [b"a bearer token is required\n"]
        return app(environ, start_response)

    return guarded


def serve(
    settings: MetricsSettings,
    component: str,
    *,
    port: int | None = None,
    redis: Redis | None = None,
    keys: Keys | None = None,
    queue: Redis | None = None,
) -> MetricsServer | None:
    """Start the endpoint when a port is configured (or given); None when metrics are off.

    With `redis`, this process also competes to export the fleet gauges: the coordinator and the
    gateway pass theirs, workers need not.
    """
    port = port or settings.port
    if port is None:
        return None
    BUILD.info({"version": _version(), "component": component})
    collector = None
    if redis is not None:
        collector = FleetCollector(redis, keys or Keys(), settings.fleet_interval, queue=queue)
        REGISTRY.register(collector)
    app = _authenticated(make_wsgi_app(REGISTRY), settings.token())
    httpd = make_server(settings.address, port, app, ThreadingWSGIServer, handler_class=_SilentHandler)
    thread = threading.Thread(target=httpd.serve_forever, name="saga-metrics", daemon=True)
    thread.start()
    log.info("metrics served", address=settings.address, port=httpd.server_port, component=component)
    return MetricsServer(httpd, thread, collector)
