"""Two gateways' CPU per call at a 2 ms tool, driven by a raw-socket client: this tree's against another's.

    python -m bench.gateway_raw --base-python PATH [--calls 300] [--rounds 10] [--redis URL]

bench.gateway drives the gateway with the SDK's client, which spends a few milliseconds of CPU per
call on the same two cores as the gateway, the upstream and Redis. To compare two versions of
the gateway, this client writes each pre-built `tools/call` POST on one keep-alive socket (head
and body in two writes, as the SDK's httpx does) and reads the answer to its end, spending
little CPU of its own. Both gateways (this tree's, and `--base-python`'s: a venv with another
version installed) front the same upstream (bench.publisher's 2 ms tool) and Redis; rounds
alternate their order, and the figures are the medians and quartiles of the rounds' own ratios
(this / base) of the gateway process's CPU per call (schedstat, as bench.gateway) and of the
wall-clock per call. It is an A/B tool for the gateway's code, not the suite's row: the
overhead over a direct call is bench.gateway's.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench.gateway import cpu_ns, quartiles

PREFIX = "benchgwraw"


def _exchange(sock: socket.socket, port: int, body: bytes, session: str | None) -> tuple[dict[bytes, bytes], bytes]:
    """One POST to /mcp/bench and its whole answer (Content-Length or chunked): (headers, body)."""
    head = (
        f"POST /mcp/bench HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAccept: application/json, text/event-stream\r\n"
        f"Content-Type: application/json\r\nMcp-Protocol-Version: 2025-06-18\r\n"
        + (f"Mcp-Session-Id: {session}\r\n" if session else "")
        + f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    sock.sendall(head)
    sock.sendall(body)
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    raw, _, rest = data.partition(b"\r\n\r\n")
    headers = {
        name.lower(): value.strip() for name, _, value in (line.partition(b":") for line in raw.split(b"\r\n")[1:])
    }
    if b"content-length" in headers:
        while len(rest) < int(headers[b"content-length"]):
            rest += sock.recv(65536)
    elif headers.get(b"transfer-encoding") == b"chunked":
        while not rest.endswith(b"0\r\n\r\n"):
            rest += sock.recv(65536)
    return headers, rest


class Client:
    """One MCP session through one gateway, on one socket."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.sock = self._connect()
        hello = {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "raw", "version": "1"}}
        initialize = {"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": hello}
        headers, _ = _exchange(self.sock, port, json.dumps(initialize).encode(), None)
        self.session = headers[b"mcp-session-id"].decode()
        _exchange(self.sock, port, b'{"jsonrpc":"2.0","method":"notifications/initialized"}', self.session)

    def _connect(self) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def calls(self, n: int, workflow: str) -> None:
        from mcp_saga.schemas.events import WORKFLOW_META_KEY

        for i in range(n):
            params = {"name": "work", "arguments": {"n": i}, "_meta": {WORKFLOW_META_KEY: workflow}}
            body = json.dumps({"jsonrpc": "2.0", "id": i + 1, "method": "tools/call", "params": params}).encode()
            try:
                _, answer = _exchange(self.sock, self.port, body, self.session)
            except (BrokenPipeError, ConnectionResetError):  # the server closed the idle keep-alive connection
                self.sock.close()
                self.sock = self._connect()
                _, answer = _exchange(self.sock, self.port, body, self.session)
            if b'"result"' not in answer:
                raise RuntimeError(f"the call through the gateway failed: {answer[:300]!r}")


def _cpu_counter(pid: int) -> Callable[[], int]:
    return lambda: cpu_ns(pid)


def measure(redis_url: str, base_python: str, calls: int, rounds: int) -> dict[str, tuple[list[float], list[float]]]:
    """name ("this", "base") -> (seconds per call, gateway CPU seconds per call), one of each per round."""
    from mcp_saga.cli.procs import free_port, saga_process, start_http_server, stop, wait_until_accepting
    from mcp_saga.schemas.config import parse_config, write_config

    with start_http_server("bench.publisher", "--serve") as (_, upstream), tempfile.TemporaryDirectory() as tmp:
        processes: dict[str, subprocess.Popen[bytes]] = {}
        ports: dict[str, int] = {}
        try:
            for name in ("this", "base"):
                port = ports[name] = free_port()
                settings = {"servers": {"bench": {"url": upstream}}, "gateway": {"port": port, "allow_anonymous": True}}
                config = write_config(parse_config({"prefix": PREFIX, **settings}), Path(tmp) / f"{name}.toml")
                env = {"SAGA_LOG_LEVEL": "WARNING"}
                if name == "this":
                    processes[name] = saga_process("gateway", redis_url=redis_url, config=config, env=env)
                else:
                    environment = {**os.environ, "REDIS_URL": redis_url, "SAGA_CONFIG": str(config), **env}
                    command = [base_python, "-m", "mcp_saga.cli", "gateway"]
                    processes[name] = subprocess.Popen(command, cwd=tmp, env=environment, stdout=subprocess.DEVNULL)
                wait_until_accepting("127.0.0.1", port, processes[name])
            clients = {name: Client(port) for name, port in ports.items()}
            counters = {name: _cpu_counter(process.pid) for name, process in processes.items()}
            for client in clients.values():  # warm-up: sessions, connections, listings
                client.calls(calls // 3, "raw-warm")
            figures: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in clients}
            for round_no in range(rounds):
                for name in ("this", "base") if round_no % 2 == 0 else ("base", "this"):
                    before, start = counters[name](), time.perf_counter()
                    clients[name].calls(calls, f"raw-{round_no}")
                    figures[name][0].append((time.perf_counter() - start) / calls)
                    figures[name][1].append((counters[name]() - before) / 1e9 / calls)
            return figures
        finally:
            for process in processes.values():
                stop(process)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.gateway_raw", description=__doc__.splitlines()[0])
    parser.add_argument("--base-python", required=True, help="the interpreter of a venv with the other version")
    parser.add_argument("--calls", type=int, default=300, help="calls per round each way")
    parser.add_argument("--rounds", type=int, default=10, help="rounds (at least 7)")
    parser.add_argument("--redis", default=os.environ.get("REDIS_URL"), help="default: $REDIS_URL, else a private one")
    args = parser.parse_args(argv)
    if args.rounds < 7:
        parser.error("--rounds: at least 7, so the median and quartiles of the ratios mean something")
    from mcp_saga.cli.redis_server import resolve_redis

    load = os.getloadavg()[0]
    with resolve_redis(args.redis) as url:
        figures = measure(url, args.base_python, args.calls, args.rounds)
    print(f"{args.rounds} rounds of {args.calls} calls each way; load average {load:.2f} -> {os.getloadavg()[0]:.2f}")
    for name, (times, cpus) in figures.items():
        wall, cpu = statistics.median(times) * 1e6, statistics.median(cpus) * 1e6
        print(f"{name:6} {wall:8.0f} µs a call, gateway CPU {cpu:6.0f} µs a call (median rounds)")
    for label, index in (("time", 0), ("CPU", 1)):
        ratios = [a / b for a, b in zip(figures["this"][index], figures["base"][index], strict=True)]
        low, median, high = quartiles(ratios)
        print(f"this / base, {label}: median of rounds {median:.3f}, quartiles {low:.3f}-{high:.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])
