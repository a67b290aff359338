"""The gateway's spans (`gpumesh gateway --trace`; docs/tracing.md): one server span per request
on the inference routes, continuing the client's `traceparent`, handed on to the replica's node
in the request's own `traceparent`; the dispatcher's decisions (attempts, failures, backoffs,
ejections, holds) as its events.

Imported only with --trace: the proxy holds a RequestTracer or None, and with None nothing
here, nor opentelemetry, is loaded. RequestSpan is the dispatcher's DispatchTrace
(gateway/dispatch.py), which keeps the dispatcher itself free of opentelemetry.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from events.contract.messages import RouteEntry
from wire.tracing import extract, provider, replace_headers

from .router import Ejection
from .transport.base import UpstreamError

if TYPE_CHECKING:
    from .dispatch import DispatchError
    from .proxy import _Exchange


class RequestTracer:
    def __init__(self, tracer_provider: TracerProvider) -> None:
        self.provider = tracer_provider
        self._tracer = tracer_provider.get_tracer("gpumesh.gateway")

    @classmethod
    def configure(cls, *, console: bool = False) -> RequestTracer:
        """From the environment and `--trace-console` (wire/tracing.py, exporter_from_env)."""
        return cls(provider("gpumesh-gateway", console=console))

    def start(self, request: _Exchange) -> RequestSpan:
        """The request's span, begun before its cluster is resolved; its headers to the
        replica now carry the span as their `traceparent` (the client's, if any, is its
        parent)."""
        inbound = request.inbound
        span = self._tracer.start_span(
            f"{inbound.method} {request.path.split('?', 1)[0]}",
            context=extract(inbound.header),
            kind=SpanKind.SERVER,
            attributes={
                "gpumesh.model": request.cluster,  # the name asked for, before resolving
                "gpumesh.request_id": request.request_id,
                "http.request.method": inbound.method,
            },
        )
        request.headers = replace_headers(request.headers, span)
        return RequestSpan(span)

    def shutdown(self) -> None:
        """Export what is still buffered, then stop."""
        self.provider.shutdown()


class RequestSpan:
    """One request's span; what the dispatcher decided for it become its events."""

    __slots__ = ("span",)

    def __init__(self, span: Span) -> None:
        self.span = span

    # -- DispatchTrace ----------------------------------------------------------------------

    def attempt(self, route: RouteEntry, attempt: int) -> None:
        if attempt == 1:
            return  # the span's own attributes name the replica, or `attempt_failed` does
        self.span.add_event(
            "attempt",
            {
                "attempt": attempt,
                "replica": route.replica_id,
                "node": route.node_id,
                "epoch": route.epoch,
            },
        )

    def attempt_failed(self, route: RouteEntry, error: UpstreamError, attempt: int) -> None:
        self.span.add_event(
            "attempt_failed",
            {
                "attempt": attempt,
                "replica": route.replica_id,
                "node": route.node_id,
                "outcome": error.outcome,
                "reason": str(error),
            },
        )

    def backoff(self, delay_s: float, attempt: int) -> None:
        self.span.add_event("retry", {"next_attempt": attempt + 1, "backoff_s": delay_s})

    def ejected(self, ejection: Ejection) -> None:
        self.span.add_event(
            "ejection",
            {
                "replica": ejection.replica_id,
                "node": ejection.node_id,
                "epoch": ejection.epoch,
                "reason": ejection.reason,
                "failures": ejection.failures,
                "duration_s": ejection.duration_s,
            },
        )

    def hold(self, reason: str, limit_s: float) -> None:
        self.span.add_event("hold", {"reason": reason, "limit_s": limit_s})

    def hold_ended(self, reason: str, woken: bool) -> None:
        self.span.add_event(
            "hold_ended", {"reason": reason, "by": "table_change" if woken else "timeout"}
        )

    # -- the end ----------------------------------------------------------------------------

    def end(self, request: _Exchange, error: DispatchError | None) -> None:
        span = self.span
        route = request.route
        attributes: dict[str, Any] = {
            "gpumesh.cluster": request.label,
            "gpumesh.attempts": request.attempts,
            "http.response.status_code": request.status,
        }
        if route is not None:
            attributes["gpumesh.replica"] = route.replica_id
            attributes["gpumesh.node"] = route.node_id
            attributes["gpumesh.epoch"] = route.epoch
        span.set_attributes(attributes)
        if error is not None:
            span.set_attribute("error.type", error.code)
            span.add_event("refused", {"code": error.code, "reason": str(error)})
        if request.status >= 500:
            span.set_status(Status(StatusCode.ERROR, error.code if error else None))
        span.end()
