"""The process helpers the tests use: the same ones `saga demo`, the benchmarks and the chaos run use."""

from pathlib import Path

from mcp_saga.cli.procs import (  # noqa: F401 - re-exported for the tests
    REPO,
    free_port,
    saga_process,
    start_http_server,
    start_http_servers,
    stdio_params,
    stop,
    stop_all,
    wait_for,
    wait_until_accepting,
)


def log_tails(*logs: Path, size: int = 3000) -> str:
    """The ends of processes' logs, for a failure message that says what they were doing."""
    return "\n".join(f"--- {log.name}\n{log.read_text(errors='replace')[-size:]}" for log in logs if log.exists())
