"""Golden events: one stored JSON file per event type and schema version ever written.

The log keeps old shapes for ever, so every version must keep decoding (through the
upcasters) to the current model. A new version without a golden file fails here.
"""

import copy
import json
import re
from pathlib import Path
from typing import Any, get_args, get_type_hints

import pytest
from pydantic import TypeAdapter, ValidationError

from tether.contract.codec import EventDecodeError, InvalidEvent, decode_event, encode_event
from tether.domain.detached_options import DetachedOptions
from tether.domain.events import (
    CURRENT_VERSIONS,
    EVENT_CLASSES,
    ParentRef,
    RunInterrupted,
    RunMilestone,
    RunMilestoneData,
    RunRequested,
    data_class,
)
from tether.domain.fold import evolve
from tether.domain.ids import Identifier, InvalidIdentifier, nested_parent_name
from tether.domain.records import Record
from tether.domain.upcasting import registered_upcasters, upcast

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "events"
NAME = re.compile(
    r"^(?P<type>run\.[a-z_]+)\.v(?P<version>[1-9][0-9]*)(?:\.(?P<variant>[a-z0-9-]+))?\.json$"
)
CLASS_OF = {cls.type: cls for cls in EVENT_CLASSES}

GOLDEN_FILES = sorted(GOLDEN.glob("*.json"))


def load(name: str) -> dict[str, Any]:
    return json.loads((GOLDEN / name).read_text())


def type_and_version(path: Path) -> tuple[str, int]:
    match = NAME.fullmatch(path.name)
    assert match, f"{path.name} is not named <type>.v<N>[.<variant>].json"
    return match["type"], int(match["version"])


def test_there_are_golden_files() -> None:
    assert len(GOLDEN_FILES) >= len(CURRENT_VERSIONS)


@pytest.mark.parametrize("path", GOLDEN_FILES, ids=lambda p: p.name)
def test_golden_file_name_matches_its_content(path: Path) -> None:
    event_type, version = type_and_version(path)
    payload = json.loads(path.read_text())

    assert (payload["type"], payload["schema_version"]) == (event_type, version)


@pytest.mark.parametrize("path", GOLDEN_FILES, ids=lambda p: p.name)
def test_golden_event_decodes_to_the_current_model(path: Path) -> None:
    event_type, _ = type_and_version(path)
    raw = path.read_bytes()

    event = decode_event(raw)

    assert type(event) is CLASS_OF[event_type]
    assert event.schema_version == CURRENT_VERSIONS[event_type]
    assert decode_event(raw.decode()) == event
    assert decode_event(json.loads(raw)) == event


@pytest.mark.parametrize("path", GOLDEN_FILES, ids=lambda p: p.name)
def test_golden_event_reencodes_and_decodes_stably(path: Path) -> None:
    event = decode_event(path.read_bytes())

    encoded = encode_event(event)

    assert decode_event(encoded) == event
    assert encode_event(decode_event(encoded)) == encoded


CURRENT_GOLDEN_FILES = [p for p in GOLDEN_FILES
                        if type_and_version(p)[1] == CURRENT_VERSIONS.get(type_and_version(p)[0])]


@pytest.mark.parametrize("path", CURRENT_GOLDEN_FILES, ids=lambda p: p.name)
def test_current_golden_file_is_exactly_what_the_codec_writes(path: Path) -> None:
    payload = json.loads(path.read_text())

    assert json.loads(encode_event(decode_event(payload))) == payload


@pytest.mark.parametrize("path", CURRENT_GOLDEN_FILES, ids=lambda p: p.name)
def test_current_golden_file_fills_every_data_field(path: Path) -> None:
    event_type, _ = type_and_version(path)
    data_model = data_class(CLASS_OF[event_type])
    data = json.loads(path.read_text())["data"]

    assert set(data) == set(data_model.__struct_fields__)
    assert [field for field, value in data.items() if value is None] == []


def test_every_version_of_every_event_type_has_a_golden_file() -> None:
    expected = {(event_type, version) for event_type, current in CURRENT_VERSIONS.items()
                for version in range(1, current + 1)}
    found = {type_and_version(path) for path in GOLDEN_FILES}

    assert sorted(expected - found) == [], "add a golden file for each new schema version"
    assert sorted(found - expected) == [], "a golden file for a type or version that does not exist"


def test_every_old_version_has_exactly_one_upcaster() -> None:
    old_versions = {(event_type, version) for event_type, current in CURRENT_VERSIONS.items()
                    for version in range(1, current)}

    assert set(registered_upcasters()) == old_versions


