"""Logging: the services' structured lines, and the library's lines inside an application.

The services and the CLI call `configure_logging`: structlog renders one JSON line per
record (or a readable one on a terminal) to stderr. An application that imports Tether
and configures nothing gets the library's records through the standard `logging` module
under the `tether` logger, so they follow the application's handlers and levels (with no
handler at all, Python prints warnings and errors to stderr and drops the rest); one that
configured structlog itself gets them through its structlog configuration. Either can ask
for the services' rendering instead by calling `configure_logging`.
"""

import logging
import sys

import structlog

LIBRARY_LOGGER = "tether"

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
    # The libraries' own records (nats-py, asyncio, uvicorn), as lines of the same kind.
    root = logging.getLogger()
    root.addHandler(_OneLine())
    root.setLevel(logging.WARNING)


class _OneLine(logging.Handler):
    """A library's log record as one structured line: its logger, its message and the
    exception it carries in a word (`error`), without the traceback that would take
    dozens of lines for what one says. A record a library repeats (asyncpg retrying a
    pool's connections while Postgres is away) is said once a minute."""

    REPEAT_S = 60.0

    def __init__(self) -> None:
        super().__init__()
        self._said: dict[tuple[str, str], float] = {}

    def emit(self, record: logging.LogRecord) -> None:
        key = (record.name, record.getMessage())
        if record.created - self._said.get(key, -self.REPEAT_S) < self.REPEAT_S:
            return
        self._said[key] = record.created
        fields: dict[str, object] = {"logger": record.name}
        if record.exc_info and record.exc_info[1] is not None:
            error = record.exc_info[1]
            fields["error"] = f"{type(error).__name__}: {error}"
        try:
            structlog.get_logger().log(record.levelno, record.getMessage(), **fields)
        except Exception:  # noqa: BLE001 - logging must not raise
            self.handleError(record)


def get_logger(**bound: object) -> structlog.typing.FilteringBoundLogger:
    if _configured or structlog.is_configured():
        return structlog.get_logger().bind(**bound)
    return _library_logger().bind(**bound)


def _library_logger() -> structlog.typing.FilteringBoundLogger:
    # The standard logger decides the level, so an application's `logging` settings
    # (basicConfig, dictConfig, a level on "tether") apply as to any other library.
    return structlog.wrap_logger(
        logging.getLogger(LIBRARY_LOGGER),
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.stdlib.filter_by_level,
            structlog.processors.format_exc_info,
            structlog.processors.KeyValueRenderer(key_order=["event"], sort_keys=True),
        ],
        wrapper_class=structlog.stdlib.BoundLogger,
    )
