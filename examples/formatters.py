"""Chat texts for detached runs, as a deployment would override them.

Set `TETHER_FORMATTERS=examples.formatters:Terse` on the parent service (and the
reconciler, which re-delivers). A method left out keeps the default; returning an empty
string suppresses that message.
"""

from tether.contract.messages import LifecycleResult, MilestoneView, RunInfo


class Terse:
    def format_detached_completion(self, run: RunInfo, result: LifecycleResult) -> str:
        if result.status == "completed":
            return f"[{run.agent_type}] done: {result.summary}"
        return f"[{run.agent_type}] {result.status}: {result.error}"

    def format_detached_milestone(self, run: RunInfo, milestone: MilestoneView) -> str:
        # Only say something about the milestones a person would act on.
        return f"[{run.agent_type}] needs you" if milestone.name == "needs-approval" else ""
