"""What a UI request's path names, checked: the app's state, the parent (one the user may
read) and its runs."""

from dataclasses import dataclass, field

from starlette.exceptions import HTTPException
from starlette.requests import Request

from tether.adapters.postgres.reads import ProjectionReads
from tether.client.connection import Tether
from tether.domain.events import ParentRef
from tether.domain.ids import check_identifier
from tether.domain.run_state import RunState
from tether.runtime import ReadinessCheck
from tether.ui.gate import AccessGate
from tether.ui.page_stream import STOP, ParentStream


@dataclass
class UiState:
    tether: Tether
    store: ProjectionReads
    gate: AccessGate
    checks: dict[str, ReadinessCheck]
    streams: set[ParentStream] = field(default_factory=set)
    stopping: bool = False

    def stop_streams(self) -> None:
        """Ends every open page's stream, so a shutdown does not wait on browsers."""
        self.stopping = True
        for stream in self.streams:
            stream.sink.put_nowait(STOP)


def ui_of(request: Request) -> UiState:
    return request.app.state.ui


async def parent_of(request: Request) -> ParentRef:
    """The parent the path names, or 404 when it is malformed or not this user's to see."""
    agent, name = request.path_params["agent"], request.path_params["name"]
    try:
        parent = ParentRef(agent=check_identifier(agent, "parent agent"),
                           name=check_identifier(name, "parent name"))
    except ValueError:
        raise HTTPException(404, f"no parent {agent}/{name}") from None
    if not await ui_of(request).gate.may_read(parent.agent):
        raise HTTPException(404, f"no parent {agent}/{name}")
    return parent


async def run_of(request: Request) -> tuple[ParentRef, RunState]:
    """The parent the path names and its run `run_id` (404: none of either)."""
    parent = await parent_of(request)
    return parent, await _run_named(request, parent, request.path_params["run_id"])


async def logged_run_of(request: Request) -> tuple[ParentRef, RunState, int]:
    """The parent the path names, its run `run_id` as the log has it now and the sequence
    of the run's last event, read together (404: none of either): for an action that
    decides from the run, as the projections may lag the log by a batch or more."""
    parent = await parent_of(request)
    run_id = _checked(parent, request.path_params["run_id"])
    state, last_seq = await _logged_run(request, parent, run_id)
    return parent, state, last_seq


async def other_run_of(request: Request, parent: ParentRef) -> RunState:
    """The parent's run `other` the path names too (a comparison's second run)."""
    return await _run_named(request, parent, request.path_params["other"])


def _checked(parent: ParentRef, run_id: str) -> str:
    try:
        return check_identifier(run_id, "run id")
    except ValueError:
        raise HTTPException(404, f"no run {run_id} of {parent.agent}/{parent.name}") from None


async def _run_named(request: Request, parent: ParentRef, run_id: str) -> RunState:
    state = await ui_of(request).store.run(parent, _checked(parent, run_id))
    if state is None:
        # Not projected yet (the projector lags the log by a batch or more): its events say.
        state, _ = await _logged_run(request, parent, run_id)
    return state


async def _logged_run(request: Request, parent: ParentRef, run_id: str) -> tuple[RunState, int]:
    history = await ui_of(request).tether.read_run(parent, run_id)
    if history.state is None:
        raise HTTPException(404, f"no run {run_id} of {parent.agent}/{parent.name}")
    return history.state, history.last_seq