# --- the old shapes, field by field -----------------------------------------------------


def test_run_requested_v1_detached_is_upcast_to_options_and_the_v1_default_budgets() -> None:
    original = load("run.requested.v1.json")

    event = decode_event(original)

    assert isinstance(event, RunRequested)
    assert event.schema_version == 5
    assert (event.event_id, event.run_id, event.occurred_at) == (
        original["event_id"], original["run_id"], original["occurred_at"])
    assert (event.parent.agent, event.parent.name) == ("Assistant", "user-42")
    assert (event.correlation_id, event.causation_id) == (
        original["correlation_id"], original["causation_id"])
    data = event.data
    assert data.agent_type == "Importer"
    assert data.input == {"file": "s3://imports/2026-01/customers.csv"}
    assert (data.parent_tool_call_id, data.display_order, data.display) == (
        "call_Q1pz", 1, "Import customers")
    assert data.detached == DetachedOptions(on_finish="onImportDone")
    assert data.detached.notify is False
    assert data.detached.on_milestones is None
    assert data.detached.max_budget_ms is None
    assert data.detached.no_progress_budget_ms is None
    assert data.max_budget_ms == 24 * 60 * 60 * 1000
    assert data.no_progress_budget_ms == 60 * 60 * 1000


def test_run_requested_v1_awaited_is_upcast_to_no_options_and_no_budgets() -> None:
    original = load("run.requested.v1.awaited.json")

    event = decode_event(original)

    assert isinstance(event, RunRequested)
    assert event.schema_version == 5
    assert event.event_id == original["event_id"]
    data = event.data
    assert data.agent_type == "Researcher"
    assert data.input == {"query": "gRPC deadlines"}
    assert (data.parent_tool_call_id, data.display_order, data.display) == (
        "call_Zt7m", 0, "Research gRPC")
    assert data.detached is None
    assert data.max_budget_ms is None
    assert data.no_progress_budget_ms == 0


def test_run_requested_v2_is_upcast_owning_its_nested_runs_by_its_run_id_as_they_were() -> None:
    original = load("run.requested.v2.json")

    event = decode_event(original)

    assert isinstance(event, RunRequested)
    assert event.schema_version == 5
    assert event.data.nested_parent == original["run_id"]
    assert event.data.detached == decode_event(load("run.requested.v3.json")).data.detached
    assert evolve(None, event).state.as_parent() == ParentRef(agent="Researcher",
                                                             name=original["run_id"])


def test_run_requested_v3_is_upcast_with_no_token_or_cost_budget() -> None:
    original = load("run.requested.v3.json")

    event = decode_event(original)

    assert isinstance(event, RunRequested) and event.schema_version == 5
    assert (event.data.max_tokens, event.data.max_cost, event.data.budgets_above) == (
        None, None, [])
    assert event.data.started_by == decode_event(load("run.requested.v5.json")).data.started_by
    state = evolve(None, event).state
    assert (state.max_tokens, state.max_cost, state.budgets_above) == (None, None, ())


def test_run_requested_v4_is_upcast_as_no_fork() -> None:
    event = decode_event(load("run.requested.v4.json"))

    assert isinstance(event, RunRequested) and event.schema_version == 5
    assert event.data.fork is None
    assert evolve(None, event).state.forked_from is None


def test_a_fork_request_starts_with_what_its_original_had_recorded() -> None:
    event = decode_event(load("run.requested.v5.json"))

    state = evolve(None, event).state

    assert state.forked_from is not None and state.forked_from.at == "step:2"
    assert (state.forked_from.run.run_id, state.forked_from.seq) == ("run-5e1b7a00", 1841)
    assert sorted(state.steps) == [0, 1] and state.output_text == "Looking at QUIC streams. "
    assert [m.name for m in state.milestones] == ["sources-gathered"]
    assert [r.decisions for r in state.resumptions] == [{"approvals": ["call_2"]}]
    assert state.forked_from.overrides == {"instructions": "Cite the RFC for every claim."}


def test_a_run_requested_now_owns_its_nested_runs_by_a_name_of_its_whole_path() -> None:
    event = decode_event(load("run.requested.v5.json"))

    owner = evolve(None, event).state.as_parent()

    assert owner.agent == "Researcher"
    assert owner.name == nested_parent_name("Assistant", "user-42", event.run_id)
    assert owner.name.startswith(f"{event.run_id}:")


