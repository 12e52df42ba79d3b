"""Bad arguments to the client's calls are refused before any I/O, with an error that names
the argument: nothing is published, subscribed or read (a `Link` that records every use
proves it)."""

import math
import warnings
from typing import Any

import pytest

from tether.client.connection import Tether, connect
from tether.client.conversation import Conversation
from tether.client.hooks import HookRegistry
from tether.client.parent import ParentHandle
from tether.config import Settings
from tether.contract.subjects import Subjects
from tether.domain.commands import RunCommand, SendCommand
from tether.domain.events import ParentRef

PARENT = ParentRef(agent="Assistant", name="user-1")


class Untouched:
    """A `Link` whose every use of the connection is recorded: a refused call uses none."""

    def __init__(self) -> None:
        self.subjects = Subjects("argcheck")
        self.settings = Settings(prefix="argcheck")
        self.used: list[str] = []

    def __getattr__(self, name: str) -> Any:
        async def used(*args: Any, **kwargs: Any) -> Any:
            self.used.append(name)
            raise AssertionError(f"{name} was used before the arguments were checked")
        return used


@pytest.fixture
def link() -> Untouched:
    return Untouched()


@pytest.fixture
def me(link: Untouched) -> ParentHandle:
    return ParentHandle(link, PARENT)


async def refused(link: Untouched, call, error: type[Exception], *named: str) -> str:
    with pytest.raises(error) as raised:
        await call
    text = str(raised.value)
    assert "\n" not in text, text
    for name in named:
        assert name in text, text
    assert link.used == [], f"{link.used} used before the refusal"
    return text


# --- timeout (D4) -----------------------------------------------------------------------

BAD_TIMEOUTS = [(-1, ValueError), (0, ValueError), (math.nan, ValueError),
                (math.inf, ValueError), ("5", TypeError), (True, TypeError)]


@pytest.mark.parametrize(("timeout", "error"), BAD_TIMEOUTS)
async def test_a_run_with_a_bad_timeout_is_refused_before_it_is_published(
        link, me, timeout, error) -> None:
    await refused(link, me.run_agent_tool("Researcher", {}, run_id="r1", timeout=timeout),
                  error, "timeout")
    await refused(link, me.run_agent_tool("Researcher", {}, follow_up="r1", timeout=timeout),
                  error, "timeout")


@pytest.mark.parametrize(("timeout", "error"), BAD_TIMEOUTS)
async def test_queries_sends_forks_and_rewinds_refuse_a_bad_timeout(link, me, timeout,
                                                                      error) -> None:
    for call in (me.inspect("r1", timeout=timeout), me.list_runs(timeout=timeout),
                 me.has_run("r1", timeout=timeout), me.send("r1", "hi", timeout=timeout),
                 me.fork("r1", at=1, timeout=timeout), me.rewind("r1", timeout=timeout)):
        await refused(link, call, error, "timeout")


async def test_send_takes_no_none_timeout(link, me) -> None:
    await refused(link, me.send("r1", "hi", timeout=None), TypeError, "timeout")


# --- expires_in (D5) --------------------------------------------------------------------

@pytest.mark.parametrize(("expires_in", "error"), [
    (math.nan, ValueError), (math.inf, ValueError), (-math.inf, ValueError),
    ("5", TypeError), (False, TypeError)])
async def test_a_nonsense_expires_in_is_refused_by_name(link, me, expires_in, error) -> None:
    for call in (me.run_agent_tool("Researcher", {}, expires_in=expires_in),
                 me.cancel("r1", expires_in=expires_in),
                 me.continue_run("r1", expires_in=expires_in),
                 me.send("r1", "hi", expires_in=expires_in),
                 me.clear(expires_in=expires_in)):
        await refused(link, call, error, "expires_in")


# --- requests that do not validate (D6) -------------------------------------------------

@pytest.mark.parametrize(("kwargs", "named"), [
    ({"tool_outputs": [1]}, "tool_outputs"),
    ({"below": ["a.b"]}, "below.0"),
    ({"approvals": [5]}, "approvals.0"),
    ({"human_input": 5}, "human_input"),
])
async def test_an_invalid_continue_is_a_one_line_value_error_naming_the_field(
        link, me, kwargs, named) -> None:
    text = await refused(link, me.continue_run("r1", **kwargs), ValueError, named)
    assert text.startswith("invalid continue request: ")


@pytest.mark.parametrize(("args", "kwargs", "named"), [
    ((), {}, "text, data or both"),
    ((), {"text": ""}, "text"),
    (("hi",), {"mode": "bogus"}, "mode"),
    (("hi",), {"below": ["a.b"]}, "below.0"),
])
async def test_an_invalid_send_is_a_one_line_value_error_naming_the_field(
        link, me, args, kwargs, named) -> None:
    text = await refused(link, me.send("r1", *args, **kwargs), ValueError, named)
    assert text.startswith("invalid send request: ")


@pytest.mark.parametrize(("at", "error", "named"), [
    (-1, ValueError, "invalid fork request: at"),
    (None, TypeError, "at is a fork point"),
    (1.5, TypeError, "at is a fork point"),
    ("bogus", ValueError, "at: expected"),
])
async def test_a_fork_at_no_point_is_refused_before_the_run_is_read(link, me, at, error,
                                                                     named) -> None:
    await refused(link, me.fork("r1", at=at), error, named)


# --- a string where a list of ids goes (D7) ---------------------------------------------

@pytest.mark.parametrize("parameter", ["below", "approvals", "rejections"])
async def test_continue_refuses_a_string_for_a_list_of_ids(link, me, parameter) -> None:
    await refused(link, me.continue_run("r1", **{parameter: "child"}), TypeError, parameter)


