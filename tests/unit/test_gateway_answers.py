"""The gateway's checks of what a caller sends: a paused run's answer (A2A and MCP), an
A2A message's parts as a run's input, a push notification URL, the shape of an A2A
request's params. Whatever would resume a
run with no decision, drop a part, or be retried for ever is refused, naming the field."""

import pytest
from a2a.types import Part, SendMessageRequest
from google.protobuf.json_format import ParseDict
from google.protobuf.struct_pb2 import Value
from mcp.shared.exceptions import MCPError
from mcp_types import INVALID_PARAMS

from tether.contract.messages import RunSnapshot
from tether.domain.events import ParentRef
from tether.gateway.a2a_parts import answer_of, input_of
from tether.gateway.a2a_push import url_problem
from tether.gateway.a2a_requests import params_problem
from tether.gateway.answers import InvalidAnswer, decisions_of, require_some, waiting_words
from tether.gateway.mcp_tools import answers_of

PENDING = [{"tool_call_id": "publish", "tool_name": "publish", "input": {},
            "reason": "approval"},
           {"tool_call_id": "call-2", "tool_name": "search", "input": {}, "reason": "output"}]


def data(value) -> Part:
    return Part(data=ParseDict(value, Value()))


def test_an_answer_of_ids_the_run_waits_on_is_its_decisions():
    decisions = decisions_of({"approvals": ["publish"], "tool_outputs": {"call-2": [1]},
                              "human_input": "go"}, PENDING)
    assert decisions.as_continue() == {"approvals": ["publish"], "rejections": [],
                                       "tool_outputs": {"call-2": [1]}, "human_input": "go"}


@pytest.mark.parametrize(("answers", "named"), [
    ({"approvals": "publish"}, "approvals: must be a list"),
    ({"approvals": [1]}, "approvals[0]: must be a tool call id"),
    ({"approvals": ["deploy"]}, "approvals[0]: the task waits on no tool call 'deploy'"),
    ({"rejections": {"publish": True}}, "rejections: must be a list"),
    ({"approvals": ["publish"], "rejections": ["publish"]}, "approved and rejected"),
    ({"tool_outputs": ["x"]}, "tool_outputs: must be an object"),
    ({"tool_outputs": {"deploy": "x"}}, "tool_outputs.deploy: the task waits on no"),
    ({"human_input": 3}, "human_input: must be a string"),
    ({"approval": ["publish"]}, "approval: not an answer"),
])
def test_a_malformed_answer_is_refused_naming_the_field(answers, named):
    with pytest.raises(InvalidAnswer, match=named.replace("[", r"\[").replace("]", r"\]")):
        decisions_of(answers, PENDING, where="parts[0].data.")


@pytest.mark.parametrize("answers", [{}, {"approvals": []}, {"human_input": "  "},
                                     {"tool_outputs": {}}])
def test_an_answer_that_answers_nothing_is_refused_saying_what_the_run_waits_for(answers):
    with pytest.raises(InvalidAnswer) as refused:
        require_some(decisions_of(answers, PENDING), "r1", "waiting_for_human", PENDING)
    assert str(refused.value) == ("the answer to task r1 answers nothing: it is waiting for "
                                  "a human's approval of publish and the output of search")


def test_what_a_run_waits_for_in_words():
    assert waiting_words("waiting_for_human", PENDING[:1]) == "a human's approval of publish"
    assert waiting_words("waiting_for_tools", PENDING[1:]) == "the output of search"
    assert waiting_words("waiting_for_human", []) == "a human's input"
    assert waiting_words("waiting_for_tools", []) == "the output of its tool calls"
    two = [dict(PENDING[0], tool_call_id="a", tool_name="mail"), *PENDING]
    assert waiting_words("waiting_for_human", two).startswith(
        "a human's approval of mail and publish")


@pytest.mark.parametrize(("parts", "named"), [
    ([data({"approvals": "publish"})], r"parts\[0\].data.approvals: must be a list"),
    ([data(["publish"])], r"parts\[0\].data: must be an object"),
    ([Part(url="https://example.com/a")], r"parts\[0\]: a URL part is no answer"),
    ([Part(raw=b"x")], r"parts\[0\]: a raw bytes part is no answer"),
    ([Part()], r"parts\[0\]: an unknown part is no answer"),
    ([data({}), data({})], r"parts\[1\]: a second data part"),
    ([data({"human_input": "a"}), Part(text="b")], "both text and"),
])
def test_an_a2a_answer_of_the_wrong_parts_is_refused_naming_the_part(parts, named):
    with pytest.raises(InvalidAnswer, match=named):
        answer_of(parts, PENDING)


