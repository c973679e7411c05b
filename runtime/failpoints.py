"""Named fault-injection points, in the style of fail-rs and gofail, for the crash and chaos tests.

A point is a call `fail_point("worker.after-call")` at a place where a real process can die; it
does nothing unless the environment arms it:

    SAGA_FAILPOINTS="worker.after-call=kill;coordinator.after-commit=exit(70)"

Actions: `off`, `exit(N)` (leave at once with status N, no clean-up), `kill` (SIGKILL itself),
`stop` (SIGSTOP itself: a stalled process, resumed by whoever sent SIGCONT), `sleep(MS)`,
`raise` (raise `FailPointError`); `N*action` fires N times, then the point is off again. The
armed set is read once per process, so an unarmed point costs one dict lookup.
"""

from __future__ import annotations

import os
import re
import signal
import time
from dataclasses import dataclass

FAILPOINTS_ENV = "SAGA_FAILPOINTS"

# Every point in the code base, with where it stands. A name not listed here is refused when armed,
# so a typo in a test's environment fails loudly instead of testing nothing.
POINTS: dict[str, str] = {
    "coordinator.after-commit": "a batch's transitions are committed; nothing dispatched or acknowledged yet",
    "worker.after-call": "a compensating call returned; its report is not written yet",
    "worker.after-dequeue": "RQ moved a job out of the queue's list; it is not marked started yet",
    "worker.scheduler-spawned": "the worker spawned its scheduler child; RQ has not installed its signal handlers yet",
    "example.after-commit": "an example server committed a forward call's effect; its answer is not sent yet",
}

# The first crash hooks, kept working: each variable set to "1" arms one point.
LEGACY: dict[str, str] = {
    "SAGA_TEST_CRASH_AFTER_COMMIT": "coordinator.after-commit=exit(70)",
    "SAGA_TEST_CRASH_AFTER_CALL": "worker.after-call=kill",
}

_ACTION = re.compile(r"^(?:(\d+)\*)?(off|kill|stop|raise|exit\((\d+)\)|sleep\((\d+)\))$")


class FailPointError(RuntimeError):
    """Raised by a point armed with `raise`."""


@dataclass
class _Armed:
    action: str
    argument: int
    remaining: int | None


def parse(spec: str) -> dict[str, _Armed]:
    """`name=action;name=action` -> armed points; a malformed spec or an unknown name raises ValueError."""
    armed: dict[str, _Armed] = {}
    for item in filter(None, (part.strip() for part in spec.split(";"))):
        name, _, action = item.partition("=")
        name = name.strip()
        if name not in POINTS:
            raise ValueError(f"{FAILPOINTS_ENV}: unknown fail point {name!r} (known: {', '.join(POINTS)})")
        match = _ACTION.match(action.strip())
        if match is None:
            raise ValueError(f"{FAILPOINTS_ENV}: {name}: cannot read action {action!r}")
        count, verb, code, ms = match.groups()
        verb = verb.split("(")[0]
        if verb != "off":
            armed[name] = _Armed(verb, int(code or ms or 0), int(count) if count else None)
    return armed


def _from_environment() -> dict[str, _Armed]:
    specs = [spec for variable, spec in LEGACY.items() if os.environ.get(variable) == "1"]
    specs.append(os.environ.get(FAILPOINTS_ENV, ""))
    return parse(";".join(specs))


_armed = _from_environment()


def fail_point(name: str) -> None:
    """Do what the environment armed this point to do, if anything."""
    point = _armed.get(name)
    if point is None:
        return
    if point.remaining is not None:
        point.remaining -= 1
        if point.remaining <= 0:
            del _armed[name]
    if point.action == "exit":
        os._exit(point.argument)
    elif point.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif point.action == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif point.action == "sleep":
        time.sleep(point.argument / 1000)
    elif point.action == "raise":
        raise FailPointError(f"fail point {name}")


def arm(spec: str) -> None:
    """Arm points in this process (in-process tests); `name=off` disarms one."""
    for item in filter(None, (part.strip() for part in spec.split(";"))):
        _armed.pop(item.partition("=")[0].strip(), None)
    _armed.update(parse(spec))