async def test_send_refuses_a_string_for_below(link, me) -> None:
    await refused(link, me.send("r1", "hi", below="child"), TypeError, "below")


async def test_a_conversation_refuses_a_string_of_approvals(link) -> None:
    conversation = Conversation(link, "Concierge", "support", owner=("Assistant", "u1"))
    await refused(link, conversation.continue_run(approvals="call-1"), TypeError, "approvals")


# --- hooks (D8) -------------------------------------------------------------------------

def registry(link: Untouched, **options: Any) -> HookRegistry:
    return HookRegistry(link, "Importer", **options)


@pytest.mark.parametrize(("lease_ms", "error"), [
    (-1, ValueError), (0, ValueError), (99, ValueError), (math.nan, ValueError),
    ("1000", TypeError)])
def test_a_hook_lease_that_cannot_be_is_refused_naming_lease_ms(link, lease_ms, error) -> None:
    with pytest.raises(error, match="lease_ms"):
        registry(link, lease_ms=lease_ms)
    assert link.used == []


def test_a_bad_configured_lease_names_its_setting(link) -> None:
    link.settings = link.settings.model_copy(update={"hook_lease_ms": 0})
    with pytest.raises(ValueError, match=r"hook_lease_ms \(TETHER_HOOK_LEASE_MS\)"):
        registry(link)


def test_an_unknown_ledger_is_refused_naming_the_ones_there_are(link) -> None:
    with pytest.raises(ValueError, match="ledger must be 'parent' or 'direct', not 'bogus'"):
        registry(link, ledger="bogus")


def test_a_hook_function_that_cannot_take_run_and_result_is_refused_at_register(link) -> None:
    hooks = registry(link)

    def no_arguments() -> None: ...

    async def one_argument(run) -> None: ...

    def three_required(run, result, extra) -> None: ...

    for function in (no_arguments, one_argument, three_required):
        with pytest.raises(TypeError, match="two positional arguments"):
            hooks.register("on_done", function)
    assert hooks.functions == {}

    def with_a_default(run, result, extra=None) -> None: ...

    hooks.register("on_done", with_a_default)
    hooks.register("on_other", lambda *args: None)
    assert set(hooks.functions) == {"on_done", "on_other"}


# --- conversation owner (D9) ------------------------------------------------------------

@pytest.mark.parametrize(("owner", "error"), [
    ("bad", ValueError), (("only-one",), ValueError), (("a", "b", "c"), ValueError),
    (5, TypeError)])
def test_a_conversation_owner_of_no_known_form_says_what_an_owner_is(link, owner,
                                                                      error) -> None:
    with pytest.raises(error, match=r"owner is .*\(agent, name\) or 'agent/name'"):
        Conversation(link, "Concierge", "support", owner=owner)


def test_a_conversation_owner_agent_slash_name_still_works(link) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        conversation = Conversation(link, "Concierge", "support", owner="Assistant/u1")
    assert conversation.owner.ref == ParentRef(agent="Assistant", name="u1")


# --- connect and unserialisable values --------------------------------------------------

@pytest.mark.parametrize(("connect_timeout", "error"), [
    (math.nan, ValueError), (math.inf, ValueError), (0, ValueError), ("5", TypeError)])
def test_connect_refuses_a_connect_timeout_that_is_no_duration(connect_timeout,
                                                                error) -> None:
    with pytest.raises(error, match="connect_timeout"):
        connect(settings=Settings(prefix="argcheck"), connect_timeout=connect_timeout)


class Unconnected:
    """A NATS client that was never connected: a `Tether` on it that sends anything fails."""

    max_payload = 1 << 20

    def jetstream(self, **options: Any) -> None:
        return None


@pytest.mark.parametrize(("kind", "field", "make"), [
    ("run", "input", lambda: RunCommand(run_id="r1", parent=PARENT, agent_type="Researcher",
                                        input={"x": object()})),
    ("send", "data", lambda: SendCommand(run_id="r1", parent=PARENT, message_id="m1",
                                         data=object())),
])
async def test_a_value_that_is_not_json_is_a_type_error_naming_its_field(kind, field,
                                                                          make) -> None:
    tether = Tether(Unconnected(), Settings(prefix="argcheck"))
    with pytest.raises(TypeError, match=f"the {field} of the {kind} command is not JSON"):
        await tether.publish_command(kind, make(), "id-1")


# --- the list's filters and cursor ------------------------------------------------------

@pytest.mark.parametrize(("arguments", "error", "named"), [
    ({"agent_type": "no.such type"}, ValueError, "agent type"),
    ({"before": "seed-1"}, TypeError, "before"),
    ({"before": {"requested_at": 1, "run_id": "r1"}}, TypeError, "before"),
    ({"limit": 0}, ValueError, "limit"),
    ({"status": ["finished"]}, ValueError, "status"),
    ({"waiting": "sometimes"}, ValueError, "waiting"),
    ({"canceled": [True]}, ValueError, "canceled"),
])
async def test_a_list_with_a_bad_filter_or_cursor_is_refused_before_it_is_asked(
        link, me, arguments, error, named) -> None:
    await refused(link, me.list_runs(**arguments), error, named)
    await refused(link, me.list_page(**arguments), error, named)


async def test_a_list_page_holds_one_run_less_than_a_list_may(link, me) -> None:
    """It asks for one run more than the page, to know whether another page follows."""
    await refused(link, me.list_page(limit=10_000), ValueError, "limit", "9999")
