"""The wire contract: identifiers, command parsing, subject names and the JSON Schemas."""

import datetime
import json
import math
from pathlib import Path
from typing import Any

import msgspec
import pytest
from pydantic import BaseModel, ValidationError

from tether.child.context import RunContext, check_progress
from tether.contract.codec import decode_event, encode_event
from tether.contract.messages import (
    HookMessage,
    LifecycleResult,
    ListReply,
    ProgressSignal,
    RunInfo,
    WorkItem,
    hook_message_json,
    progress_signal_json,
    read_work_item,
    work_item_json,
)
from tether.contract.subjects import Subjects
from tether.domain import decide
from tether.domain import events as ev
from tether.domain.commands import (
    COMMAND_CLASSES,
    MAX_DELIVERY_REPORTS,
    CancelCommand,
    ClearCommand,
    ContinueCommand,
    DeliveredCommand,
    DeliveryReport,
    HasRunQuery,
    InspectQuery,
    ListCursor,
    ListQuery,
    RunCommand,
    parse_command,
)
from tether.domain.decide import delivery_entry_of_report
from tether.domain.detached_options import DetachedOptions, MilestoneNotifyOptions, NotifyOptions
from tether.domain.events import ParentRef, RunMilestone
from tether.domain.fold import evolve, fold
from tether.domain.ids import (
    GLOBAL_FINISH_HOOK,
    IDENTIFIER_PATTERN,
    InvalidIdentifier,
    chat_finish_id,
    check_identifier,
    finish_message_id,
    names_this_life,
    run_message_id,
    work_message_id,
)
from tether.generate import documents, schemas
from tether.testing import RunEvents

REPO = Path(__file__).resolve().parents[2]
PARENT = {"agent": "Assistant", "name": "user-42"}

VALID_IDENTIFIERS = ["r1", "A", "7", "run-2026:01_x", "Assistant", "a" * 128, "x:y:z", "0-_:"]
INVALID_IDENTIFIERS = [
    "", "run 1", " r1", "r1 ", "run.1", "*", "r*", ">", "r>", "-r1", "_r1", ":r1",
    "a" * 129, "héllo", "ü", "日本", "r1\n", "r1\t", "r/1",
]


# --- identifiers ----------------------------------------------------------------------


@pytest.mark.parametrize("value", VALID_IDENTIFIERS)
def test_valid_identifiers_are_accepted(value: str) -> None:
    assert check_identifier(value) == value


@pytest.mark.parametrize("value", INVALID_IDENTIFIERS)
def test_invalid_identifiers_are_refused_naming_the_value_and_the_pattern(value: str) -> None:
    with pytest.raises(InvalidIdentifier) as error:
        check_identifier(value, "run id")

    message = str(error.value)
    assert "run id" in message
    assert repr(value) in message
    assert IDENTIFIER_PATTERN in message


@pytest.mark.parametrize("value", [None, 7, b"r1", ["r1"]], ids=["none", "int", "bytes", "list"])
def test_an_identifier_must_be_a_string(value: Any) -> None:
    with pytest.raises(InvalidIdentifier, match="invalid identifier"):
        check_identifier(value)


def test_an_invalid_identifier_is_a_value_error() -> None:
    assert issubclass(InvalidIdentifier, ValueError)


@pytest.mark.parametrize("value", INVALID_IDENTIFIERS)
def test_run_command_refuses_an_invalid_run_id(value: str) -> None:
    with pytest.raises(ValidationError, match="run_id"):
        RunCommand(run_id=value, parent=PARENT, agent_type="Researcher")


@pytest.mark.parametrize("name", ["user.42", "user 42", "*", ">", "-u"])
def test_a_parent_name_that_would_add_a_subject_token_is_refused(name: str) -> None:
    with pytest.raises(InvalidIdentifier, match="parent name"):
        ParentRef(agent="Assistant", name=name)
    with pytest.raises(ValidationError, match=r"parent.name"):
        parse_command("cancel", {"run_id": "r1", "parent": {"agent": "Assistant", "name": name}})


def test_a_hook_method_name_is_an_identifier() -> None:
    with pytest.raises(InvalidIdentifier, match="on_finish"):
        DetachedOptions(on_finish="on.done")


