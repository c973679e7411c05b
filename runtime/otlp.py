"""The OTLP/HTTP span exporter that `runtime/tracing.py` installs: the SDK's, with a faster encoding.

The SDK's exporter builds a protobuf message object per span, attribute and value and then
serializes them; for the worker's attempt span that came to about 45 us a span in the exporter's
thread, the largest part of what tracing cost a compensation (issue 17, Cost). `encode` writes
the same bytes directly: what the SDK writes, field by field in field-number order as protobuf
serializes them, for spans of the usual shape (no events, no links, nothing dropped, attribute
values that are strings, booleans, integers of 64 bits or floats), about 5 us a span. Any other
span is encoded by the SDK's own encoder and spliced in (a repeated field is the concatenation of
its elements), and the resource and scope of each group are the SDK's encoding too, once per
batch. Everything else is the SDK exporter's: its OTEL_EXPORTER_OTLP_* configuration, transport,
retries, compression and size limit. Imported only when tracing is on.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

from opentelemetry.exporter.otlp.proto.common._internal import _encode_instrumentation_scope, _encode_resource
from opentelemetry.exporter.otlp.proto.common._internal.trace_encoder import _encode_span
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExportResult
from opentelemetry.trace import StatusCode

_VARINTS = [bytes([n]) if n < 0x80 else bytes([(n & 0x7F) | 0x80, n >> 7]) for n in range(0x4000)]
_INT64 = range(-(2**63), 2**63)
_TIMES = struct.Struct("<BQBQ").pack  # start (field 7) and end (field 8), both fixed64
_DOUBLE = struct.Struct("<d").pack
# Span.flags (field 16, fixed32): "has is_remote", and "is remote" for a remote parent.
_FLAGS = {False: b"\x85\x01" + struct.pack("<I", 0x100), True: b"\x85\x01" + struct.pack("<I", 0x300)}
_UNSET = b"\x7a\x00"  # an empty Status (field 15): the SDK encodes the status of every span


def _varint(n: int) -> bytes:
    if n < 0x4000:
        return _VARINTS[n]
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field (a string, bytes, or an embedded message)."""
    return tag + _varint(len(payload)) + payload


class _Cache(dict[Any, bytes]):
    """Encodings of what recurs from span to span: attribute keys, span names with their kind."""

    def __init__(self, make: Any) -> None:
        super().__init__()
        self.make = make

    def __missing__(self, key: Any) -> bytes:
        if len(self) > 10_000:  # bounded: names and keys are few, but nothing here promises so
            self.clear()
        made = self[key] = self.make(key)
        return made


_keys = _Cache(lambda key: _field(b"\x0a", key.encode()))  # KeyValue.key (field 1)
_names = _Cache(lambda named: _field(b"\x2a", named[0].encode()) + b"\x30" + _varint(named[1] + 1))  # name, kind


def _value(value: Any) -> bytes | None:
    """An AnyValue other than a string (see `_span`), or None for a kind left to the SDK's encoder."""
    kind = type(value)
    if kind is bool:
        return b"\x10\x01" if value else b"\x10\x00"
    if kind is int and value in _INT64:
        return b"\x18" + _varint(value & 0xFFFF_FFFF_FFFF_FFFF)
    if kind is float:
        return b"\x21" + _DOUBLE(value)
    return None


def _span(span: ReadableSpan) -> bytes | None:
    """One Span message (without its tag), or None when its shape is the SDK encoder's business."""
    if span.events or span.links or span.dropped_attributes or not span.name:
        return None
    context, parent, start, end = span.context, span.parent, span.start_time, span.end_time
    if context is None or not start or not end:
        return None
    out = [b"\x0a\x10", context.trace_id.to_bytes(16, "big"), b"\x12\x08", context.span_id.to_bytes(8, "big")]
    if context.trace_state:
        out.append(_field(b"\x1a", ",".join(f"{k}={v}" for k, v in context.trace_state.items()).encode()))
    if parent is not None:
        out += (b"\x22\x08", parent.span_id.to_bytes(8, "big"))
    out += (_names[span.name, span.kind.value], _TIMES(0x39, start, 0x41, end))
    keys = _keys
    for key, value in span.attributes.items():
        if type(value) is str:  # most values: inline
            text = value.encode()
            encoded = b"\x0a" + _varint(len(text)) + text
        else:
            encoded = _value(value)
            if encoded is None:
                return None
        pair = keys[key] + b"\x12" + _varint(len(encoded)) + encoded
        out += (b"\x4a", _varint(len(pair)), pair)
    status = span.status
    if status is None:
        return None
    if status.status_code is StatusCode.UNSET and not status.description:
        out.append(_UNSET)
    else:
        body = (_field(b"\x12", status.description.encode()) if status.description else b"") + (
            b"\x18" + _varint(status.status_code.value) if status.status_code.value else b""
        )
        out.append(_field(b"\x7a", body))
    out.append(_FLAGS[parent is not None and parent.is_remote])
    return b"".join(out)


def encode(spans: Sequence[ReadableSpan]) -> bytes:
    """The ExportTraceServiceRequest of these spans, the bytes the SDK's encoder serializes to.

    Grouped as the SDK groups them: by resource, then by instrumentation scope, each in the
    order it first appears (a span of the same two objects as the span before it, the usual
    case, is not looked up: hashing a resource is not free)."""
    groups: dict[Any, dict[Any, list[bytes]]] = {}
    last: tuple[Any, Any, list[bytes]] = (None, None, [])
    for span in spans:
        try:
            encoded = _span(span)
        except (UnicodeEncodeError, OverflowError, AttributeError, TypeError):
            encoded = None
        if encoded is None:
            encoded = _encode_span(span).SerializePartialToString()
        resource, scope = span.resource, span.instrumentation_scope or None
        if resource is not last[0] or scope is not last[1]:
            last = (resource, scope, groups.setdefault(resource, {}).setdefault(scope, []))
        last[2].append(b"\x12" + _varint(len(encoded)) + encoded)
    request = []
    for resource, scopes in groups.items():
        body = [_field(b"\x0a", _encode_resource(resource).SerializePartialToString())]
        for scope, encoded_spans in scopes.items():
            scoped = [_field(b"\x0a", _encode_instrumentation_scope(scope).SerializePartialToString()), *encoded_spans]
            if scope is not None and scope.schema_url:
                scoped.append(_field(b"\x1a", scope.schema_url.encode()))
            body.append(_field(b"\x12", b"".join(scoped)))
        if resource.schema_url:
            body.append(_field(b"\x1a", resource.schema_url.encode()))
        request.append(_field(b"\x0a", b"".join(body)))
    return b"".join(request)


class SpanExporter(OTLPSpanExporter):
    """The SDK's OTLP/HTTP exporter, sending `encode`'s bytes.

    Its `export` is the SDK's (1.4x: `_client`, `_metrics`, `_max_request_size`) with the encoding
    swapped; an SDK whose exporter is built otherwise, a batch over the size limit, or a shut
    down exporter, goes to the SDK's own `export`, which then encodes, refuses and logs as it does.
    """

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        client, metrics, limit = (getattr(self, name, None) for name in ("_client", "_metrics", "_max_request_size"))
        if client is None or metrics is None or limit is None or getattr(self, "_shutdown", True):
            return super().export(spans)
        data = encode(spans)
        if 0 < limit < len(data):
            return super().export(spans)
        with metrics.export_operation(len(spans)) as result:
            sent = client.export(data)
            if not sent.success:
                result.error = sent.error
                result.error_attrs = (
                    {"http.response.status_code": sent.status_code} if sent.status_code is not None else None
                )
                return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS
