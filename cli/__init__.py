"""The `saga` command: process entry points, operator commands, rendering and the demo (the top layer)."""
