"""Versions of agent code: what a runner does with a run begun under another, which
runners disagree, and the version of a class that names none."""

import hashlib
from pathlib import Path

from pydantic import BaseModel

from tether.agent_registry import AgentRegistry, agent_version
from tether.child.agent import ChildAgent
from tether.domain.versions import on_other_version, versions_serving


class Plain(ChildAgent):
    input_model = BaseModel


class Released(ChildAgent):
    version = "2026.12.1"


def test_a_run_of_this_version_or_of_none_recorded_is_the_same():
    assert on_other_version("v1", "v1", "refuse") == "same"
    assert on_other_version(None, "v2", "refuse") == "same"


def test_a_run_begun_under_another_version_follows_the_policy():
    assert on_other_version("v1", "v2", "resume") == "resume"
    assert on_other_version("v1", "v2", "refuse") == "refuse"


def test_runners_that_agree_say_nothing_and_those_that_differ_are_listed_by_version():
    assert versions_serving("v1", [("r-a", "v1"), ("r-b", "v1")]) == {}
    assert versions_serving("v2", [("r-b", "v1"), ("r-a", "v1")]) == {
        "v1": ["r-a", "r-b"], "v2": ["this runner"]}


def test_a_class_without_a_version_has_the_digest_of_its_file_and_one_with_its_own():
    assert agent_version(Released) == "2026.12.1"
    digest = agent_version(Plain)
    assert digest == hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]
    assert AgentRegistry([Plain, Released]).version("Plain") == digest
