"""Old name of the test helpers; the code lives in `saga.procs` (and `processes` for tests)."""

from saga.procs import *  # noqa: F403
from saga.procs import REPO, free_port, start_http_server, start_http_servers, stdio_params, stop  # noqa: F401
