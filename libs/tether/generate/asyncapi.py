"""The AsyncAPI 3 document of the wire contract, generated through faststream.

Every subject Tether writes is a faststream publisher ("send") and every subject its
services read a subscriber ("receive"), each with its payload's schema (from the models),
its stream and its `Nats-Msg-Id` rule. The parent's queries are declared by their real
handlers (`ParentQueries.subscribe`); the subjects the hot paths read through nats-py are
declared here with their message models. Subjects are shown for the default prefix
`tether`; `{name}` marks a subject token.

`make schemas` writes the document to `schemas/asyncapi.json` (with the JSON Schemas,
`tether.generate.schemas`) and renders it as `docs/contract-asyncapi.md`
(`python -m tether.generate.asyncapi --write`); tests fail when either drifts.
"""

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from faststream.nats import NatsBroker
from faststream.specification import AsyncAPI
from pydantic import BaseModel, ConfigDict

from tether.contract.messages import (
    CancelReply,
    CancelSignal,
    ChatMessage,
    ChatNextReply,
    ChildInspectReply,
    ChildInspectRequest,
    HasRunReply,
    HistoryReply,
    HookMessage,
    InspectReply,
    ListReply,
    MessageSignal,
    ObservabilityEvent,
    ProgressSignal,
    ServeHookReply,
    WorkItem,
)
from tether.contract.subjects import Subjects
from tether.domain.commands import (
    CancelCommand,
    ChatNextQuery,
    ClearCommand,
    ContinueCommand,
    DeliveredCommand,
    HasRunQuery,
    HistoryQuery,
    InspectQuery,
    ListQuery,
    MessageCommand,
    RunCommand,
    SendCommand,
    ServeHookQuery,
)
from tether.domain.delivery_batches import DeliveriesRecorded
from tether.domain.events import ParentRef, event_model
from tether.domain.records import pydantic_model
from tether.parent.queries import ParentQueries

VERSION = "0.1.0"
SUBJECTS = Subjects()
DOCS_PAGE = Path("docs/contract-asyncapi.md")
DESCRIPTION = (
    "Every subject Tether writes (send) and every subject its services read (receive), "
    "for the default prefix `tether` (`TETHER_PREFIX` changes it; streams are named "
    "`<PREFIX>_<KIND>`). `{name}` marks a subject token; identifiers match "
    "`^[A-Za-z0-9][A-Za-z0-9_:-]{0,127}$`. Message ids are the `Nats-Msg-Id` the streams "
    "deduplicate by, within the duplicate window. While tracing is on, the messages "
    "published to the streams carry the sender's trace context in the W3C `traceparent` "
    "(and `tracestate`) headers; a reader may ignore them.")
# The messages Tether publishes with an acknowledgement: the trace context may go with them.
TRACE = " With tracing on: `traceparent`, `tracestate` (W3C Trace Context)."


class AwaiterProbe(BaseModel):
    """`tether.ctl.awaiter...`: the reconciler's empty request, and the awaiting client's
    empty answer; "no responders" means the awaiting side is gone."""

    model_config = ConfigDict(extra="allow")


class DeadLetter(BaseModel):
    """The command's bytes exactly as they arrived (often not JSON at all)."""

    model_config = ConfigDict(extra="allow")


def _template(subject: str, **tokens: str) -> str:
    """`subject` built from sentinel identifiers, with each sentinel shown as `{name}`."""
    for name, sentinel in tokens.items():
        subject = subject.replace(sentinel, "{" + name + "}")
    return subject


_PARENT = {"parent_agent": "PARENTAGENT", "parent_name": "PARENTNAME"}


def _per_parent(subject: str) -> str:
    return subject + ".{parent_agent}.{parent_name}"


def _parent_ref() -> ParentRef:
    return ParentRef(agent=_PARENT["parent_agent"], name=_PARENT["parent_name"])


def _run_subject(method: Callable[..., str]) -> str:
    return _template(method(_parent_ref(), "RUNID"), run_id="RUNID", **_PARENT)


def _reader(model: Any) -> Callable[..., Any]:
    """A handler signature for a subject a service reads through nats-py: faststream
    documents the message from it; it is never subscribed."""

    async def read(message: model) -> None:
        return None

    return read


