"""`python -m mcp_saga.cli`: the `saga` command without its console script (processes started by tests)."""

import sys

from mcp_saga.cli.main import main

sys.exit(main())
