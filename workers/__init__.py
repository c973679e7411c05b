"""Workers: perform compensations over MCP, one RQ job each, with warm sessions and the trust policy."""

from workers.job import RetryableFailure, compensate, set_context
from workers.process import run_worker
from workers.sessions import CallTimeout, SessionError, SessionPool, TransportError
from workers.trust import Refusal, check

__all__ = [
    "CallTimeout",
    "Refusal",
    "RetryableFailure",
    "SessionError",
    "SessionPool",
    "TransportError",
    "check",
    "compensate",
    "run_worker",
    "set_context",
]