COMMANDS = (
    ("run", RunCommand, ("`run:<parent_agent>/<parent_name>/<run_id>`, with `:<seq>` after it "
                        "when the run id has events but no run (`seq`: the stream sequence of "
                        "its rejection or tombstone)")),
    ("cancel", CancelCommand, "`cancel:<run_id>:<random>`"),
    ("clear", ClearCommand, "`clear:<parent_agent>:<parent_name>:<random>`"),
    ("continue", ContinueCommand, "unique per answer, chosen by the sender"),
    ("delivered", DeliveredCommand,
     ("`delivered:<parent_agent>.<parent_name>:<method>:<the hook message's id>`; with "
      "`more`, `delivered:<parent_agent>.<parent_name>:batch:<random>`")),
    ("message", MessageCommand, "`message:<parent_agent>:<parent_name>:<message_id>`"),
    ("send", SendCommand,
     "`send:<parent_agent>.<parent_name>:<run_id>:<message_id>` (the sender's message id)"),
)
QUERIES = (("inspect", InspectQuery, InspectReply), ("list", ListQuery, ListReply),
           ("has_run", HasRunQuery, HasRunReply), ("history", HistoryQuery, HistoryReply),
           ("serve_hook", ServeHookQuery, ServeHookReply),
           ("chat_next", ChatNextQuery, ChatNextReply))