# --- commands -------------------------------------------------------------------------


@pytest.mark.parametrize(("kind", "payload", "model"), [
    ("run", {"run_id": "r1", "parent": PARENT, "agent_type": "Researcher"}, RunCommand),
    ("cancel", {"run_id": "r1", "parent": PARENT}, CancelCommand),
    ("clear", {"parent": PARENT, "status": ["completed"], "older_than": 1}, ClearCommand),
    ("continue", {"run_id": "r1", "parent": PARENT, "approvals": ["c1"]}, ContinueCommand),
    ("inspect", {"run_id": "r1", "parent": PARENT}, InspectQuery),
    ("list", {"parent": PARENT}, ListQuery),
    ("has_run", {"run_id": "r1", "parent": PARENT}, HasRunQuery),
])
def test_parse_command_fills_the_type_from_the_subject(kind: str, payload: dict[str, Any],
                                                       model: type) -> None:
    command = parse_command(kind, payload)

    assert type(command) is model
    assert command.type == kind
    assert "type" not in payload


def test_parse_command_accepts_a_matching_type() -> None:
    command = parse_command("cancel", {"type": "cancel", "run_id": "r1", "parent": PARENT})

    assert isinstance(command, CancelCommand)


def test_parse_command_refuses_a_payload_of_another_type() -> None:
    with pytest.raises(ValueError, match="'cancel' payload was sent as a 'run' command") as error:
        parse_command("run", {"type": "cancel", "run_id": "r1", "parent": PARENT})

    assert not isinstance(error.value, ValidationError)


def test_parse_command_refuses_an_unknown_kind() -> None:
    with pytest.raises(ValueError, match="unknown command 'launch'"):
        parse_command("launch", {"run_id": "r1", "parent": PARENT})


def test_parse_command_refuses_unknown_fields() -> None:
    with pytest.raises(ValidationError, match="priority"):
        parse_command("cancel", {"run_id": "r1", "parent": PARENT, "priority": 1})


def test_infinite_no_progress_budget_is_stored_as_zero() -> None:
    assert DetachedOptions(no_progress_budget_ms=float("inf")).no_progress_budget_ms == 0
    command = parse_command("run", {"run_id": "r1", "parent": PARENT, "agent_type": "Researcher",
                                    "detached": {"no_progress_budget_ms": math.inf}})
    assert command.detached_options().no_progress_budget_ms == 0


@pytest.mark.parametrize("budget", [float("-inf"), -1, float("nan")])
def test_a_negative_or_undefined_no_progress_budget_is_refused(budget: float) -> None:
    with pytest.raises(msgspec.ValidationError, match="no_progress_budget_ms"):
        DetachedOptions(no_progress_budget_ms=budget)


@pytest.mark.parametrize(("detached", "expected"), [
    (False, None),
    (True, DetachedOptions()),
    ({"on_finish": "on_done", "max_budget_ms": 60_000},
     DetachedOptions(on_finish="on_done", max_budget_ms=60_000)),
], ids=["awaited", "detached-defaults", "detached-options"])
def test_run_command_detached_options(detached: Any, expected: DetachedOptions | None) -> None:
    command = RunCommand(run_id="r1", parent=PARENT, agent_type="Researcher", detached=detached)

    assert command.detached_options() == expected


@pytest.mark.parametrize(("on_milestones", "names", "mode"), [
    (None, [], "narrate"),
    (["sources-gathered"], ["sources-gathered"], "narrate"),
    ({"names": ["needs-approval"], "mode": "react"}, ["needs-approval"], "react"),
])
def test_milestone_notification_options(on_milestones: Any, names: list[str], mode: str) -> None:
    options = DetachedOptions(on_milestones=on_milestones)

    assert (options.milestone_names(), options.milestone_mode()) == (names, mode)


class FirstListQuery(BaseModel):
    """The list query as a parent from before paging reads it: unknown fields refused."""

    model_config = {"extra": "forbid"}
    type: str
    parent: dict[str, str]
    status: list[str] | None
    limit: int


