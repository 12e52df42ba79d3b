"""Errors a client raises; each message says what to check."""


class TetherError(Exception):
    """Base class of the client's own errors."""


class ServiceUnavailable(TetherError):
    """No Tether service answered: not running, another prefix, or the streams are missing."""


class RequestFailed(TetherError):
    """A service answered a request with an error."""


class RateLimited(RequestFailed):
    """The parent refused a query this connection's account asked too often; it may ask
    again after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class NotPermitted(TetherError):
    """The NATS server refused this connection's user: an application user may act only
    for the parent agents `tether.access` grants it."""


class InputTooLarge(TetherError, ValueError):
    """A run's input is over the size limit; nothing was sent."""


class MessageRefused(TetherError):
    """The parent did not record a steering message: the run takes none (it ended, is
    being cancelled, or is not there), or the message waited past its expiry. `code`
    says which (`not-running`, `no-such-run`, `expired`)."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


class RunNotFound(TetherError, LookupError):
    """The parent has no such run (a parent forks, rewinds and compares its own runs
    only); the message names the run and the parent."""


class UnreadableOutcome(TetherError):
    """An awaited run's last message is one this client cannot decode (an event of a newer
    Tether, or a damaged one), and nothing followed it: it may be the run's outcome. The
    run is not cancelled. `run_id`, `seq` (the message's stream sequence) and `reason`
    (why it does not decode) say which message."""

    def __init__(self, message: str, run_id: str, seq: int, reason: str) -> None:
        super().__init__(message)
        self.run_id = run_id
        self.seq = seq
        self.reason = reason
