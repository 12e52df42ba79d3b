"""The Starlette application of `tether ui`: pages, their JSON and live streams, actions."""

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from html import escape
from importlib import resources
from typing import Any

import asyncpg
from pydantic import ValidationError

from tether.extras import MissingExtra

try:
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import Request
    from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
    from starlette.routing import Mount, Route
    from starlette.staticfiles import StaticFiles
except ModuleNotFoundError:
    raise MissingExtra("ui") from None

from tether.adapters.postgres.reads import ProjectionReads
from tether.agents.devtools import other_steps, records_of
from tether.client.connection import Tether, connect
from tether.client.errors import MessageRefused, TetherError
from tether.client.parent import build_run_command
from tether.config import Settings
from tether.contract.messages import UsageView
from tether.domain.commands import ContinueCommand
from tether.domain.events import ParentRef
from tether.domain.ids import check_identifier, run_message_id
from tether.domain.run_state import RunState, as_builtins
from tether.log import get_logger
from tether.runtime import ReadinessCheck, nats_check, postgres_check, run_checks
from tether.ui.gate import AccessGate
from tether.ui.page_stream import STOP, ParentStream
from tether.ui.views import STATUSES, event_documents, run_document, state_as_of, status_counts

FINISHED = ["completed", "error", "aborted", "interrupted"]
STATIC = resources.files("tether.ui") / "static"


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


def ui_inbox(settings: Settings) -> str | None:
    """The UI's inbox prefix: its NATS user's own, as `tether.access` requires."""
    return f"_INBOX_{settings.nats_user}" if settings.nats_user else None


def create_app(settings: Settings, *, frame_ms: int | None = None,
               connected: tuple[Tether, asyncpg.Pool] | None = None) -> Starlette:
    """The UI's ASGI app; its lifespan connects to NATS (as `settings.nats_user`, when set,
    with that user's own inbox prefix) and to Postgres, unless given them (`connected`,
    which its caller closes: `tether.ui.serving` connects before it serves, so that an
    unreachable server is one line, not a failed lifespan)."""
    logger = get_logger(service="ui")

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if connected is not None:
            tether, pool = connected
            async with _serving(app, tether, pool):
                yield
            return
        tether = await connect(settings=settings, name="tether-ui",
                               inbox_prefix=ui_inbox(settings))
        try:
            pool = await asyncpg.create_pool(settings.database_url, min_size=1, max_size=4)
        except BaseException:
            await tether.close()
            raise
        try:
            async with _serving(app, tether, pool):
                yield
        finally:
            await pool.close()
            await tether.close()

    @asynccontextmanager
    async def _serving(app: Starlette, tether: Tether, pool: asyncpg.Pool
                       ) -> AsyncIterator[None]:
        state = UiState(tether, ProjectionReads(pool, settings.projection_schema),
                        AccessGate(tether),
                        {"nats": nats_check(tether.nc), "postgres": postgres_check(pool)})
        app.state.ui = state
        app.state.frame_ms = frame_ms
        logger.info("ui.connected", nats_user=settings.nats_user,
                    schema=settings.projection_schema)
        try:
            yield
        finally:
            state.stop_streams()

    routes = [
        Route("/", index_page),
        Route("/parents/{agent}/{name}", parent_page),
        Route("/runs/{agent}/{name}/{run_id}", run_page),
        Route("/healthz", healthz),
        Route("/readyz", readyz),
        Route("/api/parents", parents_json),
        Route("/api/parents/{agent}/{name}/stream", parent_stream),
        Route("/api/parents/{agent}/{name}/clear", clear_runs, methods=["POST"]),
        Route("/api/runs/{agent}/{name}/{run_id}", run_json),
        Route("/api/runs/{agent}/{name}/{run_id}/state", run_state_json),
        Route("/api/runs/{agent}/{name}/{run_id}/cancel", cancel_run, methods=["POST"]),
        Route("/api/runs/{agent}/{name}/{run_id}/rerequest", rerequest_run, methods=["POST"]),
        Route("/api/runs/{agent}/{name}/{run_id}/continue", continue_run, methods=["POST"]),
        Route("/api/runs/{agent}/{name}/{run_id}/send", send_to_run, methods=["POST"]),
        Mount("/static", app=StaticFiles(directory=str(STATIC)), name="static"),
    ]
    unavailable = dict.fromkeys(UNAVAILABLE, _unavailable)
    return Starlette(routes=routes, lifespan=lifespan,
                     # (Starlette passes each handler the exception type it is registered for.)
                     exception_handlers={HTTPException: _http_error,  # type: ignore[dict-item]
                                         **unavailable})


