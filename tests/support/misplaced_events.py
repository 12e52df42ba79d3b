"""Events stored where they do not belong, as a buggy client with publish rights (or a
hand-run `nats pub`) could store them; readers must apply none of them."""

from dataclasses import dataclass

from tether.contract.codec import encode_event
from tether.domain.events import ParentRef
from tether.testing import RunEvents


@dataclass(frozen=True)
class Misplaced:
    """The stream sequences of what `publish_misplaced` stored."""

    la_subject: str
    lc_subject: str
    liar: int  # run lb's `run.completed`, on run la's subject
    foreign: int  # another tenant's `run.requested` of lc, on this parent's lc subject
    garbage: int  # not JSON, on la's subject


async def publish_misplaced(log, parent: ParentRef, la: RunEvents, lb: RunEvents) -> Misplaced:
    la_subject = log.subjects.run_events(parent, la.run_id)
    lc_subject = log.subjects.run_events(parent, "lc")
    foreign = RunEvents("lc", ParentRef(agent="Victim", name="tenant-9"), id_prefix="f")
    liar = await log.jetstream.publish(la_subject, encode_event(lb.completed("completed by a liar")))
    foreign_ack = await log.jetstream.publish(lc_subject, encode_event(foreign.requested()))
    garbage = await log.jetstream.publish(la_subject, b"not json")
    return Misplaced(la_subject, lc_subject, liar.seq, foreign_ack.seq, garbage.seq)