def test_a_list_query_writes_its_paging_fields_only_when_used() -> None:
    plain = ListQuery(parent=PARENT, status=["completed"], limit=5)
    FirstListQuery.model_validate_json(plain.model_dump_json())  # an older parent takes it
    paged = ListQuery(parent=PARENT, agent_type="Researcher", count=True,
                      before=ListCursor(requested_at=0, run_id="r1"))
    written = json.loads(paged.model_dump_json())
    assert written["agent_type"] == "Researcher" and written["count"] is True
    assert written["before"] == {"requested_at": 0, "run_id": "r1"}
    assert ListQuery.model_validate_json(paged.model_dump_json()) == paged
    with pytest.raises(ValidationError, match="extra"):
        FirstListQuery.model_validate_json(paged.model_dump_json())


class PagingListQuery(FirstListQuery):
    """The list query as a parent from before `waiting` and `canceled` reads it."""

    agent_type: str | None = None
    before: dict[str, Any] | None = None
    count: bool = False


def test_a_list_query_writes_its_state_filters_only_when_used() -> None:
    page = ListQuery(parent=PARENT, status=["completed"], agent_type="Researcher", count=True)
    PagingListQuery.model_validate_json(page.model_dump_json())  # a paging parent takes it
    working = ListQuery(parent=PARENT, status=["running"], waiting=False)
    failed = ListQuery(parent=PARENT, status=["error", "aborted"], canceled=False)
    assert json.loads(working.model_dump_json())["waiting"] is False
    assert json.loads(failed.model_dump_json())["canceled"] is False
    assert ListQuery.model_validate_json(working.model_dump_json()) == working
    with pytest.raises(ValidationError, match="waiting"):
        PagingListQuery.model_validate_json(working.model_dump_json())


def test_a_list_reply_writes_its_total_only_when_counted() -> None:
    assert json.loads(ListReply().model_dump_json()) == {"runs": [], "error": None}
    assert json.loads(ListReply(total=0).model_dump_json())["total"] == 0


@pytest.mark.parametrize("cursor", [{"requested_at": -1, "run_id": "r1"},
                                    {"requested_at": 1, "run_id": "r 1"},
                                    {"requested_at": 1}])
def test_a_list_cursor_is_a_time_and_a_run_id(cursor: dict[str, Any]) -> None:
    with pytest.raises(ValidationError, match="before"):
        ListQuery(parent=PARENT, before=cursor)


# --- subjects -------------------------------------------------------------------------


def test_default_subjects_are_the_ones_in_the_design() -> None:
    subjects = Subjects()
    parent = ParentRef(agent="A", name="u")

    assert subjects.command("run") == "tether.cmd.run"
    assert subjects.command("cancel") == "tether.cmd.cancel"
    assert subjects.run_events(parent, "r1") == "tether.evt.A.u.r1"
    assert subjects.parent_events(parent) == "tether.evt.A.u.>"
    assert subjects.all_events == "tether.evt.>"
    assert subjects.run_progress(parent, "r1") == "tether.progress.A.u.r1"
    assert subjects.parent_progress(parent) == "tether.progress.A.u.>"
    assert subjects.work("Researcher") == "tether.work.Researcher"
    assert subjects.hook("A", "on_done") == "tether.hook.A.on_done"
    assert subjects.chat(parent) == "tether.chat.A.u"
    assert subjects.rpc("inspect") == "tether.rpc.inspect"
    parent = ParentRef(agent="Assistant", name="u1")
    assert subjects.observability("agent_tool:recovery:row", parent) == \
        "tether.obs.Assistant.u1.agent_tool.recovery.row"
    assert subjects.observing("agent_tool:detached:>") == "tether.obs.*.*.agent_tool.detached.>"
    assert subjects.observing("agent_tool:>", "Assistant") == "tether.obs.Assistant.*.agent_tool.>"


def test_default_streams_are_the_ones_in_the_design() -> None:
    subjects = Subjects()

    assert [subjects.commands_stream, subjects.events_stream, subjects.progress_stream,
            subjects.work_stream, subjects.hooks_stream, subjects.chat_stream] == [
        "TETHER_CMD", "TETHER_EVENTS", "TETHER_PROGRESS", "TETHER_WORK", "TETHER_HOOKS",
        "TETHER_CHAT"]


