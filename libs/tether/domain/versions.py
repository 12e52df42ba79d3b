"""Versions of agent code: which runs a runner resumes, and which runners disagree.

Every `run.running` records the version of the agent code its attempt runs
(`tether.agent_registry.agent_version`). During a rolling deploy, or when two
deployments serve one agent type by mistake, a run begun by one version may be resumed
by another, whose code may not match the steps the first recorded.
"""

from collections.abc import Iterable
from typing import Literal

# TETHER_RESUME_OTHER_VERSIONS: what a runner does with a run begun under another version.
ResumePolicy = Literal["resume", "refuse"]


def on_other_version(recorded: str | None, running: str, policy: ResumePolicy
                     ) -> Literal["same", "resume", "refuse"]:
    """`same` when the run's last attempt ran this version (or recorded none: written
    before versions were); otherwise what `policy` says: `resume` (with a warning) or
    `refuse` (the run fails, saying why)."""
    if recorded is None or recorded == running:
        return "same"
    return policy


def versions_serving(own: str, answers: Iterable[tuple[str, str]]) -> dict[str, list[str]]:
    """{version: runner ids} of the runners that answered (runner id, version) and this
    one, when they run more than one version of an agent type; empty when they agree."""
    by_version: dict[str, list[str]] = {own: ["this runner"]}
    for runner_id, version in answers:
        by_version.setdefault(version, []).append(runner_id)
    return {version: sorted(runners) for version, runners in sorted(by_version.items())
            } if len(by_version) > 1 else {}
