"""The client against a real NATS server: a call that cannot be answered says what it
waited for (a message no parent service recorded), a prefix whose services never started
is named as such by every call that reads a run, and bad arguments send nothing."""

import math
from collections.abc import AsyncIterator

import pytest

from tether.adapters.event_log import EventLog
from tether.client import ServiceUnavailable, Tether, connect
from tether.config import Settings
from tether.domain.events import ParentRef

PARENT = ParentRef(agent="Assistant", name="user-1")


@pytest.fixture
async def tether(log: EventLog, settings: Settings) -> AsyncIterator[Tether]:
    async with connect(settings=settings) as client:
        yield client


@pytest.fixture
async def without_streams(settings: Settings) -> AsyncIterator[Tether]:
    """A connection for a prefix whose services never started: it has no streams."""
    async with connect(settings=settings) as client:
        yield client


async def commands_stored(log: EventLog) -> int:
    info = await log.jetstream.stream_info(log.subjects.commands_stream)
    return info.state.messages


async def test_a_message_no_parent_records_times_out_saying_what_it_waited_for(log, tether):
    me = tether.parent(PARENT.agent, PARENT.name)
    with pytest.raises(TimeoutError) as waited:
        await me.send("r1", "hello", message_id="m1", timeout=0.5)
    text = str(waited.value)
    subjects = tether.subjects
    for named in ("'m1'", "'r1'", "0.5s", subjects.run_events(PARENT, "r1"),
                  subjects.commands_stream, repr(subjects.prefix)):
        assert named in text, text
    assert await commands_stored(log) == 1, "the message waits in the commands stream"


async def test_every_call_that_reads_a_run_names_the_missing_stream(without_streams):
    tether = without_streams
    me = tether.parent(PARENT.agent, PARENT.name)
    missing = (f"stream {tether.subjects.events_stream} does not exist: start the Tether "
               "services (they create the streams) or check the prefix")
    calls = {
        "follow_up": lambda: me.run_agent_tool("Researcher", {}, follow_up="r1", timeout=5),
        "fork": lambda: me.fork("r1", at=1, timeout=5),
        "rewind": lambda: me.rewind("r1", timeout=5),
        "send below": lambda: me.send("r1", "hi", below=["child"], timeout=5),
        "read_run": lambda: tether.read_run(PARENT, "r1"),
        "conversation chat": lambda: tether.conversation("Concierge", "c1",
                                                         owner=PARENT).chat(),
    }
    for name, call in calls.items():
        with pytest.raises(ServiceUnavailable) as unavailable:
            await call()
        assert str(unavailable.value) == missing, name


@pytest.mark.parametrize(("arguments", "error", "named"), [
    ({"timeout": -1}, ValueError, "timeout"),
    ({"timeout": math.nan}, ValueError, "timeout"),
    ({"timeout": "5"}, TypeError, "timeout"),
    ({"expires_in": math.inf}, ValueError, "expires_in"),
    ({"input": {"x": object()}}, TypeError, "input"),
], ids=["negative-timeout", "nan-timeout", "str-timeout", "inf-expiry", "unserialisable"])
async def test_a_run_refused_for_its_arguments_is_never_published(log, tether, arguments,
                                                                   error, named):
    me = tether.parent(PARENT.agent, PARENT.name)
    arguments = {"input": {}, **arguments}
    with pytest.raises(error, match=named):
        await me.run_agent_tool("Researcher", arguments.pop("input"), run_id="refused",
                                **arguments)
    assert await commands_stored(log) == 0
    assert (await tether.read_run(PARENT, "refused")).state is None


async def test_a_message_of_data_that_is_not_json_is_never_published(log, tether):
    me = tether.parent(PARENT.agent, PARENT.name)
    with pytest.raises(TypeError, match="the data of the send command is not JSON"):
        await me.send("r1", data=object(), timeout=5)
    assert await commands_stored(log) == 0