def test_another_prefix_renames_every_subject_and_stream() -> None:
    subjects = Subjects("t-1a")

    assert subjects.command("run") == "t-1a.cmd.run"
    assert subjects.run_events(ParentRef(agent="A", name="u"), "r1") == "t-1a.evt.A.u.r1"
    assert subjects.events_stream == "T_1A_EVENTS"


@pytest.mark.parametrize("run_id", ["r1", "run-2026:01_x", "a" * 128])
def test_parse_run_events_round_trips(run_id: str) -> None:
    subjects = Subjects()
    parent = ParentRef(agent="Assistant", name="user-42")

    assert subjects.parse_run_events(subjects.run_events(parent, run_id)) == (parent, run_id)


@pytest.mark.parametrize("subject", [
    "tether.evt.A.u", "tether.evt.A.u.r1.extra", "other.evt.A.u.r1", "tether.progress.A.u.r1",
    "tether.evt.A.u.r1.>",
])
def test_parse_run_events_refuses_other_subjects(subject: str) -> None:
    with pytest.raises(ValueError, match="not a run-events subject"):
        Subjects().parse_run_events(subject)


def test_parse_run_events_refuses_an_invalid_parent_token() -> None:
    with pytest.raises(InvalidIdentifier, match="parent name"):
        Subjects().parse_run_events("tether.evt.A.*.r1")


@pytest.mark.parametrize("call", [
    lambda s: s.run_events(ParentRef(agent="A", name="u"), "r.1"),
    lambda s: s.run_progress(ParentRef(agent="A", name="u"), "*"),
    lambda s: s.work("Research er"),
    lambda s: s.hook("A", "on.done"),
    lambda s: s.hook("A.b", "on_done"),
], ids=["run-events", "run-progress", "work", "hook-method", "hook-agent"])
def test_a_subject_is_never_built_from_an_invalid_identifier(call: Any) -> None:
    with pytest.raises(InvalidIdentifier):
        call(Subjects())


@pytest.mark.parametrize("prefix", ["", "1tether", "-t", "te.ther", "te ther", "t*", "t>",
                                    "t" * 33, "tëther"])
def test_a_bad_prefix_is_refused(prefix: str) -> None:
    with pytest.raises(ValueError, match="invalid subject prefix"):
        Subjects(prefix)


# --- schemas --------------------------------------------------------------------------


def test_checked_in_schemas_match_the_models() -> None:
    assert schemas.differences(REPO / "schemas") == [], "run `make schemas` and commit the result"


def test_schema_drift_is_reported(tmp_path: Path) -> None:
    for path, document in schemas.generate().items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(documents.render(document))
    assert schemas.differences(tmp_path) == []

    changed = tmp_path / "events" / "run.completed.v1.json"
    changed.write_text(changed.read_text().replace('"summary"', '"summary_text"'))
    (tmp_path / "commands" / "cancel.json").unlink()
    (tmp_path / "events" / "run.completed.v0.json").write_text("{}\n")

    assert schemas.differences(tmp_path) == [
        "missing: commands/cancel.json",
        "not generated by any model: events/run.completed.v0.json",
        "differs: events/run.completed.v1.json",
    ]


def test_schemas_cover_every_event_and_command() -> None:
    generated = schemas.generate()

    assert {"events/run.requested.v5.json", "events/run.interrupted.v2.json",
            "events/event.json", "commands/run.json"} <= set(generated)
    assert len([p for p in generated if p.startswith("events/run.")]) == 28
    assert len([p for p in generated if p.startswith("commands/")]) == len(COMMAND_CLASSES) == 13


def test_a_work_item_ignores_fields_a_later_parent_adds_but_checks_its_own() -> None:
    item = read_work_item(
        '{"run_id": "r1", "parent": {"agent": "A", "name": "n"}, "agent_type": "Researcher",'
        ' "attempt": 0, "priority": "high"}')
    assert (item.run_id, item.attempt) == ("r1", 0) and not hasattr(item, "priority")
    with pytest.raises(msgspec.ValidationError, match="attempt"):
        read_work_item(
            '{"run_id": "r1", "parent": {"agent": "A", "name": "n"},'
            ' "agent_type": "Researcher", "attempt": -1}')
    with pytest.raises(msgspec.ValidationError, match="agent_type"):
        read_work_item(
            '{"run_id": "r1", "parent": {"agent": "A", "name": "n"}, "agent_type": "a.b"}')