def test_run_interrupted_v1_is_upcast_with_the_child_no_longer_running() -> None:
    original = load("run.interrupted.v1.json")

    event = decode_event(original)

    assert isinstance(event, RunInterrupted)
    assert event.schema_version == 2
    assert (event.event_id, event.run_id, event.occurred_at) == (
        original["event_id"], original["run_id"], original["occurred_at"])
    assert event.data.reason == "recovery-deadline"
    assert event.data.error == "recovery did not reach the child within 5000 ms"
    assert event.data.child_still_running is False


@pytest.mark.parametrize("name", ["run.requested.v1.json", "run.interrupted.v1.json"])
def test_upcasting_leaves_the_stored_payload_untouched(name: str) -> None:
    original = load(name)
    kept = copy.deepcopy(original)

    upcast(original)

    assert original == kept


# --- what cannot be decoded -------------------------------------------------------------


def test_an_unknown_event_type_is_refused() -> None:
    payload = {**load("run.completed.v1.json"), "type": "run.teleported"}

    with pytest.raises(EventDecodeError, match=r"run.teleported") as error:
        decode_event(payload)

    assert error.value.kind == "unknown-type"


def test_an_event_without_a_type_is_refused() -> None:
    payload = load("run.completed.v1.json")
    del payload["type"]

    with pytest.raises(EventDecodeError) as error:
        decode_event(payload)

    assert error.value.kind == "unknown-type"


def test_a_version_newer_than_this_build_is_refused() -> None:
    current = CURRENT_VERSIONS["run.requested"]
    payload = {**load("run.requested.v3.json"), "schema_version": current + 1}

    with pytest.raises(EventDecodeError, match="newer") as error:
        decode_event(payload)

    assert error.value.kind == "unknown-version"


@pytest.mark.parametrize("version", [0, -1, "2", True, 1.5])
def test_a_version_that_is_not_a_positive_integer_is_refused(version: Any) -> None:
    payload = {**load("run.completed.v1.json"), "schema_version": version}

    with pytest.raises(EventDecodeError) as error:
        decode_event(payload)

    assert error.value.kind == "unknown-version"


@pytest.mark.parametrize(
    "raw", [b"{not json", b"\xff\xfe", "", b"[1, 2]", b'"run.completed"', b"null"],
    ids=["broken", "not-utf8", "empty", "array", "string", "null"],
)
def test_a_message_that_is_not_a_json_object_is_malformed(raw: bytes | str) -> None:
    with pytest.raises(EventDecodeError) as error:
        decode_event(raw)

    assert error.value.kind == "malformed"


INVALID_MILESTONES = [
    ("run_id", {"run_id": "run 7"}),
    ("run_id", {"run_id": "run-7\n"}),
    ("sequence", {"data": {**load("run.milestone.v1.json")["data"], "sequence": -1}}),
    ("fraction", {"data": {**load("run.milestone.v1.json")["data"], "fraction": 1.5}}),
    ("data", {"data": None}),
    ("unexpected", {"data": {**load("run.milestone.v1.json")["data"], "unexpected": 1}}),
]
INVALID_IDS = ["bad-run-id", "trailing-newline", "negative-sequence", "fraction-above-one",
               "no-data", "extra-field"]


@pytest.mark.parametrize(("field", "change"), INVALID_MILESTONES, ids=INVALID_IDS)
def test_a_payload_that_fails_the_model_is_invalid(field: str, change: dict[str, Any]) -> None:
    payload = {**load("run.milestone.v1.json"), **change}

    with pytest.raises(EventDecodeError, match=field) as error:
        decode_event(json.dumps(payload))

    assert error.value.kind == "invalid"


@pytest.mark.parametrize(("field", "change"), INVALID_MILESTONES[2:], ids=INVALID_IDS[2:])
def test_an_event_that_breaks_its_constraints_is_not_encoded(field: str,
                                                             change: dict[str, Any]) -> None:
    payload = {**load("run.milestone.v1.json"), **change}
    # Built from Python, as the services build events: its values are checked when it is
    # written, its identifiers already as it is built (below).
    data = payload["data"]
    if isinstance(data, dict) and "unexpected" not in data:
        data = RunMilestoneData(**data)
    event = RunMilestone(event_id=payload["event_id"], run_id=payload["run_id"],
                         parent=ParentRef(**payload["parent"]),
                         occurred_at=payload["occurred_at"], data=data)

    with pytest.raises(InvalidEvent, match=field) as error:
        encode_event(event)

    assert error.value.event_type == "run.milestone"