def test_an_a2a_answer_in_text_is_the_humans_words_and_empty_text_is_nothing():
    assert answer_of([Part(text="ship it")], PENDING).human_input == "ship it"
    assert answer_of([Part(text="")], PENDING).empty


@pytest.mark.parametrize(("parts", "text_field", "named"), [
    ([Part(url="https://example.com/a")], "text", r"parts\[0\]: a URL part is not taken"),
    ([data({"query": "x"}), Part(text="more")], "query",
     r"parts\[1\]: a text part beside the data part at parts\[0\]"),
    ([Part(text="x"), Part(raw=b"y")], "text", r"parts\[1\]: a raw bytes part"),
    ([Part(text="x")], None, r"parts\[0\]: a text part is not taken"),
    ([], "text", "message.parts: empty"),
])
def test_an_a2a_input_with_a_part_not_taken_is_refused_saying_what_the_agent_takes(
        parts, text_field, named):
    with pytest.raises(InvalidAnswer, match=named) as refused:
        input_of(parts, "Researcher", text_field)
    assert "Researcher takes one data part with its input" in str(refused.value)


def test_an_a2a_input_is_the_data_part_or_the_text_as_the_one_field():
    assert input_of([data({"query": "x"})], "Researcher", "query") == {"query": "x"}
    assert input_of([Part(text="a"), Part(text="b")], "Researcher", "query") == {"query": "ab"}


@pytest.mark.parametrize(("url", "why"), [
    ("http://", "names no valid host"),
    ("http://[::1", "is not a URL"),
    ("http://exa mple.com/x", "a space or a control character"),
    ("http://example.com:99999/x", "outside 1..65535"),
    ("ftp://example.com/x", "is http(s)"),
    ("http://example.com/\r\nx", "control character"),
])
def test_a_push_url_that_can_never_be_sent_to_says_why(url, why):
    assert why in (url_problem(url) or "")


@pytest.mark.parametrize("url", ["HTTP://example.com/x", "https://[::1]:8443/hook",
                                 "http://127.0.0.1:9/hook"])
def test_a_push_url_that_can_be_tried_passes(url):
    assert url_problem(url) is None


def _waiting(pending) -> RunSnapshot:
    return RunSnapshot(run_id="mcp-1", parent=ParentRef(agent="Gateway", name="desktop"),
                       agent_type="Asker", status="running", detached=True, requested_at=0,
                       waiting_for="waiting_for_human", pending=pending)


def test_an_mcp_form_declined_rejects_its_call_approval_or_output():
    decisions = answers_of(_waiting(PENDING), {"publish": {"action": "decline"},
                                               "call-2": {"action": "decline"}})
    assert decisions.as_continue() == {"approvals": [], "rejections": ["publish", "call-2"],
                                       "tool_outputs": {}, "human_input": None}


def test_an_mcp_form_cancelled_refuses_the_whole_update_saying_the_task_still_asks():
    with pytest.raises(MCPError) as refused:
        answers_of(_waiting(PENDING), {"publish": {"action": "accept",
                                                   "content": {"approve": True}},
                                       "call-2": {"action": "cancel"}})
    assert refused.value.error.code == INVALID_PARAMS
    assert refused.value.error.message.startswith(
        "inputResponses.call-2.action: cancel answers nothing; task mcp-1 still waits for "
        "a human's approval of publish and the output of search")


@pytest.mark.parametrize(("params", "named"), [
    ([], "params: must be an object (a SendMessageRequest), not a list"),
    ({"message": "hi"}, "params.message: must be an object, not a string"),
    ({"message": {"parts": [{"text": "a"}, {"text": 3}]}},
     "params.message.parts[1].text: must be a string, not a number"),
    ({"message": {"metadata": []}}, "params.message.metadata: must be an object, not a list"),
    ({"configuration": {"returnImmediately": "yes"}},
     "params.configuration.returnImmediately: must be true or false, not a string"),
])
def test_a2a_params_of_the_wrong_shape_are_named(params, named):
    assert params_problem(params, SendMessageRequest.DESCRIPTOR) == named