def test_a_work_item_is_written_as_it_is_read() -> None:
    run = RunEvents("r1", ParentRef(agent="Assistant", name="u1"))
    item = WorkItem(run_id="r1", parent=run.parent, agent_type="Researcher", attempt=0,
                    requested=run.requested(), requested_seq=4)

    assert read_work_item(work_item_json(item)) == item


def _life(run_id: str, request_id: str):
    run = RunEvents(run_id, ParentRef(agent="Assistant", name="u1"), id_prefix=request_id)
    return fold([run.requested(), run.running(), run.completed("ok")])


def test_message_ids_of_two_lives_of_a_run_id_differ() -> None:
    first, second = _life("r1", "first"), _life("r1", "second")
    assert first.incarnation != second.incarnation
    for make in (lambda s: finish_message_id(s, "completed", "on_done"),
                 lambda s: finish_message_id(s, "completed", GLOBAL_FINISH_HOOK),
                 lambda s: chat_finish_id(s, "completed"),
                 lambda s: work_message_id(s.run_id, 1, "start", s.incarnation)):
        assert make(first) != make(second)
    assert finish_message_id(first, "completed", "on_done") == (
        f"finish:r1:completed:{first.incarnation}")
    assert finish_message_id(first, "completed", GLOBAL_FINISH_HOOK).startswith("finish-global:")
    assert work_message_id("r1", 2, "resume") == "work:r1:resume:2"


def test_a_hooks_message_id_names_its_own_life_only() -> None:
    first, second = _life("r1", "first"), _life("r1", "second")
    own = finish_message_id(first, "completed", "on_done")
    for message_id in (own, f"{own}:retry2", "finish:r1:completed", "finish:r1:completed:retry1"):
        assert names_this_life(message_id, first, "completed", "on_done"), message_id
    assert not names_this_life(own, second, "completed", "on_done"), "another life's"
    assert not names_this_life(f"{own}:retry1", second, "completed", "on_done")
    assert not names_this_life(own, first, "error", "on_done"), "another outcome's"
    assert not names_this_life(own, first, "completed", GLOBAL_FINISH_HOOK), "another hook's"
    assert not names_this_life("finish:r10:completed", first, "completed", "on_done")


def _report(state, method: str, message_id: str) -> DeliveredCommand:
    return DeliveredCommand(run_id=state.run_id, parent=state.parent, status="completed",
                            method=method, message_id=message_id)


@pytest.mark.parametrize("method", ["on_done", GLOBAL_FINISH_HOOK])
def test_a_delivery_report_makes_the_ledger_entry_the_run_would(method: str) -> None:
    state = _life("r1", "first")
    own = finish_message_id(state, "completed", method)
    for message_id in (own, f"{own}:retry3"):
        report = _report(state, method, message_id)
        [decided] = decide.record_delivery(state, report, 1234)
        assert delivery_entry_of_report(report, 1234) == decided
        assert decided.event_id == state.event_id("finish_delivered", method, "completed")
    # An id that names no life (an earlier version's hook) is for a read of the run.
    # Nor is one of another run's or another outcome's hook.
    for message_id in ("finish:r1:completed", "finish:r1:completed:retry1",
                       "finish:r10:completed:abc", finish_message_id(state, "error", method)):
        assert delivery_entry_of_report(_report(state, method, message_id), 1) is None


