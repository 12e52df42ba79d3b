"""Model errors and how to classify them: retryable, how long to wait, context overflow.

A client raises `ModelError` with what the provider said (HTTP status, error code,
Retry-After); the helpers also understand plain Python errors (timeouts, dropped
connections), so a custom client that raises those still gets retries.
"""

import email.utils
import re
from collections.abc import Mapping
from typing import Any, Literal

from tether.ports import SYSTEM_CLOCK

ErrorKind = Literal["rate_limit", "server", "timeout", "connection", "context_overflow",
                    "bad_request", "auth", "not_found", "malformed_response", "unknown"]

RETRYABLE_KINDS: frozenset[str] = frozenset({"rate_limit", "server", "timeout", "connection"})
RETRYABLE_STATUSES: frozenset[int] = frozenset({408, 409, 425, 429})

_OVERFLOW_CODES = frozenset({"context_length_exceeded", "context_window_exceeded",
                             "string_above_max_length", "prompt_too_long"})
_OVERFLOW_TEXT = re.compile(
    r"context (length|window)|maximum context|prompt is too long|too many tokens|"
    r"token limit|exceeds the (model's )?(maximum|max) (input|context)", re.IGNORECASE)


class ModelError(Exception):
    """A failed model call, with what is known about why.

    `retryable` overrides the classification by kind and status when a client knows
    better (e.g. a provider's `overloaded` error with status 400).
    """

    def __init__(self, message: str, *, kind: ErrorKind = "unknown", status: int | None = None,
                 code: str | None = None, retry_after_ms: int | None = None,
                 provider: str | None = None, request_id: str | None = None,
                 retryable: bool | None = None, body: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.kind: ErrorKind = kind
        self.status = status
        self.code = code
        self.retry_after_ms = retry_after_ms
        self.provider = provider
        self.request_id = request_id
        self.retryable = retryable
        self.body = body

    def details(self) -> dict[str, Any]:
        """The gateway's error details, as a run record keeps them (JSON, no traceback)."""
        found = {"kind": self.kind, "message": self.message, "status": self.status,
                 "code": self.code, "retry_after_ms": self.retry_after_ms,
                 "provider": self.provider, "request_id": self.request_id}
        return {key: value for key, value in found.items() if value is not None}


def kind_for_status(status: int, code: str | None = None, message: str = "") -> ErrorKind:
    if (code in _OVERFLOW_CODES) or (status in (400, 413) and _OVERFLOW_TEXT.search(message)):
        return "context_overflow"
    if status == 429:
        return "rate_limit"
    if status in (401, 403):
        return "auth"
    if status == 404:
        return "not_found"
    if status == 408:
        return "timeout"
    if status >= 500:
        return "server"
    return "bad_request"


def is_retryable(error: BaseException) -> bool:
    """Whether the same request may succeed if sent again later."""
    if isinstance(error, ModelError):
        if error.retryable is not None:
            return error.retryable
        if error.kind == "context_overflow":
            return False  # the same request overflows again
        return (error.kind in RETRYABLE_KINDS
                or (error.status is not None
                    and (error.status in RETRYABLE_STATUSES or error.status >= 500)))
    return isinstance(error, (TimeoutError, ConnectionError))


def retry_after_ms(error: BaseException) -> int | None:
    """How long the provider asked us to wait before retrying, if it said so."""
    if isinstance(error, ModelError):
        return error.retry_after_ms
    return None


def is_context_overflow(error: BaseException) -> bool:
    """Whether the request was too long for the model's context window."""
    if isinstance(error, ModelError):
        if error.kind == "context_overflow" or error.code in _OVERFLOW_CODES:
            return True
        if error.kind not in ("bad_request", "unknown"):
            return False
    return bool(_OVERFLOW_TEXT.search(str(error)))


def parse_retry_after(headers: Mapping[str, str], now_s: float | None = None) -> int | None:
    """Milliseconds from `retry-after-ms`, or `Retry-After` (seconds or an HTTP date)."""
    lowered = {key.lower(): value for key, value in headers.items()}
    if (value := lowered.get("retry-after-ms")) is not None:
        try:
            return max(0, int(float(value)))
        except ValueError:
            pass
    value = lowered.get("retry-after")
    if value is None:
        return None
    try:
        return max(0, int(float(value) * 1000))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    now_s = SYSTEM_CLOCK.now() / 1000 if now_s is None else now_s
    return max(0, int((when.timestamp() - now_s) * 1000))


def describe(error: BaseException) -> str:
    """One line for a run record: the type and message, never a traceback."""
    if isinstance(error, ModelError):
        return error.message
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