def _identifier_fields() -> list[tuple[str, tuple[str, ...]]]:
    """(golden file, path of a field the contract types as an identifier) for every such
    field of every current event, found from the records' annotations."""
    found = []

    def walk(cls: type, path: tuple[str, ...], value: Any, name: str) -> None:
        hints = get_type_hints(cls, include_extras=True)
        for field_name in cls.__struct_fields__:
            hint = hints[field_name]
            here = (*path, field_name)
            held = value.get(field_name)
            if ((Identifier in (hint, *get_args(hint)) and isinstance(held, str))
                    or (list[Identifier] in (hint, *get_args(hint)) and isinstance(held, list))):
                found.append((name, here))
            for inner in (hint, *get_args(hint)):
                if isinstance(inner, type) and issubclass(inner, Record) and isinstance(held, dict):
                    walk(inner, here, held, name)

    for path in CURRENT_GOLDEN_FILES:
        payload = json.loads(path.read_text())
        walk(CLASS_OF[payload["type"]], (), payload, path.name)
    return found


IDENTIFIER_FIELDS = _identifier_fields()


def test_the_golden_events_hold_every_kind_of_identifier_field() -> None:
    fields = {path[-1] for _, path in IDENTIFIER_FIELDS}

    assert {"run_id", "agent", "name", "agent_type", "on_finish", "names", "method",
            "nested_parent"} <= fields


def test_milestone_names_given_as_a_list_are_identifiers() -> None:
    payload = load("run.requested.v3.json")
    payload["data"]["detached"]["on_milestones"] = ["sources-gathered", "has space"]

    with pytest.raises(EventDecodeError, match="milestone name") as error:
        decode_event(json.dumps(payload))

    assert error.value.kind == "invalid"


@pytest.mark.parametrize(("name", "path"), IDENTIFIER_FIELDS,
                         ids=[f"{n}:{'.'.join(p)}" for n, p in IDENTIFIER_FIELDS])
@pytest.mark.parametrize("bad", ["has space", "a.b", "run-7\n", "*"])
def test_an_identifier_field_refuses_what_is_no_identifier(name: str, path: tuple[str, ...],
                                                          bad: str) -> None:
    payload = load(name)
    holder = payload
    for key in path[:-1]:
        holder = holder[key]
    holder[path[-1]] = [bad] if isinstance(holder[path[-1]], list) else bad

    with pytest.raises(EventDecodeError, match="invalid") as error:
        decode_event(json.dumps(payload))

    assert error.value.kind == "invalid"


def test_identifiers_are_checked_as_an_event_is_built() -> None:
    with pytest.raises(InvalidIdentifier, match="run_id"):
        RunMilestone(event_id="e1", run_id="run 7", parent=ParentRef(agent="A", name="u"),
                     occurred_at=1, data=RunMilestoneData(sequence=0, name="m"))
    with pytest.raises(InvalidIdentifier, match="milestone name"):
        RunMilestoneData(sequence=0, name="sources gathered")
    with pytest.raises(InvalidIdentifier, match="parent name"):
        ParentRef(agent="A", name="u.1")


# --- the pydantic mirrors: how messages that hold events check them, and the schemas ----


@pytest.mark.parametrize("path", CURRENT_GOLDEN_FILES, ids=lambda p: p.name)
def test_the_pydantic_mirror_reads_a_golden_event_as_the_codec_does(path: Path) -> None:
    event_type, _ = type_and_version(path)
    mirror = TypeAdapter(CLASS_OF[event_type])

    assert mirror.validate_json(path.read_bytes()) == decode_event(path.read_bytes())
    assert json.loads(mirror.dump_json(decode_event(path.read_bytes()))) == json.loads(
        path.read_bytes())


@pytest.mark.parametrize(("field", "change"), INVALID_MILESTONES, ids=INVALID_IDS)
def test_the_pydantic_mirror_refuses_what_the_codec_refuses(field: str,
                                                           change: dict[str, Any]) -> None:
    payload = {**load("run.milestone.v1.json"), **change}

    with pytest.raises(ValidationError, match=field):
        TypeAdapter(RunMilestone).validate_json(json.dumps(payload))


def test_an_old_shape_that_fails_the_model_after_upcasting_is_invalid() -> None:
    payload = load("run.requested.v1.json")
    payload["data"]["on_finish"] = "on.finish"

    with pytest.raises(EventDecodeError, match="on_finish") as error:
        decode_event(payload)

    assert error.value.kind == "invalid"
