"""Who words a detached run's chat message: the parent's class when it overrides a
formatter (a model parent), else the deployment's formatters."""

from tether.agent_registry import AgentRegistry
from tether.agents import AgentDefinition, ModelParent
from tether.contract.messages import LifecycleResult, MilestoneView, RunInfo
from tether.delivery.formatters import ByParentClass
from tether.domain.events import ParentRef


class Deployment:
    def format_detached_completion(self, run, result) -> str:
        return f"deployment: {result.summary}"

    def format_detached_milestone(self, run, milestone) -> str:
        return f"deployment: {milestone.name}"


class Terse(ModelParent):
    definition = AgentDefinition(id="terse", model="m")

    def format_detached_completion(self, run, result) -> str:
        return "" if result.status == "error" else f"done: {result.summary}"


class Plain(ModelParent):
    definition = AgentDefinition(id="plain", model="m")


def run_of(parent_agent: str) -> RunInfo:
    return RunInfo(run_id="agent-tool:c1", agent_type="Importer",
                   parent=ParentRef(agent=parent_agent, name="user-1"), requested_at=1)


def test_an_overriding_model_parent_words_its_messages_and_may_suppress_one() -> None:
    formatters = ByParentClass(AgentRegistry([Terse, Plain]), Deployment())
    done = LifecycleResult(status="completed", summary="20 rows")
    assert formatters.format_detached_completion(run_of("Terse"), done) == "done: 20 rows"
    failed = LifecycleResult(status="error", error="boom")
    assert formatters.format_detached_completion(run_of("Terse"), failed) == ""
    # Not overridden: the deployment's, as for a parent that is no class at all.
    milestone = MilestoneView(sequence=0, name="half", at=1)
    assert formatters.format_detached_milestone(run_of("Terse"), milestone) == "deployment: half"
    assert formatters.format_detached_completion(run_of("Plain"), done) == "deployment: 20 rows"
    assert formatters.format_detached_completion(run_of("Assistant"), done) == \
        "deployment: 20 rows"