def test_a_delivered_command_reports_more_deliveries_of_its_parent_agent() -> None:
    first, second = _life("r1", "first"), _life("r2", "second")
    other_name = ParentRef(agent=first.parent.agent, name="user-7")
    reports = [DeliveryReport(run_id=s.run_id, parent=parent, status="completed",
                              method="on_done",
                              message_id=finish_message_id(s, "completed", "on_done"))
               for s, parent in ((first, first.parent), (second, other_name))]
    alone = DeliveredCommand.of(reports[:1])
    # One report is the plain command, byte for byte: a parent that predates `more` reads it.
    assert alone.model_dump_json() == json.dumps(
        {"type": "delivered", **msgspec.to_builtins(dict(reports[0]))}, separators=(",", ":"))
    assert alone.reports() == [alone]
    both = DeliveredCommand.of(reports)
    written = json.loads(both.model_dump_json())
    assert written["run_id"] == "r1" and [m["run_id"] for m in written["more"]] == ["r2"]
    read = parse_command("delivered", written)
    assert read == both
    assert [(r.run_id, r.parent, r.more) for r in read.reports()] == [
        ("r1", first.parent, []), ("r2", other_name, [])]
    assert all(isinstance(r, DeliveredCommand) for r in read.reports())
    # Each is the report it would be alone: the same ledger entry.
    assert [delivery_entry_of_report(r, 5) for r in read.reports()] == [
        delivery_entry_of_report(DeliveredCommand.of([report]), 5) for report in reports]


def test_a_delivered_command_refuses_reports_past_its_parent_agent() -> None:
    report = {"run_id": "r2", "parent": {"agent": "Stranger", "name": "user-42"},
              "status": "completed", "method": "on_done", "message_id": "finish:r2:completed:x"}
    own = {"run_id": "r1", "parent": PARENT, "status": "completed", "method": "on_done",
           "message_id": "finish:r1:completed:x"}
    with pytest.raises(ValidationError, match="every report names a parent of agent "
                                              "'Assistant', not 'Stranger'"):
        parse_command("delivered", {**own, "more": [report]})
    with pytest.raises(ValidationError, match=r"more\.0\.more"):  # one level: no `more` in more
        parse_command("delivered", {**own, "more": [{**own, "more": []}]})
    with pytest.raises(ValidationError, match="at most 255 items"):
        parse_command("delivered", {**own, "more": [own] * MAX_DELIVERY_REPORTS})
    assert len(parse_command("delivered", {**own, "more": [own] * 255}).reports()) == 256


def test_the_fold_takes_a_ledger_entry_of_its_own_life_only() -> None:
    first, second = _life("r1", "first"), _life("r1", "second")
    late = delivery_entry_of_report(
        _report(first, "on_done", finish_message_id(first, "completed", "on_done")), 5)
    ignored = evolve(second, late)
    assert not ignored.applied and not ignored.state.finish_delivered("completed", "on_done")
    assert "earlier life" in ignored.note
    assert evolve(first, late).state.finish_delivered("completed", "on_done")
    # Entries whose ids name no life (written before runs had one) count for any.
    older = msgspec.structs.replace(late, event_id="r1:finish_delivered:on_done:completed")
    unknown = msgspec.structs.replace(late, event_id="r1::finish_delivered:on_done:completed")
    for entry in (older, unknown):
        assert evolve(second, entry).state.finish_delivered("completed", "on_done")


def test_a_run_request_after_a_rejection_or_a_clear_names_it() -> None:
    assert run_message_id("r1") == "run:r1"
    assert run_message_id("r1", vacated_at=42) == "run:r1:42"
    # Two parents may use one run id (`agent-tool:call_0_0`): their requests are two.
    parent = ParentRef(agent="Lead", name="agent-tool:call_0_0")
    assert run_message_id("agent-tool:call_0_0", parent=parent) == \
        "run:Lead/agent-tool:call_0_0/agent-tool:call_0_0"
    assert run_message_id("r1", 42, parent) == "run:Lead/agent-tool:call_0_0/r1:42"


