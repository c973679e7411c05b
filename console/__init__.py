"""`saga console`: a small server-rendered web application for operators of unwinding workflows.

It reads Redis only through `mcp_saga.runtime.reader.Reader` and acts only through
`mcp_saga.runtime.operators`, so what it shows and what it sends are what `saga inspect` shows and
`saga retry|resolve|skip|approve` send.
"""

from mcp_saga.console.app import create_app
from mcp_saga.console.auth import Credentials

__all__ = ["Credentials", "create_app"]
