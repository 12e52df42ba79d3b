"""The AsyncAPI document of the contract and its docs page: complete, and not drifted."""

import json
from pathlib import Path

from tether.domain.records import Record, pydantic_model
from tether.generate import asyncapi, schemas

REPO = Path(__file__).resolve().parents[2]


def test_the_checked_in_page_renders_the_document() -> None:
    assert asyncapi.main(["--check", "--page", str(REPO / asyncapi.DOCS_PAGE)]) == 0, \
        "run `make schemas` and commit the result"


def test_a_drifted_page_is_reported(tmp_path: Path, capsys) -> None:
    page = tmp_path / "contract.md"
    assert asyncapi.main(["--write", "--page", str(page)]) == 0
    assert asyncapi.main(["--check", "--page", str(page)]) == 0
    page.write_text(page.read_text().replace("`WorkItem`", "`Work`"))
    assert asyncapi.main(["--check", "--page", str(page)]) == 1
    assert "run `make schemas`" in capsys.readouterr().err


def test_the_checked_in_document_is_the_generated_one() -> None:
    checked_in = json.loads((REPO / "schemas" / "asyncapi.json").read_text())
    assert checked_in == asyncapi.generate()
    assert checked_in["asyncapi"] == "3.0.0"


def operations() -> list[tuple[str, str, str]]:
    """(subject, send|receive, the payload schema's name) of every operation."""
    document = asyncapi.generate()
    found = []
    for operation in document["operations"].values():
        channel = document["channels"][asyncapi._unquote(operation["channel"]["$ref"])]
        message_ref = next(iter(channel["messages"].values()))["$ref"]
        message = document["components"]["messages"][asyncapi._unquote(message_ref)]
        payload = asyncapi._unquote(message["payload"]["$ref"])
        assert payload in document["components"]["schemas"]
        found.append((channel["address"], operation["action"], payload))
    return found


def test_every_subject_and_stream_of_the_contract_is_declared_with_its_payload() -> None:
    declared = operations()
    replies = {payload for subject, action, payload in declared if subject == "{reply_to}"}
    found = {(subject, action): payload for subject, action, payload in declared
             if subject != "{reply_to}"}
    for kind, model in (("run", "RunCommand"), ("cancel", "CancelCommand"),
                        ("clear", "ClearCommand"), ("continue", "ContinueCommand"),
                        ("delivered", "DeliveredCommand")):
        for subject in (f"tether.cmd.{kind}", f"tether.cmd.{kind}.{{parent_agent}}.{{parent_name}}"):
            assert found[(subject, "send")] == found[(subject, "receive")] == model
    for kind, query, reply in (("inspect", "InspectQuery", "InspectReply"),
                               ("list", "ListQuery", "ListReply"),
                               ("has_run", "HasRunQuery", "HasRunReply")):
        assert found[(f"tether.rpc.{kind}", "receive")] == query
        assert found[(f"tether.rpc.{kind}.*.*", "receive")] == query
        assert found[(f"tether.rpc.{kind}.{{parent_agent}}.{{parent_name}}", "send")] == query
        assert reply in replies
    assert {(subject, action) for subject, action in found} >= {
        ("tether.evt.{parent_agent}.{parent_name}.{run_id}", "send"),
        ("tether.evt.>", "receive"),
        ("tether.live.evt.{parent_agent}.{parent_name}.{run_id}", "send"),
        ("tether.cmd.dead_letter", "send"),
        ("tether.ctl.awaiter.{parent_agent}.{parent_name}.{run_id}", "send"),
        ("tether.ctl.awaiter.{parent_agent}.{parent_name}.{run_id}", "receive")}
    assert found[("tether.progress.{parent_agent}.{parent_name}.{run_id}", "send")] == \
        "ProgressSignal"
    assert found[("tether.work.{agent_type}", "send")] == "WorkItem"
    assert found[("tether.work.{agent_type}", "receive")] == "WorkItem"
    assert found[("tether.hook.{parent_agent}.{method}", "send")] == "HookMessage"
    assert found[("tether.chat.{parent_agent}.{parent_name}", "send")] == "ChatMessage"
    assert found[("tether.ctl.cancel.{agent_type}", "receive")] == "CancelSignal"
    assert found[("tether.ctl.inspect.{agent_type}", "receive")] == "ChildInspectRequest"
    assert found[("tether.obs.{parent_agent}.{parent_name}.agent_tool.{event}", "send")] == \
        "ObservabilityEvent"
    assert {"CancelReply", "ChildInspectReply"} <= replies


def test_each_stream_and_message_id_rule_is_stated() -> None:
    document = asyncapi.generate()
    text = " ".join(c.get("description", "") for c in document["channels"].values())
    for stream in ("TETHER_CMD", "TETHER_EVENTS", "TETHER_PROGRESS", "TETHER_WORK",
                   "TETHER_HOOKS", "TETHER_CHAT"):
        assert f"Stream `{stream}`" in text
    for rule in ("`run:<parent_agent>/<parent_name>/<run_id>`", "`work:<run_id>:<why>:<dispatch>:<incarnation>`",
                 "`finish:<run_id>:<status>:<incarnation>`", "`detached-ms:",
                 "`delivered:<parent_agent>.<parent_name>:<method>:", "the event's `event_id`", "`Tether-Error`"):
        assert rule in text


def test_every_message_model_has_a_json_schema() -> None:
    generated = schemas.generate()
    for cls in schemas.MESSAGE_CLASSES:
        document = generated[f"messages/{cls.__name__}.json"]
        assert document["$id"] == f"messages/{cls.__name__}.json"
        model = pydantic_model(cls) if issubclass(cls, Record) else cls
        assert set(document["properties"]) == set(model.model_fields)