def contract_broker() -> NatsBroker:
    """A broker that declares the whole contract (it is never connected)."""
    broker = NatsBroker("nats://localhost:4222", logger=None,
                        description="Tether: agents as tools over NATS JetStream")
    s = SUBJECTS

    def send(address: str, schema: Any, title: str, description: str) -> None:
        broker.publisher(address, schema=schema, title=title, description=description)

    def receive(address: str, model: Any, title: str, description: str, **options: Any) -> None:
        broker.subscriber(address, title=title, description=description,
                          **options)(_reader(model))

    # --- commands (TETHER_CMD): the client sends, the parent's pull consumer reads ------
    for kind, model, message_id in COMMANDS:
        for address, form in ((s.command(kind), "short"),
                              (_per_parent(s.command(kind)), "per-parent")):
            text = (f"Stream `{s.commands_stream}`. `Nats-Msg-Id`: {message_id}. "
                    + ("The per-parent form, which NATS permissions can grant to the "
                       "application owning the parent; it must name the payload's parent."
                       if form == "per-parent" else "The short form.")) + TRACE
            send(address, model, f"send:{address}", text)
            receive(address, model, f"receive:{address}",
                    f"The parent's durable pull consumer `parent-commands`. {text}")
    send(s.command_dead_letters, DeadLetter, f"send:{s.command_dead_letters}",
         f"Stream `{s.commands_stream}`. A command that could not be handled, as it arrived; "
         "headers `Tether-Error` (the reason), `Tether-Subject` and `Tether-Stream-Seq` "
         "(where it was).")

    # --- queries: the client sends, the parent answers (its real handlers) -------------
    ParentQueries(None, None, "tether", None).subscribe(broker, s)
    for kind, request, reply in QUERIES:
        address = (s.rpc(kind) + ".{parent_agent}.{method}" if kind == "serve_hook"
                   else _per_parent(s.rpc(kind)))
        send(address, request, f"send:{address}",
             "Core request/reply; the short form `" + s.rpc(kind) + "` takes the same "
             "payload. No message id.")
        send("{reply_to}", reply, f"send:{s.rpc(kind)}:reply",
             f"The parent's answer to a `{kind}` query, on the request's reply subject. "
             "`error` is set (\"invalid request: ...\" for a request that is no query).")

    # --- the log (TETHER_EVENTS) and its live copy -------------------------------------
    events = _run_subject(s.run_events)
    send(events, event_model(), f"send:{events}",
         f"Stream `{s.events_stream}`: the run's events, the truth. `Nats-Msg-Id`: the "
         "event's `event_id` (`<run_id>:<incarnation>:<kind>...`), so a retried append is "
         "one event." + TRACE)
    ledger = _template(s.delivery_ledger(_PARENT["parent_agent"]), **_PARENT)
    send(ledger, pydantic_model(DeliveriesRecorded), f"send:{ledger}",
         f"Stream `{s.events_stream}`: a parent agent's delivery ledger. The parent records "
         "the finish-hook deliveries one `delivered` command reports together here, in one "
         "message (`Nats-Msg-Id`: its `event_id`); a follower of the whole log reads each "
         "entry as that run's `run.finish_delivered`, at this message's place in the "
         "stream. A read of one run's subject does not see it.")
    receive(s.all_events, event_model(), f"receive:{s.all_events}",
            f"Stream `{s.events_stream}`: the projector and the reconciler follow "
            "every event, and every delivery ledger's batches.")
    live = _run_subject(s.run_live)
    send(live, event_model(), f"send:{live}",
         f"Core: `{s.events_stream}` republishes each stored event here, in stream order, "
         "with `Nats-Sequence` and `Nats-Last-Sequence` (the run's previous sequence) "
         "headers. The parent also sends an empty message here, with only a "
         "`Tether-Run-Sequence` header, when a run request finds its run already there: "
         "the run's last sequence when the request found it.")

    # --- progress, work, hooks, chat --------------------------------------------------
    progress = _run_subject(s.run_progress)
    send(progress, ProgressSignal, f"send:{progress}",
         f"Stream `{s.progress_stream}` (the last message per subject is kept). No message "
         "id.")
    live_progress = _template(s.live(s.run_progress(_parent_ref(), "RUNID")), run_id="RUNID",
                              **_PARENT)
    send(live_progress, ProgressSignal, f"send:{live_progress}",
         f"Core: `{s.progress_stream}` republishes each stored signal here, with the same "
         "headers as the live run events.")
    live_chat = _template(s.live(s.chat(_parent_ref())), **_PARENT)
    send(live_chat, ChatMessage, f"send:{live_chat}",
         f"Core: `{s.chat_stream}` republishes each stored chat message here, with the same "
         "headers as the live run events.")
    work = _template(s.work("AGENTTYPE"), agent_type="AGENTTYPE")
    work_id = ("`work:<run_id>:<why>:<dispatch>:<incarnation>` (`why`: `start`, `reattach`, "
               "`resume`)")
    send(work, pydantic_model(WorkItem), f"send:{work}",
         f"Stream `{s.work_stream}` (work queue). `Nats-Msg-Id`: {work_id}." + TRACE)
    receive(work, pydantic_model(WorkItem), f"receive:{work}",
            f"Stream `{s.work_stream}`: the durable pull consumer `runner-<agent_type>` "
            f"shared by every runner of the type. `Nats-Msg-Id`: {work_id}.")
    hook = _template(s.hook("PARENTAGENT", "METHOD"), parent_agent="PARENTAGENT",
                     method="METHOD")
    send(hook, HookMessage, f"send:{hook}",
         f"Stream `{s.hooks_stream}`. `Nats-Msg-Id`: `finish:<run_id>:<status>:<incarnation>` "
         "(`finish-global:...` for the parent's global finish hook; `:retry<n>` added to a "
         "retry after the lease); `Tether-First-Publication: 1` on a first publication."
         + TRACE)
    chat = _template(s.chat(_parent_ref()), **_PARENT)
    send(chat, ChatMessage, f"send:{chat}",
         f"Stream `{s.chat_stream}`. `Nats-Msg-Id` = `id`: "
         "`detached-finish:<run_id>:<status>:<incarnation>` or "
         "`detached-ms:<run_id>:<name>:<incarnation>`." + TRACE)

    # --- control (core NATS) ----------------------------------------------------------
    cancel = _template(s.cancel_signal("AGENTTYPE"), agent_type="AGENTTYPE")
    send(cancel, CancelSignal, f"send:{cancel}",
         "Core: a nudge to every runner of the agent type (the durable fact is "
         "`run.cancel_requested`); the reconciler sends it as a request.")
    receive(cancel, CancelSignal, f"receive:{cancel}",
            "Every runner of the agent type; only the one holding the run answers a request.",
            no_reply=True)
    send("{reply_to}", CancelReply, f"send:{cancel}:reply",
         "The holding runner's answer: did it hold the run, did the child stop in time.")
    steer = _template(s.message_signal("AGENTTYPE"), agent_type="AGENTTYPE")
    send(steer, MessageSignal, f"send:{steer}",
         "Core: the parent's nudge to every runner of the agent type, after it recorded a "
         "steering message (`run.message_sent`, the durable fact).")
    receive(steer, MessageSignal, f"receive:{steer}",
            "Every runner of the agent type; the one holding the run hands the run's "
            "messages to its child (and looks for them at each heartbeat too).",
            no_reply=True)
    inspect = _template(s.inspect_child("AGENTTYPE"), agent_type="AGENTTYPE")
    send(inspect, ChildInspectRequest, f"send:{inspect}",
         "Core request from the reconciler to every runner of the agent type.")
    receive(inspect, ChildInspectRequest, f"receive:{inspect}",
            "Every runner answers; a null record from all of them means \"not started yet\".")
    send("{reply_to}", ChildInspectReply, f"send:{inspect}:reply",
         "A runner's record of the run, or null.")
    awaiter = _run_subject(s.awaiter)
    send(awaiter, AwaiterProbe, f"send:{awaiter}",
         "Core request from the active reconciler, every awaiter check interval, for each "
         "open awaited run: is its awaiting application still there?")
    receive(awaiter, AwaiterProbe, f"receive:{awaiter}",
            "The client awaiting the run answers while it waits; no answer at two checks "
            "in a row and the run is recovered.")
    observability = _template(s.observability("agent_tool:EVENT", _parent_ref()),
                              event="EVENT", **_PARENT)
    send(observability, ObservabilityEvent, f"send:{observability}",
         "Core: typed events for operators and the parent's application "
         "(`agent_tool:recovery:row` of parent A/b is sent on "
         "`tether.obs.A.b.agent_tool.recovery.row`), each also a log line.")
    return broker


