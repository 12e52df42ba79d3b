"""OpenTelemetry traces of runs, across processes (the `otel` extra; docs/tracing.md).

One trace per run: the application's request (`invoke_agent <agent>`, a client span), the
parent service's handling of the command, the child's run in a runner (`invoke_agent
<agent>`), its tool calls (`execute_tool <tool>`) and model calls (`chat <model>`), the
finish hook's publication and the application's hook handler. The context goes from one
process to the next in the W3C `traceparent` (and `tracestate`) headers of the NATS
messages between them: commands, work items, run events, hooks.

Off unless the `otel` extra is installed and the standard variables ask for it
(`OTEL_TRACES_EXPORTER`, `OTEL_EXPORTER_OTLP_ENDPOINT`, `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`;
`OTEL_SDK_DISABLED=true` wins), or an application set its own tracer provider. While off,
`ENABLED` is False and nothing of this module runs: every caller checks it first, so a
hot path builds no header and no span.
"""

import os
import sys
from collections.abc import Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from typing import Any

from tether.log import get_logger

ENABLED = False
INSTRUMENTATION = "tether"
# Span kinds by name, so callers need not import OpenTelemetry.
CLIENT, SERVER, PRODUCER, CONSUMER, INTERNAL = "client", "server", "producer", "consumer", \
    "internal"

_tracer: Any = None
_provider: Any = None  # the provider this module made (and shuts down), if any


def requested_by_environment(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the OTEL_* variables ask for traces to be exported."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporters = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporters:
        return exporters != "none"
    return bool(environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
                or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


def configure(service_name: str, environ: Mapping[str, str] = os.environ) -> bool:
    """Turn tracing on as the environment asks; True when it is on.

    A tracer provider the application set itself is used as it is. Otherwise, when the
    variables ask for it, one is made with the exporters of `OTEL_TRACES_EXPORTER`
    (`otlp`, the default, over `OTEL_EXPORTER_OTLP_PROTOCOL`; `console`; any other
    exporter installed under its OpenTelemetry entry point name), behind a batch
    processor, for the resource `OTEL_SERVICE_NAME` and `OTEL_RESOURCE_ATTRIBUTES` say
    (`service_name` when they name none).
    """
    global _provider
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return ENABLED
    if "opentelemetry.trace" not in sys.modules and not requested_by_environment(environ):
        return ENABLED  # no provider can have been set, and none is asked for: no import
    try:
        from opentelemetry import trace
    except ImportError:
        if requested_by_environment(environ):
            _warn("tracing.unavailable", reason="the otel extra is not installed "
                  "(pip install 'tether[otel]')")
        return ENABLED
    current = trace.get_tracer_provider()
    if not isinstance(current, trace.ProxyTracerProvider | trace.NoOpTracerProvider):
        use(current)  # the application's own
        return True
    if not requested_by_environment(environ):
        return ENABLED
    try:
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        _warn("tracing.unavailable", reason="opentelemetry-sdk is not installed "
              "(pip install 'tether[otel]')")
        return ENABLED
    attributes = {} if environ.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: service_name}
    provider = TracerProvider(resource=Resource.create(attributes))
    for exporter in _exporters(environ):
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    _provider = provider
    use(trace.get_tracer_provider())
    return True


def _exporters(environ: Mapping[str, str]) -> list[Any]:
    from importlib.metadata import entry_points

    names = [name.strip().lower() for name in
             environ.get("OTEL_TRACES_EXPORTER", "otlp").split(",") if name.strip()]
    exporters = []
    for name in names:
        if name == "none":
            continue
        if name == "otlp":
            protocol = (environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                        or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf")
            name = "otlp_proto_grpc" if protocol.strip() == "grpc" else "otlp_proto_http"
        found = entry_points(group="opentelemetry_traces_exporter", name=name)
        if not found:
            _warn("tracing.exporter_missing", exporter=name)
            continue
        exporters.append(next(iter(found)).load()())
    return exporters


def use(provider: Any) -> None:
    """Trace through `provider` (an OpenTelemetry `TracerProvider`), e.g. a test's with
    an in-memory exporter."""
    global ENABLED, _tracer
    _tracer = provider.get_tracer(INSTRUMENTATION)
    ENABLED = True


def disable() -> None:
    """Stop tracing."""
    global ENABLED, _tracer
    ENABLED, _tracer = False, None


def shutdown() -> None:
    """Stop tracing; the spans of a provider this module made are exported first."""
    global _provider
    disable()
    if _provider is not None:
        provider, _provider = _provider, None
        provider.shutdown()


def _warn(event: str, **fields: object) -> None:
    get_logger(component="tracing").warning(event, **fields)


# --- used only while ENABLED ------------------------------------------------------------

def inject(headers: MutableMapping[str, str]) -> MutableMapping[str, str]:
    """`headers` with the current context's `traceparent` (and `tracestate`) added."""
    from opentelemetry import propagate

    propagate.inject(headers)
    return headers


def _kind(kind: str) -> Any:
    from opentelemetry.trace import SpanKind

    return SpanKind[kind.upper()]


@contextmanager
def span(name: str, kind: str = INTERNAL, *, attributes: Mapping[str, Any] | None = None,
         carrier: Mapping[str, str] | None = None) -> Iterator[Any]:
    """A span made current for the block; its parent the current span, or the context
    in `carrier` (a received message's headers). An exception leaving the block is
    recorded on it with `error.type`, as the conventions ask."""
    from opentelemetry import propagate

    context = propagate.extract(carrier) if carrier is not None else None
    with _tracer.start_as_current_span(name, context=context, kind=_kind(kind),
                                       attributes=attributes, record_exception=True,
                                       set_status_on_exception=True) as current:
        try:
            yield current
        except BaseException as error:
            current.set_attribute("error.type", type(error).__qualname__)
            raise


def current_span() -> Any:
    from opentelemetry import trace

    return trace.get_current_span()


def invoke_agent_attributes(agent_type: str, run_id: str, parent: Any) -> dict[str, Any]:
    """The GenAI attributes of an agent invocation, and the run's own."""
    return {"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": agent_type,
            "gen_ai.provider.name": INSTRUMENTATION,
            "tether.run.id": run_id, "tether.parent": f"{parent.agent}/{parent.name}"}


def messaging_attributes(operation: str, subject: str, **more: Any) -> dict[str, Any]:
    """The messaging attributes of a NATS publish or of a received message's processing."""
    return {"messaging.system": "nats", "messaging.operation.name": operation,
            "messaging.operation.type": operation, "messaging.destination.name": subject,
            **more}
