"""The OTLP span exporter's own encoding (runtime/otlp.py): the SDK's bytes, sent the SDK's way."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from mcp_saga.runtime import otlp
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import (
    Link,
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    TraceState,
    set_span_in_context,
)


@pytest.fixture
def spans() -> list[ReadableSpan]:
    """Spans of every shape: the usual ones, and events, links, arrays, an empty name, two resources
    and three scopes (one with a schema URL), an error status, a remote parent with a trace state."""
    memory = InMemorySpanExporter()
    providers = [
        TracerProvider(resource=Resource.create({"service.name": "a"}, schema_url="https://example.com/1")),
        TracerProvider(resource=Resource.create({"service.name": "b"})),
    ]
    for provider in providers:
        provider.add_span_processor(SimpleSpanProcessor(memory))
    one, two = providers[0].get_tracer("one", "1.0", schema_url="https://example.com/s"), providers[0].get_tracer("two")
    three = providers[1].get_tracer("three")
    state = TraceState([("vendor", "x")])
    remote = set_span_in_context(NonRecordingSpan(SpanContext(0xAB << 100, 0xCD, True, TraceFlags(1), state)))
    values = {"text": "é", "yes": True, "negative": -5, "ratio": 1.5, "large": 2**62}
    with one.start_as_current_span("root", attributes=values) as root:
        with two.start_as_current_span("child", kind=SpanKind.SERVER) as child:
            child.add_event("event", {"n": 1})
        call = three.start_span("call", context=remote, kind=SpanKind.CLIENT, attributes={"list": [1, 2], "k": "v"})
        call.set_status(Status(StatusCode.ERROR, "boom"))
        call.end()
        linked = one.start_span("linked", links=[Link(root.get_span_context())])
        linked.set_status(Status(StatusCode.OK))
        linked.end()
        one.start_span("", attributes={"n": 3}).end()
    return list(memory.get_finished_spans())


def test_the_encoding_is_the_sdks_to_the_byte(spans: list[ReadableSpan]) -> None:
    assert otlp.encode(spans) == encode_spans(spans).SerializePartialToString()
    assert otlp.encode(spans[1:3]) == encode_spans(spans[1:3]).SerializePartialToString()


class _Collector(BaseHTTPRequestHandler):
    bodies: list[tuple[str, bytes]] = []
    status = 200

    def do_POST(self) -> None:
        self.bodies.append((self.path, self.rfile.read(int(self.headers.get("Content-Length", 0)))))
        self.send_response(self.status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *_: Any) -> None:
        pass


@pytest.fixture
def collector(monkeypatch: pytest.MonkeyPatch) -> Iterator[type[_Collector]]:
    class Collector(_Collector):
        bodies: list[tuple[str, bytes]] = []

    server = ThreadingHTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{server.server_port}")
    try:
        yield Collector
    finally:
        server.shutdown()
        server.server_close()


def test_the_exporter_posts_those_bytes_where_the_otel_variables_say(
    spans: list[ReadableSpan], collector: type[_Collector]
) -> None:
    exporter = otlp.SpanExporter()
    assert exporter.export(spans) is SpanExportResult.SUCCESS
    assert collector.bodies == [("/v1/traces", encode_spans(spans).SerializePartialToString())]
    collector.status = 400  # refused: not retried, and said
    assert exporter.export(spans) is SpanExportResult.FAILURE
    exporter.shutdown()
