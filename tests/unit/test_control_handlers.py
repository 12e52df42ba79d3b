"""The faststream handlers of the queries and the child-runners' control subjects, in
memory (`TestNatsBroker`); tests/integration covers them against a real server."""

import json

import msgspec
import pytest
from faststream.nats import TestNatsBroker
from nats.aio.client import Client as NATS

from tether.adapters.control import control_broker
from tether.agent_registry import AgentRegistry
from tether.child.agent import ChildAgent
from tether.child.runner import ChildRunner, runner_control
from tether.child.work import RunnerEnvironment
from tether.config import Settings
from tether.contract.messages import ChildInspectReply, HasRunReply, InspectReply, ListReply
from tether.domain.events import ParentRef
from tether.domain.fold import fold
from tether.log import get_logger
from tether.parent.queries import ParentQueries
from tether.testing import InMemoryEventLog, RunEvents

SETTINGS = Settings()
SUBJECTS = SETTINGS.subjects
PARENT = ParentRef(agent="Assistant", name="user-1")


class _History:
    def __init__(self, state) -> None:
        self.state = state


class _Log:
    """`EventLog.read_run` and `run_ids` over runs kept in memory."""

    def __init__(self, *runs: RunEvents) -> None:
        self._states = {(run.parent, run.run_id): fold([run.requested(), run.running()])
                        for run in runs}
        self.reads: list[str] = []

    async def read_run(self, parent: ParentRef, run_id: str) -> _History:
        self.reads.append(run_id)
        return _History(self._states.get((parent, run_id)))

    async def run_ids(self, parent: ParentRef) -> list[str]:
        return sorted(run_id for owner, run_id in self._states if owner == parent)


class _Pool:
    async def fetch(self, *args):
        raise ConnectionError("the projection database is away")


@pytest.fixture
def log() -> _Log:
    return _Log(RunEvents("r1", PARENT))


@pytest.fixture
async def queries(log):
    handlers = ParentQueries(log, _Pool(), "tether", get_logger(service="parent-test"))
    broker = control_broker(SETTINGS, "test", middlewares=[handlers.middleware()])
    handlers.subscribe(broker, SUBJECTS)
    async with TestNatsBroker(broker) as test_broker:
        yield test_broker


def query(run_id: str = "r1", parent: ParentRef = PARENT) -> bytes:
    return json.dumps({"run_id": run_id, "parent": msgspec.to_builtins(parent)}).encode()


async def test_inspect_answers_the_run_on_either_subject_form(queries):
    for subject in (SUBJECTS.rpc("inspect"), SUBJECTS.rpc_for("inspect", PARENT)):
        reply = InspectReply.model_validate_json((await queries.request(query(), subject)).body)
        assert reply.error is None
        assert reply.run is not None and reply.run.run_id == "r1"
        assert reply.run.status == "running"


async def test_has_run_is_false_for_a_run_of_another_parent(queries):
    stranger = ParentRef(agent="Assistant", name="user-2")
    answer = await queries.request(query(parent=stranger), SUBJECTS.rpc("has_run"))
    assert HasRunReply.model_validate_json(answer.body) == HasRunReply(has_run=False)
    answer = await queries.request(query(), SUBJECTS.rpc("has_run"))
    assert HasRunReply.model_validate_json(answer.body) == HasRunReply(has_run=True)


@pytest.mark.parametrize("body", [b'{"run_id": 1}', b"not json", b"[1]",
                                  (b'{"type": "list", "run_id": "r1", "parent": '
                                   b'{"agent": "Assistant", "name": "user-1"}}')])
async def test_a_request_that_is_no_query_gets_invalid_request_and_reads_nothing(queries, log,
                                                                                  body):
    reply = InspectReply.model_validate_json(
        (await queries.request(body, SUBJECTS.rpc("inspect"))).body)
    assert reply.run is None
    assert reply.error is not None and reply.error.startswith("invalid request: ")
    assert log.reads == []


async def test_a_per_parent_subject_must_name_the_payloads_parent(queries, log):
    other = ParentRef(agent="Intruder", name="user-1")
    answer = await queries.request(query(), SUBJECTS.rpc_for("inspect", other))
    reply = InspectReply.model_validate_json(answer.body)
    assert reply.run is None
    assert reply.error == ("invalid request: the payload's parent Assistant/user-1 differs "
                           "from the subject's Intruder/user-1")
    assert log.reads == []


async def test_a_failing_query_answers_with_the_error_in_its_own_reply_shape(queries):
    body = json.dumps({"parent": msgspec.to_builtins(PARENT)}).encode()
    answer = await queries.request(body, SUBJECTS.rpc_for("list", PARENT))
    assert json.loads(answer.body) == {"runs": [], "error": "ConnectionError: the projection "
                                                            "database is away"}
    assert ListReply.model_validate_json(answer.body).runs == []


class Researcher(ChildAgent):
    pass


@pytest.fixture
async def runner():
    env = RunnerEnvironment(log=InMemoryEventLog(SETTINGS.subjects), settings=SETTINGS,
                            runner_id="runner-1", cancel_grace_s=0.2)
    child_runner = ChildRunner(NATS(), env, AgentRegistry([Researcher]),
                               control=runner_control(SETTINGS), pulls={})
    child_runner.subscribe_control()
    async with TestNatsBroker(child_runner.control) as test_broker:
        yield test_broker


async def test_every_runner_answers_a_child_inspect_and_only_a_holder_has_a_record(runner):
    body = json.dumps({"run_id": "r1", "parent": msgspec.to_builtins(PARENT)}).encode()
    answer = await runner.request(body, SUBJECTS.inspect_child("Researcher"))
    assert ChildInspectReply.model_validate_json(answer.body) == ChildInspectReply(record=None)


async def test_a_cancel_for_a_run_the_runner_does_not_hold_is_not_answered(runner):
    signal = json.dumps({"run_id": "r1", "parent": msgspec.to_builtins(PARENT)}).encode()
    answer = await runner.request(signal, SUBJECTS.cancel_signal("Researcher"))
    assert answer.body == b""  # `no_reply`: TestNatsBroker hands back an empty response
