"""What the client's features (runs, timelines, hooks, chat, conversations) need of the
connection they run on.

`tether.client.connection.Tether` implements `Link`; each feature takes a `Link`, so no
feature imports the connection module, and the connection imports every feature without
a cycle.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js import api as js_api
from pydantic import BaseModel

from tether.adapters.event_log import EventLog
from tether.config import Settings
from tether.contract.subjects import Subjects
from tether.domain.events import ParentRef
from tether.ports import RunHistory, StoredEvent

Reply = TypeVar("Reply", bound=BaseModel)


class RunReads(Protocol):
    """A run's stored messages: straight from the stream, or, for an application in an
    account without JetStream, through the parent service (`tether.client.run_events`)."""

    async def read(self, subject: str, start_seq: int = 1) -> list[StoredEvent]:
        """The subject's stored messages from `start_seq`, in order, up to its end as of
        the request (later ones may be included)."""
        ...

    async def last_seq(self, subject: str) -> int:
        """The stream sequence of the subject's last message; 0 when it has none."""
        ...


@dataclass(frozen=True)
class AwaitTiming:
    """How a caller awaiting a run paces what it does while the run says nothing.

    Live delivery is at most once: after `live_idle_s` without a live event the run's
    subject is read again, in case its last event was lost on the way; each quiet read
    doubles the wait, up to `live_idle_max_s`, so a long run costs few reads, and a live
    event starts it over. A request no parent has taken after `presence_after_s` makes
    the caller look whether any parent service answers at all; one that expired is
    taken as never taken `expiry_grace_s` after its expiry (a parent that took it just
    in time has appended its first event by then). A run the parent accepted that is
    still not started `untaken_after_s` later makes it look whether any child-runner of
    its agent type answers at all. A run whose last message this client cannot decode
    (a newer Tether's event) and that says nothing more for `unreadable_last_s` ends the
    wait with `UnreadableOutcome`: that message may be its outcome."""

    live_idle_s: float = 1.0
    live_idle_max_s: float = 30.0
    presence_after_s: float = 2.0
    expiry_grace_s: float = 2.0
    untaken_after_s: float = 5.0
    unreadable_last_s: float = 10.0


class Link(Protocol):
    """One connection to one Tether installation, as its features use it."""

    nc: NATS
    settings: Settings
    subjects: Subjects
    log: EventLog
    js: JetStreamContext
    # The account has no JetStream of its own: stored messages are read through the
    # parent service (`tether.client.run_events`).
    served: bool
    run_reads: RunReads
    awaiting: AwaitTiming

    async def read_run(self, parent: ParentRef, run_id: str) -> RunHistory:
        """Every stored event of one run, and the state they fold to."""
        ...

    async def subscribe_live(self, subject: str, route: Callable[[Msg], Any]) -> Any:
        """Route the core messages on `subject` (a run's live events, its awaiter
        question) to `route`, until the returned subscription is unsubscribed."""
        ...

    def answer_present(self, msg: Msg) -> None:
        """Answer the reconciler's question whether an awaited run is still awaited."""
        ...

    async def publish_command(self, kind: str, command: Any, msg_id: str, *,
                              stored_at: int | None = None) -> js_api.PubAck:
        """A command on its per-parent subject of the commands stream. `stored_at`: the
        sequence an earlier publish of this same run request was stored at; a duplicate
        of that one is known to be ours."""
        ...

    async def parent_unavailable(self, parent: ParentRef) -> str | None:
        """Why no parent service would take `parent`'s commands now (none answers its
        queries), or None when one answers; asked at most once in a while per connection."""
        ...

    async def runners_unavailable(self, agent_type: str, probe: bytes) -> str | None:
        """Why no child-runner would take a run of `agent_type` now (none answers its
        runners' inspection, `probe`), or None: one answers, or this connection may not
        ask (an account of its own). Asked at most once in a while per agent type."""
        ...

    async def request(self, kind: str, query: Any, reply_model: type[Reply], *,
                      timeout: float | None = None, subject: str | None = None,
                      wait_when_limited: bool = False) -> Reply:
        """Core request/reply with the parent service; raises `ServiceUnavailable`,
        `NotPermitted`, `RateLimited` (unless `wait_when_limited`: then it asks again when
        the parent says it may) or `RequestFailed`."""
        ...
