"""The parent's side of forks and rewinds (`RunCommand.fork`, `.rewind`): a fork's origin
read from the run it is taken from, and a failed run rewound. The decisions are
`tether.domain.forks`; `RunRequests` creates the fork as it creates any run."""

from functools import partial
from typing import Any

from pydantic import ValidationError

from tether.domain import forks
from tether.domain.commands import RunCommand
from tether.domain.decide import Budgets, Cause
from tether.domain.events import ForkOrigin, RunRef
from tether.domain.recorded import ForkPoint
from tether.parent.command_parsing import explain
from tether.ports import EventLog

Problem = tuple[str, str]


async def fork_origin(log: EventLog, agents: Any, command: RunCommand
                      ) -> tuple[ForkOrigin | None, Problem | None]:
    """Where the fork `command` is taken from and what it reuses, read from the log of the
    run it forks (of the same parent: a parent forks its own runs only); or why not."""
    request = command.fork
    assert request is not None
    source = RunRef(parent=command.parent, run_id=request.run_id)
    stored = await log.read_subject(log.subjects.run_events(command.parent, request.run_id))
    events = [(item.seq, item.event) for item in stored if item.event is not None]
    try:
        origin = forks.fork_origin(source, events, ForkPoint.parse(request.at),
                                   request.overrides)
    except forks.ForkRefused as refused:
        return None, (refused.code, str(refused))
    original = events[0][1]
    agent_type = getattr(original.data, "agent_type", None)
    if agent_type != command.agent_type:
        return None, ("bad-fork", (f"run {request.run_id} is a {agent_type} run: its fork "
                                   f"runs {agent_type}, not {command.agent_type}"))
    if request.overrides and (problem := _overrides_problem(agents, command)) is not None:
        return None, problem
    return origin, None


def _overrides_problem(agents: Any, command: RunCommand) -> Problem | None:
    assert command.fork is not None
    agent = agents.get(command.agent_type)
    model = getattr(agent, "overrides_model", None)
    if model is None:
        return ("bad-overrides", (f"fork.overrides: {command.agent_type} takes no overrides "
                                  "(its class sets no overrides_model)"))
    try:
        model.model_validate(command.fork.overrides)
    except ValidationError as error:
        return ("bad-overrides", f"fork.overrides for {command.agent_type}: {explain(error)}")
    return None


async def rewind(log: EventLog, command: RunCommand, cause: Cause, budgets: Budgets):
    """Rewind `command.rewind` of the failed run: (the run after it, whether it was
    appended now, the run's last sequence, why not)."""
    assert command.rewind is not None
    state, appended, last_seq = await log.recent.update_at(
        command.parent, command.run_id,
        partial(forks.rewind, cause=cause, budgets=budgets, number=command.rewind))
    refused = None if appended else forks.why_no_rewind(state, command.run_id, command.rewind)
    return state, bool(appended), last_seq, refused
