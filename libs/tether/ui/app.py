"""The Starlette application of `tether ui`: pages, their JSON and live streams; the
actions on runs are `tether.ui.actions`."""

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from html import escape
from importlib import resources
from typing import Any

import asyncpg

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
from tether.client.errors import TetherError
from tether.config import Settings
from tether.contract.messages import UsageView
from tether.domain.branches import diff
from tether.domain.events import ParentRef
from tether.domain.run_state import RunState, as_builtins
from tether.log import get_logger
from tether.ports import StoredEvent
from tether.runtime import nats_check, postgres_check, run_checks
from tether.ui.actions import (
    cancel_run,
    clear_runs,
    continue_run,
    fork_run,
    rerequest_run,
    rewind_run,
    send_to_run,
)
from tether.ui.gate import AccessGate
from tether.ui.page_stream import ParentStream
from tether.ui.paths import UiState, other_run_of, parent_of, run_of, ui_of
from tether.ui.views import (
    STATUSES,
    diff_document,
    event_documents,
    run_document,
    state_as_of,
    status_counts,
)

STATIC = resources.files("tether.ui") / "static"


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
        Route("/runs/{agent}/{name}/{run_id}/diff/{other}", diff_page),
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
        Route("/api/runs/{agent}/{name}/{run_id}/fork", fork_run, methods=["POST"]),
        Route("/api/runs/{agent}/{name}/{run_id}/rewind", rewind_run, methods=["POST"]),
        Route("/api/runs/{agent}/{name}/{run_id}/diff/{other}", diff_json),
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
    detail = _failure(ui_of(request).tether.settings, error)
    get_logger(service="ui").warning("ui.request_failed", path=request.url.path, error=detail)
    if request.url.path.startswith("/api/"):
        return JSONResponse({"error": detail}, status_code=503)
    return HTMLResponse(_shell("Unavailable", "missing", {"message": detail}), status_code=503)


async def _http_error(request: Request, error: HTTPException) -> Response:
    if request.url.path.startswith("/api/"):
        return JSONResponse({"error": error.detail}, status_code=error.status_code)
    return HTMLResponse(_shell("Not found", "missing", {"message": error.detail}),
                        status_code=error.status_code)


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
    parent = await parent_of(request)
    return HTMLResponse(_shell(f"{parent.agent}/{parent.name}", "parent",
                               {"agent": parent.agent, "name": parent.name}))


async def run_page(request: Request) -> Response:
    parent, state = await run_of(request)
    return HTMLResponse(_shell(f"{state.run_id} · {parent.agent}/{parent.name}", "run",
                               {"agent": parent.agent, "name": parent.name,
                                "run_id": state.run_id}))


async def diff_page(request: Request) -> Response:
    parent, state = await run_of(request)
    other = await other_run_of(request, parent)
    return HTMLResponse(_shell(f"{state.run_id} and {other.run_id} · {parent.agent}/{parent.name}",
                               "diff", {"agent": parent.agent, "name": parent.name,
                                        "run_id": state.run_id, "other": other.run_id}))


async def healthz(request: Request) -> Response:
    return JSONResponse({"status": "alive"})


async def readyz(request: Request) -> Response:
    answers = await run_checks(ui_of(request).checks)
    ready = all(ok for ok, _ in answers.values())
    details = {name: detail for name, (_, detail) in answers.items()}
    return JSONResponse({"ready": ready, "checks": details}, status_code=200 if ready else 503)


# --- reads ----------------------------------------------------------------------------

async def parents_json(request: Request) -> Response:
    ui = ui_of(request)
    query = request.query_params.get("q", "").strip().lower()
    rows = await ui.store.counts_by_parent()
    readable = await ui.gate.readable({agent for agent, *_ in rows})
    parents = [entry for entry in status_counts(row for row in rows if row[0] in readable)
               if query in f"{entry['agent']}/{entry['name']}".lower()]
    return JSONResponse({"parents": parents, "statuses": list(STATUSES)})


async def parent_stream(request: Request) -> Response:
    parent = await parent_of(request)
    ui = ui_of(request)
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
    parent, state = await run_of(request)
    ui = ui_of(request)
    events = await ui.tether.run_reads.read(ui.tether.subjects.run_events(parent, state.run_id))
    state = _folded(events, state)
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
    parent, state = await run_of(request)
    given = request.query_params.get("seq", "")
    # ASCII digits only: int() would take "-5", " 3" and "٣" too.
    if not (given.isascii() and given.isdigit()):
        raise HTTPException(400, "seq: expected the stream sequence to fold up to, "
                                 "e.g. ?seq=42")
    seq = int(given)
    ui = ui_of(request)
    events = await ui.tether.run_reads.read(ui.tether.subjects.run_events(parent, state.run_id))
    folded = state_as_of(events, seq)
    return JSONResponse({"seq": seq,
                         "run": None if folded is None else run_document(folded,
                                                                          output_chars=None)})


async def diff_json(request: Request) -> Response:
    """Two runs of the parent side by side, from where they part (`domain.branches.diff`)."""
    parent, state = await run_of(request)
    other = await other_run_of(request, parent)
    ui = ui_of(request)
    logged = [await _as_logged(ui, parent, run) for run in (state, other)]
    return JSONResponse(diff_document(diff(*logged)))


async def _as_logged(ui: UiState, parent: ParentRef, state: RunState) -> RunState:
    events = await ui.tether.run_reads.read(ui.tether.subjects.run_events(parent, state.run_id))
    return _folded(events, state)


def _folded(events: list[StoredEvent], state: RunState) -> RunState:
    """The run as its events show it now (the projection may lag the log)."""
    folded = state_as_of(events, events[-1].seq) if events else None
    return folded if folded is not None else state
