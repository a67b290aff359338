"""OpenTelemetry for the gateway and the node's front: the optional extra `gpumesh[tracing]`.

Imported only when a process runs with `--trace` (gateway/cli.py, nodeagent/cli.py): without
it no module of the request path imports opentelemetry, and a request costs one None check.
docs/tracing.md says what is traced and how the exporter is chosen:

- OTEL_TRACES_EXPORTER (`otlp`, `console` or `none`), when set, decides;
- else `--trace-console`: spans to stderr, one JSON object a line;
- else OTLP (opentelemetry-exporter-otlp, which reads OTEL_EXPORTER_OTLP_* itself), when it is
  installed; without it, the process refuses to start rather than trace into nothing.

Context crosses processes as W3C `traceparent` / `tracestate` headers only.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SpanExporter,
)
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from .errors import WireError

TRACE_HEADERS = frozenset({"traceparent", "tracestate"})
_W3C = TraceContextTextMapPropagator()


class TracingUnavailable(WireError):
    """`--trace` cannot be honoured as asked (an exporter that is not installed)."""


def _console_exporter() -> SpanExporter:
    return ConsoleSpanExporter(
        out=sys.stderr, formatter=lambda span: span.to_json(indent=None) + "\n"
    )


def _otlp_exporter() -> SpanExporter:
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # type: ignore[import-not-found,unused-ignore]
            OTLPSpanExporter,
        )
    except ImportError:
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (  # type: ignore[import-not-found,unused-ignore]
                OTLPSpanExporter,
            )
        except ImportError:
            raise TracingUnavailable(
                "the OTLP exporter is not installed: pip install opentelemetry-exporter-otlp "
                "(or give --trace-console, or OTEL_TRACES_EXPORTER=console)"
            ) from None
    exporter: SpanExporter = OTLPSpanExporter()
    return exporter


def exporter_from_env(console: bool) -> SpanExporter | None:
    """The exporter this process sends spans to (None: spans are made and dropped)."""
    chosen = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if chosen == "none":
        return None
    if chosen == "console" or (not chosen and console):
        return _console_exporter()
    if chosen not in ("", "otlp"):
        raise TracingUnavailable(f"OTEL_TRACES_EXPORTER={chosen!r}: expected otlp, console or none")
    return _otlp_exporter()


def provider(
    service: str, *, console: bool = False, exporter: SpanExporter | None = None
) -> TracerProvider:
    """A TracerProvider of its own (the global one is left alone) for `service`; its spans go
    to `exporter`, or to the one the environment and `console` choose (exporter_from_env)."""
    name = os.environ.get("OTEL_SERVICE_NAME") or service
    tracer_provider = TracerProvider(resource=Resource.create({"service.name": name}))
    chosen = exporter if exporter is not None else exporter_from_env(console)
    if chosen is not None:
        tracer_provider.add_span_processor(BatchSpanProcessor(chosen))
    return tracer_provider


def extract(header: Any) -> Context | None:
    """The client's trace context from its `traceparent` (and `tracestate`): `header(name)`
    returns a header's value or None. None when there is none, or it is malformed."""
    parent = header("traceparent")
    if not parent:
        return None
    carrier = {"traceparent": parent}
    if state := header("tracestate"):
        carrier["tracestate"] = state
    context = _W3C.extract(carrier)
    if not trace.get_current_span(context).get_span_context().is_valid:
        return None
    return context


def inject(span: Span) -> list[tuple[str, str]]:
    """`traceparent` (and `tracestate`) naming `span` as the parent of what the next hop does."""
    carrier: dict[str, str] = {}
    _W3C.inject(carrier, trace.set_span_in_context(span))
    return list(carrier.items())


def replace_headers(headers: Iterable[tuple[str, str]], span: Span) -> list[tuple[str, str]]:
    """`headers` with their trace context, if any, replaced by `span`'s."""
    kept = [(k, v) for k, v in headers if k.lower() not in TRACE_HEADERS]
    kept.extend(inject(span))
    return kept


class FrontTracer:
    """The node's fencing front's spans (nodeagent/fencing_front.py): one per request, a child
    of the gateway's when its `traceparent` came along, with the replica, its epoch and whether
    the front fenced it or passed it on."""

    def __init__(self, tracer_provider: TracerProvider) -> None:
        self.provider = tracer_provider
        self._tracer = tracer_provider.get_tracer("gpumesh.front")

    def start(self, header: Any, replica_id: str, epoch: int) -> FrontSpan:
        span = self._tracer.start_span(
            "front /replica",
            context=extract(header),
            kind=SpanKind.SERVER,
            attributes={"gpumesh.replica": replica_id, "gpumesh.epoch": epoch},
        )
        return FrontSpan(span)

    def shutdown(self) -> None:
        self.provider.shutdown()


class FrontSpan:
    __slots__ = ("_outcome", "span")

    def __init__(self, span: Span) -> None:
        self.span = span
        self._outcome = "passed"

    def headers(self, headers: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
        """The workload's request headers: its parent is this span."""
        return replace_headers(headers, self.span)

    def outcome(self, outcome: str, why: str) -> None:
        """The front did not pass the request on: fenced, unknown_replica; or the workload did
        not answer: connect_error, reset. An event with the reason."""
        self._outcome = outcome
        self.span.add_event(outcome, {"reason": why})

    def end(self, status: int) -> None:
        span = self.span
        outcome = self._outcome
        span.set_attributes(
            {
                "gpumesh.front.outcome": outcome,
                "gpumesh.fenced": outcome == "fenced",
                "http.response.status_code": status,
            }
        )
        if status >= 500 or status == 0:
            span.set_status(Status(StatusCode.ERROR, outcome))
        span.end()
