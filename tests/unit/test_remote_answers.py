"""How a human's answer to a paused remote child becomes what the remote takes: MCP
elicitation results per form, A2A message parts; which forms a run's log says it
answered; and how an input becomes a message."""

from types import SimpleNamespace

from a2a.types import Part
from google.protobuf.json_format import MessageToDict
from pydantic import BaseModel

from tether.domain.recorded import Resumption
from tether.remote.a2a_agent import _answer, _parts, answered_questions
from tether.remote.mcp_tool import _responses, answered_keys

APPROVE = {"params": {"message": "Approve?", "requestedSchema": {
    "type": "object", "properties": {"approve": {"type": "boolean"}}}}}
OUTPUT = {"params": {"message": "Output?", "requestedSchema": {
    "type": "object", "properties": {"output": {"type": "string"}}}}}
FORM = {"params": {"message": "Who?", "requestedSchema": {
    "type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}}}


def test_approvals_accept_yes_no_forms_and_rejections_decline_any():
    requests = {"a": APPROVE, "b": APPROVE, "c": FORM}
    assert _responses({"approvals": ["a"], "rejections": ["b", "c"]}, requests) == {
        "a": {"action": "accept", "content": {"approve": True}},
        "b": {"action": "decline"}, "c": {"action": "decline"}}


def test_outputs_fill_forms_and_human_input_the_only_text_form():
    assert _responses({"tool_outputs": {"c": {"name": "Ada", "age": 36}, "o": 7}},
                      {"c": FORM, "o": OUTPUT}) == {
        "c": {"action": "accept", "content": {"name": "Ada", "age": 36}},
        "o": {"action": "accept", "content": {"output": "7"}}}
    assert _responses({"human_input": "yes please"}, {"o": OUTPUT}) == {
        "o": {"action": "accept", "content": {"output": "yes please"}}}
    # Text cannot say which of two forms it answers, nor fill a form of two fields.
    assert _responses({"human_input": "x"}, {"o": OUTPUT, "p": OUTPUT}) == {}
    assert _responses({"human_input": "x"}, {"c": FORM}) == {}


def test_the_answered_forms_are_the_keys_the_answers_recorded():
    def history(steps, *decisions):
        return SimpleNamespace(steps=steps, resumptions=[
            Resumption(pause_id=f"p{n}", decisions=d, at=n) for n, d in enumerate(decisions)])

    assert answered_keys(None) == set()
    task = {"kind": "mcp.task", "task_id": "t"}
    assert answered_keys(history({0: task}, {"approvals": ["a"]})) == set(), "not sent"
    assert answered_keys(history(
        {0: task, 1: {"kind": "mcp.answer", "pause": 0, "keys": ["a"]},
         2: {"kind": "mcp.answer", "pause": 1, "keys": ["b", "c"]}},
        {"approvals": ["a"]}, {"human_input": "x"})) == {"a", "b", "c"}
    # Recorded without its keys (an earlier Tether): the keys its decisions name.
    assert answered_keys(history(
        {0: task, 1: {"kind": "mcp.answer", "pause": 0}},
        {"approvals": ["a"], "rejections": ["b"], "tool_outputs": {"c": 1},
         "human_input": "x"})) == {"a", "b", "c"}


def test_an_a2a_run_knows_the_questions_it_answered_by_their_message_ids():
    def history(steps):
        return SimpleNamespace(steps=steps, resumptions=[])

    task = {"kind": "a2a.task", "url": "u", "task_id": "t", "context_id": "c"}
    assert answered_questions(None) == set()
    assert answered_questions(history({0: task})) == set()
    assert answered_questions(history({
        0: task, 1: {"kind": "a2a.answer", "pause": 0, "question": "m1"},
        2: {"kind": "a2a.answer", "pause": 1, "question": "m2"}})) == {"m1", "m2"}
    # Recorded without one (an earlier Tether; a question without an id): none known.
    assert answered_questions(history({0: task, 1: {"kind": "a2a.answer", "pause": 0}})) \
        == set()


def test_an_a2a_answer_is_the_text_and_the_items_output():
    parts = _answer({"human_input": "French", "tool_outputs": {"a2a-question-0": {"k": 1}}},
                    "a2a-question-0")
    assert [MessageToDict(part) for part in parts] == [{"text": "French"},
                                                       {"data": {"k": 1.0}}]
    assert _answer({}, "a2a-question-0") == []


def test_an_input_of_one_string_is_text_and_any_other_data():
    class Query(BaseModel):
        query: str

    class Pair(BaseModel):
        a: str
        b: int

    assert _parts(Query(query="HTTP/3")) == [Part(text="HTTP/3")]
    assert MessageToDict(_parts(Pair(a="x", b=2))[0]) == {"data": {"a": "x", "b": 2.0}}
