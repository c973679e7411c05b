"""Durable state, idempotency and fault injection shared by the example servers.

Each server keeps one SQLite file (WAL, so that `read_state` can look while the server writes).
Every applied effect is appended to `effects`, which triggers keep append-only: tests and the
chaos run count effects there to prove that at-least-once delivery produced exactly-once effects.

Schema:
    holdings(id PK, kind, status, data JSON, created_at, updated_at)   current state per entity
    effects(seq PK, at, tool, holding, change, idempotency_key, arguments JSON)   append-only
    idempotency(tool, key, result JSON, at; PK (tool, key))   first result per key
    calls(tool PK, n)   calls seen per compensating tool, for --fail-first
"""

from __future__ import annotations

import json
import os
import random
import sqlite3
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mcp.server.mcpserver.exceptions import ToolError
from mcp_saga.runtime.failpoints import fail_point

DB_ENV = "SAGA_EXAMPLE_DB"
FAIL_RATE_ENV = "SAGA_EXAMPLE_FAIL_RATE"
FAIL_FIRST_ENV = "SAGA_EXAMPLE_FAIL_FIRST"
TRANSIENT_PREFIX = "transient failure injected"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS holdings (
    id TEXT PRIMARY KEY, kind TEXT NOT NULL, status TEXT NOT NULL, data TEXT NOT NULL,
    created_at REAL NOT NULL, updated_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS effects (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, at REAL NOT NULL, tool TEXT NOT NULL,
    holding TEXT NOT NULL, change TEXT NOT NULL, idempotency_key TEXT, arguments TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS idempotency (
    tool TEXT NOT NULL, key TEXT NOT NULL, result TEXT NOT NULL, at REAL NOT NULL,
    PRIMARY KEY (tool, key));
CREATE TABLE IF NOT EXISTS calls (tool TEXT PRIMARY KEY, n INTEGER NOT NULL);
CREATE TRIGGER IF NOT EXISTS effects_no_update BEFORE UPDATE ON effects
    BEGIN SELECT RAISE(ABORT, 'effects is append-only'); END;
CREATE TRIGGER IF NOT EXISTS effects_no_delete BEFORE DELETE ON effects
    BEGIN SELECT RAISE(ABORT, 'effects is append-only'); END;
"""


def db_path(server: str, explicit: str | os.PathLike[str] | None = None) -> Path:
    """Where `server` keeps its state: `--db`, else `$SAGA_EXAMPLE_DB`, else a temp file.

    The environment variable may name a directory, so that one setting serves all three servers
    and each still gets its own file.
    """
    chosen = explicit or os.environ.get(DB_ENV)
    if not chosen:
        return Path(tempfile.gettempdir()) / "mcp-saga-examples" / f"{server}.db"
    path = Path(chosen)
    return path / f"{server}.db" if path.is_dir() or str(chosen).endswith(os.sep) else path


@dataclass(frozen=True)
class Faults:
    """Transient failures for compensating tools, raised before anything is touched.

    `rate` is the share of calls that fail at random; `first` makes the first N calls of each
    tool fail, so that a test can say "fails twice, then succeeds".
    """

    rate: float = 0.0
    first: int = 0
    # Seconds each compensating call takes: a slow server (the failover tests keep an unwind in
    # flight with it), or with a huge value one that never answers (the trivial server's "hung
    # server" of the isolation and watchdog tests).
    delay: float = 0.0

    @classmethod
    def from_env(cls, rate: float | None = None, first: int | None = None, delay: float | None = None) -> Faults:
        return cls(
            rate=float(os.environ.get(FAIL_RATE_ENV, 0)) if rate is None else rate,
            first=int(os.environ.get(FAIL_FIRST_ENV, 0)) if first is None else first,
            delay=delay or 0.0,
        )

    def check(self, tool: str, call_number: int) -> None:
        if self.first and call_number <= self.first:
            raise ToolError(f"{TRANSIENT_PREFIX}: {tool} call {call_number} of the first {self.first}; retry")
        if self.rate and random.random() < self.rate:
            raise ToolError(f"{TRANSIENT_PREFIX}: {tool} (fail rate {self.rate}); retry")


class Tx:
    """One tool call's view of the open transaction; every change it makes lands in `effects`."""

    def __init__(self, conn: sqlite3.Connection, tool: str, key: str | None, arguments: dict[str, Any]):
        self.conn, self.tool, self.key, self.arguments = conn, tool, key, arguments

    def create(self, kind: str, data: dict[str, Any], *, prefix: str, status: str) -> str:
        holding = f"{prefix}-{uuid.uuid4().hex[:12].upper()}"
        now = time.time()
        self.conn.execute(
            "INSERT INTO holdings VALUES (?, ?, ?, ?, ?, ?)",
            (holding, kind, status, json.dumps(data), now, now),
        )
        self._record(holding, status, now)
        return holding

    def transition(self, kind: str, holding: str, *, allowed_from: str, to: str) -> dict[str, Any]:
        """Move one holding on; refuse, naming why, when it is unknown or already moved."""
        row = self.conn.execute(
            "SELECT status, data FROM holdings WHERE id = ? AND kind = ?", (holding, kind)
        ).fetchone()
        if row is None:
            raise ToolError(f"unknown {kind} {holding!r}")
        if row[0] != allowed_from:
            raise ToolError(f"{kind} {holding!r} is already {row[0]}")
        now = time.time()
        self.conn.execute("UPDATE holdings SET status = ?, updated_at = ? WHERE id = ?", (to, now, holding))
        self._record(holding, to, now)
        return json.loads(row[1])

    def holdings_where(self, kind: str, field: str, value: str, status: str) -> list[str]:
        """Ids of the `kind` holdings in `status` whose data has `field` = `value` (e.g. an order's charges)."""
        rows = self.conn.execute(
            "SELECT id FROM holdings WHERE kind = ? AND status = ? AND json_extract(data, '$.' || ?) = ?",
            (kind, status, field, value),
        ).fetchall()
        return [row[0] for row in rows]

    def _record(self, holding: str, change: str, at: float) -> None:
        self.conn.execute(
            "INSERT INTO effects (at, tool, holding, change, idempotency_key, arguments) VALUES (?, ?, ?, ?, ?, ?)",
            (at, self.tool, holding, change, self.key, json.dumps(self.arguments)),
        )


class Ledger:
    """A server's state file; `apply` is the one way tools change it."""

    def __init__(self, path: str | os.PathLike[str], *, faults: Faults | None = None):
        self.path = Path(path)
        self.faults = faults or Faults()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with closing(self._connect()) as conn:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.executescript(_SCHEMA)

    def apply(
        self,
        tool: str,
        key: str | None,
        arguments: dict[str, Any],
        effect: Callable[[Tx], dict[str, Any]],
        *,
        compensating: bool = False,
    ) -> dict[str, Any]:
        """Run `effect` once per idempotency key and return its result (the first one, on repeats).

        The key lookup, the effect and the stored result share one write transaction, so
        concurrent calls with one key, even from several server processes, apply once. A refusal
        (`ToolError`) stores nothing, so the key can be retried.
        """
        if compensating:
            self.faults.check(tool, self._count_call(tool) if self.faults.first else 0)
            if self.faults.delay:  # sync tools run in a worker thread: other calls go on meanwhile
                time.sleep(self.faults.delay)
        with self._transaction() as conn:
            if key is not None:
                row = conn.execute("SELECT result FROM idempotency WHERE tool = ? AND key = ?", (tool, key)).fetchone()
                if row is not None:
                    return json.loads(row[0])
            result = effect(Tx(conn, tool, key, arguments))
            if key is not None:
                stored = (tool, key, json.dumps(result), time.time())
                conn.execute("INSERT INTO idempotency VALUES (?, ?, ?, ?)", stored)
        if not compensating:  # the effect landed; an armed fault loses (or delays) the answer
            fail_point("example.after-commit")
        return result

    def state(self) -> dict[str, Any]:
        return read_state(self.path)

    def _count_call(self, tool: str) -> int:
        with self._transaction() as conn:
            conn.execute("INSERT INTO calls VALUES (?, 1) ON CONFLICT (tool) DO UPDATE SET n = n + 1", (tool,))
            return conn.execute("SELECT n FROM calls WHERE tool = ?", (tool,)).fetchone()[0]

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, timeout=30, isolation_level=None, check_same_thread=False)
        conn.execute("PRAGMA synchronous=NORMAL")
        return conn

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with closing(self._connect()) as conn:
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")


def read_state(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A read-only snapshot: holdings, a count per kind and status, and the full effect ledger.

    Returns {"holdings": [{id, kind, status, data, createdAt, updatedAt}],
    "summary": {kind: {status: count}}, "effects": [{seq, at, tool, holding, change,
    idempotencyKey, arguments}]}.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no example ledger at {path}")
    with closing(sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)) as conn:
        conn.row_factory = sqlite3.Row
        holdings = _rows(
            conn,
            "SELECT id, kind, status, data, created_at AS createdAt, updated_at AS updatedAt"
            " FROM holdings ORDER BY created_at, id",
            decode="data",
        )
        effects = _rows(
            conn,
            "SELECT seq, at, tool, holding, change, idempotency_key AS idempotencyKey, arguments"
            " FROM effects ORDER BY seq",
            decode="arguments",
        )
    summary: dict[str, dict[str, int]] = {}
    for holding in holdings:
        by_status = summary.setdefault(holding["kind"], {})
        by_status[holding["status"]] = by_status.get(holding["status"], 0) + 1
    return {"holdings": holdings, "summary": summary, "effects": effects}


def _rows(conn: sqlite3.Connection, sql: str, *, decode: str) -> list[dict[str, Any]]:
    return [{**row, decode: json.loads(row[decode])} for row in map(dict, conn.execute(sql))]
