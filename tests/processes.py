"""The process helpers the tests use: the same ones `saga demo`, the benchmarks and the chaos run use."""

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