@pytest.mark.parametrize("values", [
    {"fraction": 0.25, "message": "reading", "phase": "working", "milestone": None,
     "data": {"t": 1733140000.1234, "i": 1}},
    {"fraction": 1, "message": None, "phase": None, "milestone": "done", "data": None},
    {"fraction": 0, "message": "ünïcødé ✓ \"quoted\"\n", "phase": "", "milestone": None,
     "data": [1, 2.5, None, True, "x", {"nested": {"deep": [()]}}]},
    {"fraction": None, "message": None, "phase": None, "milestone": "half-way",
     "data": {"when": datetime.datetime(2026, 12, 2, 15, 0, tzinfo=datetime.UTC),
              "big": 2 ** 70, "tiny": 1e-300, "tuple": (1, "a")}},
    {"fraction": 1e-9, "message": "m" * 2000, "phase": "p", "milestone": None, "data": "text"},
], ids=["typical", "int-fraction", "unicode-and-nesting", "non-json-natives", "edges"])
def test_a_progress_signal_is_sent_as_the_model_would_serialise_it(values: dict[str, Any]) -> None:
    check_progress(values["fraction"], values["milestone"], values["data"], values["message"],
                   values["phase"])  # what the runner checked when the child reported it
    parent = ParentRef(**PARENT)
    sent = progress_signal_json("r1", parent, at=1_733_140_000_000, **values)

    model = ProgressSignal(run_id="r1", parent=parent, at=1_733_140_000_000, **values)
    assert sent == model.model_dump_json().encode()
    assert ProgressSignal.model_validate_json(sent) == ProgressSignal.model_validate_json(
        model.model_dump_json())


class Source(BaseModel):
    url: str
    seen: datetime.datetime


def test_a_milestone_carries_the_childs_data_as_json_ready_values() -> None:
    seen = datetime.datetime(2026, 12, 2, 15, 0, tzinfo=datetime.UTC)
    fraction, data = check_progress(1, "half-way", {
        "source": Source(url="https://example.org", seen=seen), "pair": (1, "a"),
        "big": 2 ** 70})

    assert fraction == 1.0 and isinstance(fraction, float)
    assert data == {"source": {"url": "https://example.org", "seen": "2026-12-02T15:00:00Z"},
                    "pair": [1, "a"], "big": 2 ** 70}
    run = RunEvents("r1", ParentRef(**PARENT))
    event = run.make(RunMilestone, sequence=0, name="half-way", fraction=fraction, data=data)
    assert decode_event(encode_event(event)) == event


@pytest.mark.parametrize(("step", "error", "match"), [
    (["not", "a", "dict"], TypeError, "a step is a dict, not list"),
    ({"handle": object()}, ValueError, "a step must be JSON-serialisable"),
])
async def test_a_step_that_cannot_be_recorded_is_refused_where_the_child_records_it(
        step: Any, error: type[Exception], match: str) -> None:
    ctx = RunContext(run_id="r1", parent=ParentRef(**PARENT), agent_type="Researcher",
                     attempt=1, recorder=None)

    with pytest.raises(error, match=match):
        await ctx.record_step(0, step)


def _hooked_states() -> list[Any]:
    """Detached runs' states at each kind of outcome, with every option and field set."""
    options = DetachedOptions(on_finish="on_done", notify=NotifyOptions(source="tool ✓"),
                              on_milestones=MilestoneNotifyOptions(names=["half"], mode="react"),
                              max_budget_ms=60_000, no_progress_budget_ms=float("inf"))
    states = []
    for ending in ("completed", "failed", "interrupted", "aborted"):
        run = RunEvents(f"r-{ending}", ParentRef(**PARENT))
        requested = run.requested(detached=options, parent_tool_call_id="call_1",
                                  display_order=2, display="Research \"quoted\"")
        if ending == "completed":
            outcome = run.completed("done", output={"n": [1, 2.5, None]})
        elif ending == "failed":
            outcome = run.failed("boom")
        elif ending == "interrupted":
            outcome = run.interrupted("no-progress", child_still_running=False)
        else:
            outcome = run.make(ev.RunAborted, error="cancelled: by hand", cause="cancel")
        states.append(fold([requested, run.running(), outcome]))
    run = RunEvents("r-plain", ParentRef(**PARENT))
    states.append(fold([run.requested(detached=DetachedOptions()), run.running(),
                        run.completed("")]))
    return states


@pytest.mark.parametrize("state", _hooked_states(), ids=lambda s: s.run_id)
def test_a_hook_message_is_sent_as_the_model_would_serialise_it(state: Any) -> None:
    result = LifecycleResult.of(state)

    sent = hook_message_json("on_done", state, result)

    model = HookMessage(method="on_done", run=RunInfo.of(state), result=result)
    assert sent == model.model_dump_json().encode()
    assert HookMessage.model_validate_json(sent) == model
