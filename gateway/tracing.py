"""Tracing with OpenTelemetry: one span per request, child spans for the filters, the pick and the
upstream call, and the W3C ``traceparent`` of the upstream span sent to the backend.

Off by default (``tracing.enabled``); then a request carries no span and each hook is one
attribute test. The OTLP exporter is optional (``tracing.otlp_endpoint``, needs
``opentelemetry-exporter-otlp-proto-http``); tests hand in an in-memory exporter. A client's own
``traceparent`` is used as the parent only when ``tracing.trust_client_traceparent`` is set, and
only once the propagator has validated it; it is never forwarded as the client sent it.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Iterator

if TYPE_CHECKING:
    from .config import TracingConfig

_NULL = contextlib.nullcontext()


class RequestSpan:
    """The span of one request and the tracer that makes its children."""

    __slots__ = ("tracer", "span")

    def __init__(self, tracer: Any, span: Any):
        self.tracer = tracer
        self.span = span

    def child(self, name: str, **attributes: Any) -> Any:
        from opentelemetry import trace

        span = self.tracer.start_span(name, context=trace.set_span_in_context(self.span), attributes=_clean(attributes))
        return trace.use_span(span, end_on_exit=True)


class Tracing:
    """Built once from the config; ``start(...)`` opens a request's span (or returns None when off)."""

    def __init__(self, config: "TracingConfig", exporter: Any = None):
        self.enabled = config.enabled
        self.trust_client = config.trust_client_traceparent
        self.provider: Any = None
        self.tracer: Any = None
        if not self.enabled:
            return
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBasedTraceIdRatio

        self.provider = TracerProvider(resource=Resource.create({"service.name": config.service_name}), sampler=ParentBasedTraceIdRatio(config.sample_ratio))
        if exporter is not None:
            self.provider.add_span_processor(SimpleSpanProcessor(exporter))
        elif config.otlp_endpoint:
            self.provider.add_span_processor(BatchSpanProcessor(otlp_exporter(config.otlp_endpoint)))
        self.tracer = self.provider.get_tracer("lmdeploy-gateway")

    def start(self, method: str, route: str, headers: dict[bytes, bytes]) -> RequestSpan | None:
        if self.tracer is None:
            return None
        from opentelemetry.trace import SpanKind

        parent = None
        if self.trust_client and b"traceparent" in headers:
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

            carrier = {"traceparent": headers[b"traceparent"].decode("latin-1")}
            parent = TraceContextTextMapPropagator().extract(carrier)  # an invalid one yields no parent
        span = self.tracer.start_span(
            f"{method} {route}", context=parent, kind=SpanKind.SERVER, attributes={"http.request.method": method, "http.route": route}
        )
        return RequestSpan(self.tracer, span)

    def shutdown(self) -> None:
        if self.provider is not None:
            self.provider.shutdown()


def otlp_exporter(endpoint: str) -> Any:
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError:
        raise RuntimeError(
            "tracing.otlp_endpoint is set but the OTLP exporter is not installed: pip install opentelemetry-exporter-otlp-proto-http"
        ) from None
    return OTLPSpanExporter(endpoint=endpoint)


def child(ctx: Any, name: str, **attributes: Any) -> Any:
    """A child span of the request's span, as a context manager; a no-op when tracing is off."""
    span = ctx.span
    return _NULL if span is None else span.child(name, **attributes)


@contextlib.contextmanager
def upstream_call(ctx: Any, backend_id: str, headers: list[tuple[bytes, bytes]]) -> Iterator[list[tuple[bytes, bytes]]]:
    """The upstream call's span; yields the headers to send, with its ``traceparent`` added."""
    if ctx.span is None:
        yield headers
        return
    from opentelemetry import trace
    from opentelemetry.trace import SpanKind

    span = ctx.span.tracer.start_span("upstream", context=trace.set_span_in_context(ctx.span.span), kind=SpanKind.CLIENT, attributes={"gateway.backend": backend_id})
    sc = span.get_span_context()
    traceparent = f"00-{sc.trace_id:032x}-{sc.span_id:016x}-{int(sc.trace_flags):02x}".encode()
    with trace.use_span(span, end_on_exit=True):
        yield [*headers, (b"traceparent", traceparent)]


def finish(ctx: Any, status: int) -> None:
    if ctx.span is None:
        return
    from opentelemetry.trace import Status, StatusCode

    span = ctx.span.span
    span.set_attribute("http.response.status_code", status)
    for name, value in (("gateway.request_id", ctx.request_id), ("gateway.backend", ctx.backend), ("gateway.refusal", ctx.refusal), ("gen_ai.request.model", ctx.model)):
        if value:
            span.set_attribute(name, value)
    if status >= 500:
        span.set_status(Status(StatusCode.ERROR))
    span.end()


def _clean(attributes: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in attributes.items() if v is not None}