UNAVAILABLE = (asyncpg.PostgresError, asyncpg.InterfaceError, OSError, TetherError,
               TimeoutError)


def _failure(settings: Settings, error: Exception) -> str:
    if isinstance(error, asyncpg.UndefinedTableError):
        return (f"the projections are not in schema {settings.projection_schema!r} of "
                "TETHER_DATABASE_URL: is the projector running (it creates them)?")
    if isinstance(error, asyncpg.PostgresError | asyncpg.InterfaceError):
        return f"Postgres (TETHER_DATABASE_URL) failed: {type(error).__name__}: {error}"
    if isinstance(error, TetherError):
        return str(error)
    return f"{type(error).__name__}: {error or 'no answer in time'}"


async def _unavailable(request: Request, error: Exception) -> Response:
    """Postgres or NATS failed under a request: 503 with what failed, for the page to show."""
    detail = _failure(_ui(request).tether.settings, error)
    get_logger(service="ui").warning("ui.request_failed", path=request.url.path, error=detail)
    if request.url.path.startswith("/api/"):
        return JSONResponse({"error": detail}, status_code=503)
    return HTMLResponse(_shell("Unavailable", "missing", {"message": detail}), status_code=503)


async def _http_error(request: Request, error: HTTPException) -> Response:
    if request.url.path.startswith("/api/"):
        return JSONResponse({"error": error.detail}, status_code=error.status_code)
    return HTMLResponse(_shell("Not found", "missing", {"message": error.detail}),
                        status_code=error.status_code)


def _ui(request: Request) -> UiState:
    return request.app.state.ui


async def _parent(request: Request) -> ParentRef:
    """The parent the path names, or 404 when it is malformed or not this user's to see."""
    agent, name = request.path_params["agent"], request.path_params["name"]
    try:
        parent = ParentRef(agent=check_identifier(agent, "parent agent"),
                           name=check_identifier(name, "parent name"))
    except ValueError:
        raise HTTPException(404, f"no parent {agent}/{name}") from None
    if not await _ui(request).gate.may_read(parent.agent):
        raise HTTPException(404, f"no parent {agent}/{name}")
    return parent


async def _run(request: Request) -> tuple[ParentRef, RunState]:
    parent = await _parent(request)
    run_id = request.path_params["run_id"]
    try:
        check_identifier(run_id, "run id")
    except ValueError:
        raise HTTPException(404, f"no run {run_id} of {parent.agent}/{parent.name}") from None
    ui = _ui(request)
    state = await ui.store.run(parent, run_id)
    if state is None:
        # Not projected yet (the projector lags the log by a batch or more): its events say.
        events = await ui.tether.run_reads.read(ui.tether.subjects.run_events(parent, run_id))
        state = state_as_of(events, events[-1].seq) if events else None
    if state is None:
        raise HTTPException(404, f"no run {run_id} of {parent.agent}/{parent.name}")
    return parent, state


# --- pages ----------------------------------------------------------------------------

