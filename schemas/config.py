"""The one TOML file: which MCP servers workers may call, the trust policy, and tunables.

Validation happens once at start-up; a mistake stops the process with a message naming the
field (`servers.payments.url: ...`), never later in the middle of an unwind.
"""

from __future__ import annotations

import fnmatch
import os
import re
import sys
import tomllib
from pathlib import Path
from typing import Any, Literal

import tomli_w
from mcp_saga.schemas.keys import MAX_PARTITIONS, Keys
from mcp_saga.schemas.recovery import Recovery
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class ConfigError(ValueError):
    """A configuration mistake, phrased for the operator: file, field, what is wrong."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ServerConfig(_Strict):
    """One MCP server: streamable HTTP (`url`) or stdio (`command`)."""

    url: str | None = None
    # Header name -> name of the environment variable holding its value (secrets stay out of files).
    headers_from_env: dict[str, str] = Field(default_factory=dict)
    command: list[str] | None = None
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = None
    timeout: float = Field(default=30.0, gt=0)
    # Operator-declared recovery for tools whose server does not declare SEP-3172 (tool -> recovery),
    # validated once here so a bad overlay stops start-up with its full path.
    recovery: dict[str, Recovery] = Field(default_factory=dict)
    # Tools the operator declares idempotent under the forward key (as `idempotentHint: true`
    # would): an in-doubt step of one is settled by calling it again with that key.
    idempotent: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _one_transport(self) -> ServerConfig:
        if (self.url is None) == (self.command is None):
            raise ValueError("set exactly one of `url` (streamable HTTP) or `command` (stdio)")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url {self.url!r} must start with http:// or https://")
        if self.command is not None and not self.command:
            raise ValueError("command must not be empty")
        return self

    def headers(self) -> dict[str, str]:
        """Resolve header values from the environment; a missing variable is a config error."""
        resolved = {}
        for header, variable in self.headers_from_env.items():
            value = os.environ.get(variable)
            if value is None:
                raise ConfigError(f"header {header!r} reads environment variable {variable!r}, which is not set")
            resolved[header] = value
        return resolved


Decision = Literal["auto", "approval", "deny"]


class Policy(_Strict):
    """Which (server, operation) compensations run unattended: patterns over `server:operation`.

    Precedence is deny, then approval, then auto; a pair no pattern names waits for approval,
    because a compensation nobody allowed is not one to run unattended.

    `self_inverse` names the `server:tool` pairs whose *server* may declare the tool as its own
    undo (the reference filesystem server's `move_file`, undone by `move_file` with the paths
    swapped). Calling the original tool again is refused by default, since a server that
    declares it by mistake would repeat the effect instead of undoing it; an operator overlay
    needs no consent, as the operator wrote it.
    """

    auto: list[str] = Field(default_factory=lambda: ["*"])
    approval: list[str] = Field(default_factory=list)
    deny: list[str] = Field(default_factory=list)
    self_inverse: list[str] = Field(default_factory=list)

    def self_inverse_refusal(self, server: str, tool: str, operation: str, source: str | None) -> str | None:
        """Why compensating `tool` with `operation` is refused as a self-inverse; None if it is not."""
        if operation != tool or source == "overlay":
            return None
        if any(fnmatch.fnmatchcase(f"{server}:{tool}", p) for p in self.self_inverse):
            return None
        return (
            f"the compensation would call the original tool {tool!r} again; if {server}:{tool} is its own"
            f' inverse, declare it in an overlay or consent with [policy] self_inverse = ["{server}:{tool}"]'
        )

    def decide(self, server: str, operation: str) -> Decision:
        target = f"{server}:{operation}"
        for decision, patterns in (("deny", self.deny), ("approval", self.approval), ("auto", self.auto)):
            if any(fnmatch.fnmatchcase(target, p) for p in patterns):
                return decision  # type: ignore[return-value]
        return "approval"


class CoordinatorSettings(_Strict):
    batch: int = Field(default=100, ge=1, le=10_000)
    # Below redis-py's default 5 s socket timeout, which would cut a longer blocking read.
    block_ms: int = Field(default=1000, ge=1, le=4000)
    # A silent coordinator's pending entries are claimed after this; claims run every half of it.
    claim_idle_ms: int = Field(default=20_000, ge=100)
    # Seconds a dispatched compensation may stay silent before it is dispatched again: no attempt
    # report of its current dispatch (a retry's backoff counts as heard), no worker lease alive and
    # its job not waiting in the queue. Short, because a live call always shows its lease.
    watchdog_after: float = Field(default=5.0, gt=0)
    watchdog_every: float = Field(default=1.0, gt=0)
    # Longer than a claim takes (claim_idle_ms and half of it again), so that a step held by a
    # coordinator that died is claimed before the barrier gives up on it (see `guarantee_problems`).
    barrier_grace: float = Field(default=60.0, ge=0, description="seconds to wait for missing steps")
    parallel: bool = False
    # Routing slip: a one-at-a-time unwind hands one job up to this many of the next compensations
    # (auto-approved, ready to run) behind the first, run by one worker in LIFO order (0: off).
    slip: int = Field(default=50, ge=0, le=1000)
    on_failure: Literal["halt", "continue"] = "halt"
    retention_completed: int = Field(default=86_400, ge=1)
    retention_compensated: int = Field(default=7 * 86_400, ge=1)
    retention_attention: int = Field(default=30 * 86_400, ge=1)
    idle_ttl: int = Field(default=7 * 86_400, ge=1)
    # Seconds a running workflow with a started, unsettled step may go without any event before
    # the coordinator fails it ("its agent went away mid-call") and settles the step as in doubt.
    in_doubt_after: float = Field(default=3600.0, gt=0)
    outcomes_maxlen: int = Field(default=100_000, ge=100)
    dead_letter_maxlen: int = Field(default=100_000, ge=100)


class WorkerSettings(_Strict):
    # RQ workers per process, sharing one pool of warm sessions (see workers/process.py).
    concurrency: int = Field(default=4, ge=1, le=64)
    attempts: int = Field(default=5, ge=1, le=100)
    backoff_base: float = Field(default=1.0, ge=0)
    backoff_max: float = Field(default=60.0, ge=0)
    jitter: float = Field(default=0.5, ge=0, le=1)
    # Seconds a lease outlives a worker that stopped renewing it (it is renewed every third of this):
    # with `watchdog_after`, how soon the compensation of a worker that died is dispatched again.
    lease: float = Field(default=6.0, gt=0)
    # Slots of one process that may wait on one server (0: all but one, so a hung server never
    # takes the last slot); a job over the limit is deferred, not run (see workers/job.py).
    per_server: int = Field(default=0, ge=0, le=64)
    tools_ttl: float = Field(default=30.0, ge=0, description="seconds a server's tools/list is cached")
    job_timeout: int = Field(default=300, ge=1)

    def backoff(self, retry: int, spread: float = 0.0) -> float:
        """Seconds before retry number `retry` (0-based, over the compensation's budget).

        Exponential, bounded by `backoff_max`; `spread` in [-1, 1] places it within the jitter, so
        that compensations which failed together (a server that was down) do not return in one burst.
        """
        base = min(self.backoff_max, self.backoff_base * 2 ** max(0, retry))
        return max(0.0, base * (1 + self.jitter * spread))

    def retry_wait(self, retry: int) -> float:
        """The longest RQ may park retry number `retry`: the backoff at its jitter's top, plus the
        rounding to whole seconds and one scheduler poll. The coordinator counts silence only after this.
        """
        return self.backoff(retry, 1.0) + 1.5

    @property
    def slots_per_server(self) -> int:
        return min(self.per_server or max(1, self.concurrency - 1), self.concurrency)


class ConsoleSettings(_Strict):
    """`saga console`: where it listens and how much it reads per page.

    Credentials are never in the file: SAGA_CONSOLE_TOKEN (bearer) and SAGA_CONSOLE_USERS (basic).
    """

    # Loopback unless the operator decides otherwise (behind a TLS proxy, say).
    host: str = Field(default="127.0.0.1", min_length=1)
    port: int = Field(default=8780, ge=1, le=65535)
    # Let anyone who reaches the port look; acting always needs credentials.
    read_open: bool = False
    page_size: int = Field(default=50, ge=1, le=1000)
    # The newest N timeline entries a workflow page shows and draws.
    timeline_last: int = Field(default=500, ge=10, le=10_000)
    poll_seconds: float = Field(default=1.0, ge=0.2, le=60)
    # Seconds an action waits for the coordinator to apply it before the page says "pending".
    action_wait: float = Field(default=3.0, ge=0, le=30)


SessionPolicy = Literal["leave", "complete", "fail"]


class GatewaySettings(_Strict):
    """`saga gateway`: where it listens, how clients authenticate, what ends a workflow nobody ended."""

    host: str = "127.0.0.1"
    port: int = Field(default=8100, ge=0, le=65_535)
    # Name of the environment variable holding the bearer token (the token itself never sits in a file).
    # The HTTP side refuses to start without it unless `allow_anonymous` says so (loopback only).
    token_env: str = Field(default="SAGA_GATEWAY_TOKEN", pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
    allow_anonymous: bool = False
    # `saga_fail` / `saga_complete` tools offered to the agent next to the server's own.
    tools: bool = False
    # What to publish for a workflow whose session ends, or that goes idle, with no signal.
    on_session_end: SessionPolicy = "leave"
    on_idle: SessionPolicy = "leave"
    idle_timeout: float = Field(default=3600.0, gt=0, description="seconds without a call before on_idle applies")
    # A step whose XADD fails is retried this long before its workflow refuses further calls.
    publish_retry_for: float = Field(default=10.0, ge=0)
    # Write each call's intent (step-started) and have Redis acknowledge it before forwarding, so
    # that a call whose answer is lost is settled in the unwind; off saves that round trip per call.
    intents: bool = True
    # The HTTP side's event loop: uvloop's (libuv; about 13% less of the gateway's CPU per call, issue
    # 13) wherever uvloop exists (it is a dependency there), else asyncio's own.
    loop: Literal["asyncio", "uvloop"] = "asyncio" if sys.platform == "win32" else "uvloop"

    @model_validator(mode="after")
    def _anonymous_on_loopback(self) -> GatewaySettings:
        if self.allow_anonymous and self.host not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError("allow_anonymous is only allowed with a loopback host")
        return self


# A sentinel's address and a monitored primary's name, in the config and in redis+sentinel:// URLs alike.
SENTINEL_ADDRESS = re.compile(r"^(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):(?P<port>\d{1,5})$")
MASTER_NAME = r"^[A-Za-z0-9._-]{1,128}$"


class RedisSettings(_Strict):
    """Where the data lives: one Redis, or a Redis Cluster for events and state plus a standalone queue.

    `cluster = true` makes `REDIS_URL` (`--redis`) the address of any node of a Redis Cluster, which
    holds events, workflow state and indexes; RQ cannot run there (its scripts span slots), so the
    queue then lives on the standalone Redis at `queue_url`. `partitions` splits the streams and
    indexes (see schemas/keys.py); every process and publisher of a deployment must agree on it.

    `sentinels` + `master` are the config form of a `redis+sentinel://` URL (runtime/sentinel.py):
    every process then asks the sentinels for the current primary and follows a failover.
    `wait_replicas` > 0 makes publishers and the coordinator call WAIT after their writes and treat
    a write fewer replicas confirmed within `wait_timeout_ms` as not acknowledged (README "Failover");
    on a cluster, each primary a batch wrote to must confirm it (runtime/durability.py `Writes`).
    """

    # Run even though the server's maxmemory-policy may delete keys (see runtime/redis_checks.py).
    allow_eviction: bool = False
    cluster: bool = False
    # The RQ queue's Redis (standalone); unset: the queue shares REDIS_URL (not allowed with `cluster`).
    queue_url: str | None = None
    partitions: int = Field(default=1, ge=1, le=MAX_PARTITIONS)
    sentinels: list[str] = Field(default_factory=list)
    master: str | None = Field(default=None, pattern=MASTER_NAME)
    db: int = Field(default=0, ge=0, le=15)
    wait_replicas: int = Field(default=0, ge=0, le=16)
    wait_timeout_ms: int = Field(default=1000, ge=1, le=60_000)

    @field_validator("sentinels")
    @classmethod
    def _host_ports(cls, sentinels: list[str]) -> list[str]:
        for i, address in enumerate(sentinels):
            match = SENTINEL_ADDRESS.match(address)
            if not match or not 1 <= int(match["port"]) <= 65535:
                raise ValueError(f"entry {i} ({address!r}) is not host:port (a sentinel, e.g. '10.0.0.5:26379')")
        return sentinels

    @model_validator(mode="after")
    def _master_with_sentinels(self) -> RedisSettings:
        if self.sentinels and self.master is None:
            raise ValueError("sentinels are set but master is not: name the monitored primary (e.g. 'mymaster')")
        if self.master is not None and not self.sentinels:
            raise ValueError(f"master = {self.master!r} needs sentinels = ['host:port', ...] to ask for it")
        if self.cluster and self.sentinels:
            raise ValueError("cluster = true and sentinels: a Redis Cluster fails over by itself; keep one of them")
        return self

    @model_validator(mode="after")
    def _queue_off_cluster(self) -> RedisSettings:
        if self.cluster and self.queue_url is None:
            raise ValueError(
                "cluster = true needs queue_url: RQ does not run on Redis Cluster,"
                " so its queue lives on a standalone Redis"
            )
        if self.queue_url is not None and not self.queue_url.startswith(
            ("redis://", "rediss://", "unix://", "redis+sentinel://", "redis+sentinels://")
        ):
            raise ValueError(
                f"queue_url {self.queue_url!r} must be a redis://, rediss://, unix:// or redis+sentinel:// URL"
            )
        return self


class MetricsSettings(_Strict):
    """The Prometheus endpoint of each process (`/metrics`); off unless a port is given.

    Loopback by default: metrics name servers and operations, which an operator may not want on
    every interface. `token_env` names an environment variable holding a bearer token that scrapes
    must present (Prometheus `authorization: {credentials: ...}`).
    """

    port: int | None = Field(default=None, ge=1, le=65535)
    address: str = Field(default="127.0.0.1", min_length=1)
    token_env: str | None = Field(default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    # Seconds between two reads of the fleet-wide gauges (one process reads them; see runtime/metrics.py).
    fleet_interval: float = Field(default=15.0, ge=1, le=3600)

    def token(self) -> str | None:
        if self.token_env is None:
            return None
        value = os.environ.get(self.token_env)
        if not value:
            raise ConfigError(f"metrics.token_env names {self.token_env!r}, which is not set (or empty)")
        return value


class Config(_Strict):
    prefix: str = Field(default="saga", pattern=r"^[A-Za-z0-9_.-]{1,32}$")
    servers: dict[str, ServerConfig] = Field(default_factory=dict)
    policy: Policy = Field(default_factory=Policy)
    coordinator: CoordinatorSettings = Field(default_factory=CoordinatorSettings)
    worker: WorkerSettings = Field(default_factory=WorkerSettings)
    console: ConsoleSettings = Field(default_factory=ConsoleSettings)
    gateway: GatewaySettings = Field(default_factory=GatewaySettings)
    redis: RedisSettings = Field(default_factory=RedisSettings)

    @model_validator(mode="after")
    def _guarantees(self) -> Config:
        refusals, _ = guarantee_problems(self)
        if refusals:
            raise ValueError("; ".join(refusals))
        return self

    def warnings(self) -> list[str]:
        """Settings that keep every guarantee but trade one off; logged at start-up."""
        return guarantee_problems(self)[1]

    metrics: MetricsSettings = Field(default_factory=MetricsSettings)

    @field_validator("servers")
    @classmethod
    def _server_names(cls, servers: dict[str, ServerConfig]) -> dict[str, ServerConfig]:
        for name in servers:
            if not name.replace("-", "").replace("_", "").isalnum():
                raise ValueError(f"server name {name!r} may hold only letters, digits, '-' and '_'")
        return servers

    def refusals(self) -> list[tuple[str, str]]:
        """(field path, why) for every setting that could only ever be refused at run time.

        Not a denial in `policy.deny`: `deny = ["*"]` is the operator's emergency brake, and a
        brake that stops the coordinator from starting would be no brake at all.
        """
        found = []
        for name, server in self.servers.items():
            for tool, recovery in server.recovery.items():
                if (reason := recovery.unsupported_reason()) is not None:
                    field = "strategy" if recovery.compensating_operation is not None else "compensatingOperation"
                    found.append((f"servers.{name}.recovery.{tool}.{field}", f"{reason}: this overlay could never run"))
        for i, pattern in enumerate(self.policy.self_inverse):
            if ":" not in pattern:
                found.append(
                    (f"policy.self_inverse.{i}", f"{pattern!r} is not a server:tool pattern: it names nothing")
                )
        return found

    def declared_idempotent(self, server: str, tool: str) -> bool:
        """Whether the operator declared the tool idempotent under its forward key."""
        entry = self.servers.get(server)
        return entry is not None and tool in entry.idempotent

    def keys(self) -> Keys:
        """The key names of this deployment (prefix and partition count)."""
        return Keys(self.prefix, self.redis.partitions)

    def overlay(self, server: str, tool: str) -> Recovery | None:
        """The operator's recovery declaration for a tool, if any."""
        entry = self.servers.get(server)
        return entry.recovery.get(tool) if entry is not None else None


def guarantee_problems(config: Config) -> tuple[list[str], list[str]]:
    """(refusals, warnings): settings that defeat a README guarantee, and trade-offs to point out.

    Each names its field and why, for the operator who reads it at start-up.
    """
    c, w = config.coordinator, config.worker
    refusals: list[str] = []
    warnings: list[str] = []
    claim = c.claim_idle_ms / 1000 * 1.5  # idle time, plus up to one claim interval (half of it)
    if c.barrier_grace == 0:
        warnings.append(
            "coordinator.barrier_grace = 0: a failure that announces more steps than were recorded "
            "unwinds at once; a step still on its way is then undone after the ones before it"
        )
    elif c.barrier_grace <= claim:
        refusals.append(
            f"coordinator.barrier_grace ({c.barrier_grace:g} s) must be longer than claim_idle_ms plus the "
            f"claim interval ({claim:g} s): a step held by a coordinator that died would be claimed after "
            "the barrier expired, and undone out of LIFO order"
        )
    # A retry's backoff is not silence (the coordinator counts from the end of the longest wait RQ
    # may park it, `WorkerSettings.retry_wait`), so watchdog_after need not outlast backoff_max. What
    # it must outlast is a live worker's gap between taking a job from the queue and its lease.
    if c.watchdog_after < c.watchdog_every:
        warnings.append(
            f"coordinator.watchdog_after ({c.watchdog_after:g} s) is shorter than watchdog_every "
            f"({c.watchdog_every:g} s): silence is only looked for every watchdog_every seconds"
        )
    if w.lease < 1.5:
        warnings.append(
            f"worker.lease ({w.lease:g} s) is short: a worker stalled for two thirds of it (CPU starvation, "
            "a Redis blip during a renewal) loses its lease, and the watchdog may dispatch its compensation "
            "again while the call is still in flight (the idempotency key keeps the effect once)"
        )
    if c.in_doubt_after >= c.idle_ttl:
        warnings.append(
            f"coordinator.in_doubt_after ({c.in_doubt_after:g} s) must be shorter than coordinator.idle_ttl "
            f"({c.idle_ttl} s): a workflow whose agent died mid-call would expire before its in-doubt step is settled"
        )
    g = config.gateway
    if g.intents and g.on_idle == "complete" and g.idle_timeout >= c.in_doubt_after:
        warnings.append(
            f"gateway.idle_timeout ({g.idle_timeout:g} s) is not shorter than coordinator.in_doubt_after "
            f"({c.in_doubt_after:g} s): a quiet session with a call that never answered is failed and unwound "
            "by the coordinator before on_idle = complete applies"
        )
    slowest = max((s.timeout for s in config.servers.values()), default=0.0)
    if slowest and w.job_timeout <= slowest:
        refusals.append(
            f"worker.job_timeout ({w.job_timeout} s) must be longer than the longest server timeout "
            f"({slowest:g} s): RQ would kill the job during the call, and the attempt would go unreported"
        )
    if slowest and w.lease < slowest:
        warnings.append(
            f"worker.lease ({w.lease:g} s) is shorter than the longest server timeout ({slowest:g} s): a call "
            "in flight keeps its lease only through the worker's heartbeat; a stalled worker loses it sooner"
        )
    return refusals, warnings


def load_config(path: str | os.PathLike[str] | None = None) -> Config:
    """Load `path`, else `$SAGA_CONFIG`, else the defaults (no servers: a coordinator needs none)."""
    path = path or os.environ.get("SAGA_CONFIG")
    if not path:
        return Config()
    source = Path(path)
    try:
        data = tomllib.loads(source.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{source}: no such config file") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: not valid TOML: {exc}") from None
    return parse_config(data, source=str(source))


def parse_config(data: dict[str, Any], *, source: str = "config") -> Config:
    try:
        config = Config.model_validate(data)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err["loc"]) or "(top level)"
            message = err["msg"].removeprefix("Value error, ")
            if err["type"] == "extra_forbidden":
                message = "unknown field"
            lines.append(f"{source}: {where}: {message}")
        raise ConfigError("\n".join(lines)) from None
    if refusals := config.refusals():
        raise ConfigError("\n".join(f"{source}: {where}: {why}" for where, why in refusals))
    return config


def dump_config(config: Config) -> str:
    """The TOML text of a config: what `saga demo`, the tests and the benchmarks write for their processes.

    Only the fields that differ from the defaults, so the file reads like one a person wrote;
    `load_config` of the result gives back an equal `Config`.
    """
    data = config.model_dump(mode="json", by_alias=True, exclude_defaults=True, exclude_none=True)
    return tomli_w.dumps(data)


def write_config(config: Config, path: str | os.PathLike[str]) -> Path:
    target = Path(path)
    target.write_text(dump_config(config))
    return target