def generate() -> dict[str, Any]:
    specification = AsyncAPI(contract_broker(), title="Tether wire contract", version=VERSION,
                             description=DESCRIPTION,
                             schema_version="3.0.0")
    document: dict[str, Any] = json.loads(specification.to_specification().to_json())
    return document


def _unquote(ref: str) -> str:
    return unquote(ref.rsplit("/", 1)[1])


def _payload_name(document: dict[str, Any], message_ref: str) -> str:
    message = document["components"]["messages"][_unquote(message_ref)]
    name = _unquote(message["payload"]["$ref"])
    schema = document["components"]["schemas"][name]
    return "Event (one of the `run.*` events)" if "oneOf" in schema else f"`{name}`"


def render_markdown(document: dict[str, Any]) -> str:
    """The contract as a page: one row per operation, ordered by subject."""
    rows = []
    for operation in document["operations"].values():
        channel = document["channels"][_unquote(operation["channel"]["$ref"])]
        message_ref = next(iter(channel["messages"].values()))["$ref"]
        rows.append((channel["address"], operation["action"],
                     _payload_name(document, message_ref),
                     channel.get("description", "").replace("|", "\\|")))
    lines = [
        "# The wire contract (AsyncAPI)",
        "",
        "Generated from `schemas/asyncapi.json` by `make schemas`; do not edit by hand.",
        "",
        document["info"]["description"],
        "",
        ("The payloads' JSON Schemas are under `schemas/` (`events/`, `commands/`, "
        "`messages/`, one file per model) and in the document's `components.schemas`. A "
        "`{reply_to}` subject is the reply subject of the request."),
        "",
        "| subject | Tether | payload | stream, message id, notes |",
        "|---|---|---|---|",
    ]
    for address, action, payload, notes in sorted(rows):
        lines.append(f"| `{address}` | {action} | {payload} | {notes} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tether.generate.asyncapi")
    parser.add_argument("--page", type=Path, default=DOCS_PAGE)
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--write", action="store_true", help="render the docs page")
    action.add_argument("--check", action="store_true", help="fail when the page drifts")
    args = parser.parse_args(argv)
    expected = render_markdown(generate())
    if args.write:
        args.page.parent.mkdir(parents=True, exist_ok=True)
        args.page.write_text(expected)
        print(f"wrote {args.page}")
        return 0
    if not args.page.exists() or args.page.read_text() != expected:
        print(f"{args.page} differs from the contract; run `make schemas`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