def _shell(title: str, page: str, data: dict[str, Any]) -> str:
    """The one HTML document every page is: app.js draws it from `data` and the API."""
    payload = escape(json.dumps(data), quote=True)
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{escape(title)} · Tether</title>
<link rel="stylesheet" href="/static/style.css">
</head><body data-page="{page}" data-props="{payload}">
<header><a class="brand" href="/">Tether</a> <span class="crumbs" id="crumbs"></span></header>
<main id="main"></main>
<script src="/static/runs.js"></script>
<script src="/static/app.js"></script>
</body></html>"""


async def index_page(request: Request) -> Response:
    return HTMLResponse(_shell("Parents", "index", {}))


async def parent_page(request: Request) -> Response:
    parent = await _parent(request)
    return HTMLResponse(_shell(f"{parent.agent}/{parent.name}", "parent",
                               {"agent": parent.agent, "name": parent.name}))


async def run_page(request: Request) -> Response:
    parent, state = await _run(request)
    return HTMLResponse(_shell(f"{state.run_id} · {parent.agent}/{parent.name}", "run",
                               {"agent": parent.agent, "name": parent.name,
                                "run_id": state.run_id}))


async def healthz(request: Request) -> Response:
    return JSONResponse({"status": "alive"})


async def readyz(request: Request) -> Response:
    answers = await run_checks(_ui(request).checks)
    ready = all(ok for ok, _ in answers.values())
    details = {name: detail for name, (_, detail) in answers.items()}
    return JSONResponse({"ready": ready, "checks": details}, status_code=200 if ready else 503)


# --- reads ----------------------------------------------------------------------------

async def parents_json(request: Request) -> Response:
    ui = _ui(request)
    query = request.query_params.get("q", "").strip().lower()
    rows = await ui.store.counts_by_parent()
    readable = await ui.gate.readable({agent for agent, *_ in rows})
    parents = [entry for entry in status_counts(row for row in rows if row[0] in readable)
               if query in f"{entry['agent']}/{entry['name']}".lower()]
    return JSONResponse({"parents": parents, "statuses": list(STATUSES)})


async def parent_stream(request: Request) -> Response:
    parent = await _parent(request)
    ui = _ui(request)
    frame_ms = request.app.state.frame_ms
    stream = ParentStream(ui.tether, ui.store, parent,
                          **({"frame_ms": frame_ms} if frame_ms is not None else {}))

    async def body() -> AsyncIterator[str]:
        ui.streams.add(stream)
        try:
            if ui.stopping:
                return
            async for message in stream.messages():
                if message["type"] == "heartbeat":
                    yield ": heartbeat\n\n"  # a comment: EventSource ignores it
                else:
                    yield f"event: {message['type']}\ndata: {json.dumps(message)}\n\n"
        except UNAVAILABLE as error:
            detail = _failure(ui.tether.settings, error)
            get_logger(service="ui").warning("ui.stream_failed", path=request.url.path,
                                             error=detail)
            yield f"event: failure\ndata: {json.dumps({'error': detail})}\n\n"
        finally:
            ui.streams.discard(stream)

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})


async def run_json(request: Request) -> Response:
    parent, state = await _run(request)
    ui = _ui(request)
    subject = ui.tether.subjects.run_events(parent, state.run_id)
    events = await ui.tether.run_reads.read(subject)
    # The log's fold, which the projection may lag: the run as its events list shows it.
    if events and (folded := state_as_of(events, events[-1].seq)) is not None:
        state = folded
    steps = {record.index: record.model_dump(mode="json") for record in records_of(state)}
    for index, step in other_steps(state):  # a row of the steps table, as far as it has one
        steps[index] = {"index": index, "kind": step.get("kind", "step"), "call": 0,
                        "status": "recorded", "turn": step.get("turn"),
                        "cost": step.get("cost"), "step": step}
    counted = any(step.get("turn") for step in state.steps.values())
    usage = UsageView.of_steps(state.steps).model_dump(mode="json") if counted else None
    return JSONResponse({
        "run": run_document(state, output_chars=None),
        "input": state.input,
        "steps": [steps[index] for index in sorted(steps)],
        "usage": usage,
        "resumptions": as_builtins(state.resumptions),
        "reattach_decisions": as_builtins(state.reattach_decisions),
        "events": event_documents(events),
    })


async def run_state_json(request: Request) -> Response:
    parent, state = await _run(request)
    try:
        seq = int(request.query_params["seq"])
    except (KeyError, ValueError):
        raise HTTPException(400, "seq: expected the stream sequence to fold up to, "
                                 "e.g. ?seq=42") from None
    ui = _ui(request)
    events = await ui.tether.run_reads.read(ui.tether.subjects.run_events(parent, state.run_id))
    folded = state_as_of(events, seq)
    return JSONResponse({"seq": seq,
                         "run": None if folded is None else run_document(folded,
                                                                          output_chars=None)})


# --- actions --------------------------------------------------------------------------

async def _act(action) -> Response:
    try:
        message = await action
    except MessageRefused:
        raise
    except (TetherError, TimeoutError) as error:
        return JSONResponse({"error": str(error) or type(error).__name__}, status_code=503)
    return JSONResponse({"ok": True, "message": message})


async def cancel_run(request: Request) -> Response:
    parent, state = await _run(request)
    await _json_body(request)
    handle = _ui(request).tether.parent(parent.agent, parent.name)

    async def cancel() -> str:
        await handle.cancel(state.run_id)
        return f"cancel requested for {state.run_id}"

    return await _act(cancel())


async def rerequest_run(request: Request) -> Response:
    parent, state = await _run(request)
    await _json_body(request)
    if not state.resumable:
        why = ("was stopped (given up or cancelled) and does not resume"
               if state.status == "interrupted" else f"is {state.status}")
        raise HTTPException(409, f"run {state.run_id} {why}: only an interrupted run that "
                                 "resumes is re-requested")
    ui = _ui(request)
    detached = as_builtins(state.detached) if state.detached is not None else False
    command = build_run_command(parent, state.agent_type, state.input, run_id=state.run_id,
                                parent_tool_call_id=state.parent_tool_call_id,
                                display_order=state.display_order, display=state.display,
                                detached=detached, started_by=state.started_by)

    async def rerequest() -> str:
        # One command per position of the run in the log: a second click on the same
        # interrupted run is a duplicate, a request after a later interruption is new.
        last_seq = await ui.tether.run_reads.last_seq(
            ui.tether.subjects.run_events(parent, state.run_id))
        await ui.tether.publish_command("run", command, run_message_id(state.run_id, last_seq, state.parent))
        return f"re-requested {state.run_id}"

    return await _act(rerequest())


async def continue_run(request: Request) -> Response:
    parent, state = await _run(request)
    body = await _json_body(request)
    try:
        command = ContinueCommand(run_id=state.run_id, parent=parent, **body)
    except (ValidationError, TypeError) as error:
        raise HTTPException(400, f"invalid continue request: {_first_error(error)}") from None
    if state.paused is None:
        raise HTTPException(409, f"run {state.run_id} is not waiting for anyone")
    pause_id = state.paused.pause_id
    ui = _ui(request)

    async def resume() -> str:
        await ui.tether.publish_command(
            "continue", command, f"continue:{state.run_id}:{pause_id}")
        return f"answered {state.run_id}"

    return await _act(resume())


async def send_to_run(request: Request) -> Response:
    """A steering message from the run page: `{"text": ..., "mode": "queue"|"interrupt"}`."""
    parent, state = await _run(request)
    body = await _json_body(request)
    text, mode = body.get("text"), body.get("mode", "queue")
    if not isinstance(text, str) or not text.strip():
        raise HTTPException(400, "text: the message to send, a non-empty string")
    if mode not in ("queue", "interrupt"):
        raise HTTPException(400, "mode: expected \"queue\" or \"interrupt\"")
    handle = _ui(request).tether.parent(parent.agent, parent.name)

    async def send() -> str:
        receipt = await handle.send(state.run_id, text, mode=mode)
        return f"message {receipt.message_id} sent to {state.run_id}"

    try:
        return await _act(send())
    except MessageRefused as refused:  # (the run ended meanwhile, say)
        return JSONResponse({"error": str(refused)}, status_code=409)


async def clear_runs(request: Request) -> Response:
    parent = await _parent(request)
    body = await _json_body(request)
    statuses = body.get("status", FINISHED)
    if (not isinstance(statuses, list) or not statuses
            or any(status not in STATUSES for status in statuses)):
        raise HTTPException(400, f"status: expected a list of some of {', '.join(STATUSES)}")
    handle = _ui(request).tether.parent(parent.agent, parent.name)

    async def clear() -> str:
        await handle.clear(status=statuses)
        return f"clear requested for {parent.agent}/{parent.name}: {', '.join(statuses)}"

    return await _act(clear())


async def _json_body(request: Request) -> dict[str, Any]:
    # A form on another site can post to this port, but not with this content type
    # without the browser asking first (CORS), which this app never allows.
    if request.headers.get("content-type", "").split(";")[0].strip() != "application/json":
        raise HTTPException(415, "an action takes a JSON body (Content-Type: application/json)")
    raw = await request.body()
    if not raw:
        return {}
    try:
        body = json.loads(raw)
    except json.JSONDecodeError as error:
        raise HTTPException(400, f"the request body is not valid JSON: {error}") from None
    if not isinstance(body, dict):
        raise HTTPException(400, "the request body must be a JSON object")
    return body


def _first_error(error: Exception) -> str:
    if isinstance(error, ValidationError):
        problem = error.errors()[0]
        where = ".".join(str(part) for part in problem["loc"])
        return f"{where}: {problem['msg']}" if where else problem["msg"]
    return str(error)

