"""structlog, configured once per process: JSON lines unless on a terminal."""

import logging
import sys

import structlog

_configured = False


def configure_logging(level: str = "info", fmt: str = "auto") -> None:
    global _configured
    if _configured:
        return
    _configured = True
    render_json = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
    renderer = (structlog.processors.JSONRenderer() if render_json
                else structlog.dev.ConsoleRenderer(colors=False))
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            getattr(logging, level.upper(), logging.INFO)
        ),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )


def get_logger(**bound: object) -> structlog.typing.FilteringBoundLogger:
    return structlog.get_logger().bind(**bound)
