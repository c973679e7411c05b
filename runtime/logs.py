"""Structured logs: one JSON object per line, naming the workflow and step a line concerns.

`log = get_logger("coordinator")`, then `log.info("dispatched", workflow="order-42", step="pay")`.
JSON lines because operators ship them to a log store and filter by `workflow`; `SAGA_LOG=text`
gives plain lines for a terminal. A line that names a workflow also names its OpenTelemetry
`trace_id` once one of its events or jobs carried a trace context, so a log search leads to the trace.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Any

from mcp_saga.runtime.tracing import trace_id


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": f"{record.created:.3f}",
            "level": record.levelname.lower(),
            "component": record.name.removeprefix("saga."),
            "msg": record.getMessage(),
        }
        entry.update(getattr(record, "fields", {}))
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class _TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields = " ".join(f"{k}={v}" for k, v in getattr(record, "fields", {}).items())
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
        text = f"{stamp} {record.levelname.lower():7} {record.name.removeprefix('saga.')}: {record.getMessage()}"
        text = f"{text} {fields}" if fields else text
        return f"{text}\n{self.formatException(record.exc_info)}" if record.exc_info else text


class Logger:
    """A thin wrapper so call sites pass fields as keywords."""

    def __init__(self, name: str) -> None:
        self._log = logging.getLogger(f"saga.{name}")

    def _emit(self, level: int, msg: str, exc_info: bool, fields: dict[str, Any]) -> None:
        if self._log.isEnabledFor(level):
            clean = {k: v for k, v in fields.items() if v is not None}
            workflow = clean.get("workflow")
            # The workflow's trace, as last seen on one of its events or jobs (runtime/tracing.py).
            if isinstance(workflow, str) and "trace_id" not in clean and (known := trace_id(workflow)):
                clean["trace_id"] = known
            self._log.log(level, msg, extra={"fields": clean}, exc_info=exc_info)

    def debug(self, msg: str, **fields: Any) -> None:
        self._emit(logging.DEBUG, msg, False, fields)

    def info(self, msg: str, **fields: Any) -> None:
        self._emit(logging.INFO, msg, False, fields)

    def warning(self, msg: str, **fields: Any) -> None:
        self._emit(logging.WARNING, msg, False, fields)

    def error(self, msg: str, *, exc_info: bool = False, **fields: Any) -> None:
        self._emit(logging.ERROR, msg, exc_info, fields)


def get_logger(name: str) -> Logger:
    return Logger(name)


def configure(level: str | None = None) -> None:
    """Route `saga.*` loggers to stderr; called once by each process entry point."""
    root = logging.getLogger("saga")
    root.handlers.clear()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_TextFormatter() if os.environ.get("SAGA_LOG") == "text" else _JsonFormatter())
    root.addHandler(handler)
    root.setLevel((level or os.environ.get("SAGA_LOG_LEVEL", "INFO")).upper())
    root.propagate = False
