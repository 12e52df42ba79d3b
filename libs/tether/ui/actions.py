"""The UI's actions on runs: cancel, re-request, continue, send, fork, rewind, clear. Each
acts as the run's parent through the client, and answers `{"ok": true, "message": ...}`
or `{"error": ...}` with the status that says why. An action that decides from the run's
state (re-request, continue, rewind) reads it from the log, not the projections, which
may lag it."""

import json
from typing import Any

from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tether.client.arguments import build_run_command
from tether.client.errors import MessageRefused, TetherError
from tether.domain.commands import ContinueCommand
from tether.domain.ids import run_message_id
from tether.domain.recorded import ForkPoint
from tether.domain.run_state import as_builtins
from tether.ui.paths import logged_run_of, parent_of, run_of, ui_of
from tether.ui.views import STATUSES

FINISHED = ["completed", "error", "aborted", "interrupted"]


async def _act(action) -> Response:
    try:
        message = await action
    except MessageRefused:
        raise
    except (TetherError, TimeoutError) as error:
        return JSONResponse({"error": str(error) or type(error).__name__}, status_code=503)
    return JSONResponse({"ok": True, "message": message})


async def cancel_run(request: Request) -> Response:
    parent, state = await run_of(request)
    await _json_body(request)
    handle = ui_of(request).tether.parent(parent.agent, parent.name)

    async def cancel() -> str:
        await handle.cancel(state.run_id)
        return f"cancel requested for {state.run_id}"

    return await _act(cancel())


async def rerequest_run(request: Request) -> Response:
    parent, state, last_seq = await logged_run_of(request)
    await _json_body(request)
    if not state.resumable:
        why = ("was stopped (given up or cancelled) and does not resume"
               if state.status == "interrupted" else f"is {state.status}")
        raise HTTPException(409, f"run {state.run_id} {why}: only an interrupted run that "
                                 "resumes is re-requested")
    ui = ui_of(request)
    detached = as_builtins(state.detached) if state.detached is not None else False
    command = build_run_command(parent, state.agent_type, state.input, run_id=state.run_id,
                                parent_tool_call_id=state.parent_tool_call_id,
                                display_order=state.display_order, display=state.display,
                                detached=detached, started_by=state.started_by)

    async def rerequest() -> str:
        # One command per position of the run in the log: a second click on the same
        # interrupted run is a duplicate, a request after a later interruption is new.
        await ui.tether.publish_command("run", command, run_message_id(state.run_id, last_seq, state.parent))
        return f"re-requested {state.run_id}"

    return await _act(rerequest())


async def continue_run(request: Request) -> Response:
    parent, state, _ = await logged_run_of(request)
    body = await _json_body(request)
    try:
        command = ContinueCommand(run_id=state.run_id, parent=parent, **body)
    except (ValidationError, TypeError) as error:
        raise HTTPException(400, f"invalid continue request: {_first_error(error)}") from None
    if state.paused is None:
        raise HTTPException(409, f"run {state.run_id} is not waiting for anyone")
    pause_id = state.paused.pause_id
    ui = ui_of(request)

    async def resume() -> str:
        await ui.tether.publish_command(
            "continue", command, f"continue:{state.run_id}:{pause_id}")
        return f"answered {state.run_id}"

    return await _act(resume())


async def send_to_run(request: Request) -> Response:
    """A steering message from the run page: `{"text": ..., "mode": "queue"|"interrupt"}`."""
    parent, state = await run_of(request)
    body = await _json_body(request)
    text, mode = body.get("text"), body.get("mode", "queue")
    if not isinstance(text, str) or not text.strip():
        raise HTTPException(400, "text: the message to send, a non-empty string")
    if mode not in ("queue", "interrupt"):
        raise HTTPException(400, "mode: expected \"queue\" or \"interrupt\"")
    handle = ui_of(request).tether.parent(parent.agent, parent.name)

    async def send() -> str:
        receipt = await handle.send(state.run_id, text, mode=mode)
        return f"message {receipt.message_id} sent to {state.run_id}"

    try:
        return await _act(send())
    except MessageRefused as refused:  # (the run ended meanwhile, say)
        return JSONResponse({"error": str(refused)}, status_code=409)


async def fork_run(request: Request) -> Response:
    """A fork of the run from a point of its log, beside it, detached: `{"seq": N}` (the
    slider's sequence) or `{"at": "step:2"}`, and optionally `"instructions"`."""
    parent, state = await run_of(request)
    body = await _json_body(request)
    at, instructions = body.get("at"), body.get("instructions")
    if at is None and isinstance(body.get("seq"), int) and not isinstance(body["seq"], bool):
        at = f"seq:{body['seq']}"
    try:
        point = str(ForkPoint.parse(at if isinstance(at, str) else ""))
    except ValueError:
        raise HTTPException(400, "seq: the stream sequence to fork at, e.g. {\"seq\": 42} "
                                 "(or at: step:<n>, milestone:<name>, seq:<n>)") from None
    if instructions is not None and (not isinstance(instructions, str) or not instructions.strip()):
        raise HTTPException(400, "instructions: the fork's instructions, a non-empty string")
    handle = ui_of(request).tether.parent(parent.agent, parent.name)
    overrides = {"instructions": instructions} if instructions else None

    async def fork() -> dict[str, Any]:
        answer = await handle.fork(state.run_id, at=point, agent_overrides=overrides,
                                   detached=True)
        if (refused := getattr(answer, "error", None)) is not None:
            raise ForkRefusedByParent(refused)
        return {"run_id": answer.run_id,
                "message": f"forked {state.run_id} at {point}: {answer.run_id}"}

    return await _act_with(fork())


async def rewind_run(request: Request) -> Response:
    """A failed run taken up again from its last recorded step, detached."""
    parent, state, _ = await logged_run_of(request)
    await _json_body(request)
    if state.status != "error":
        raise HTTPException(409, f"run {state.run_id} is {state.status}: only a failed run "
                                 "is rewound")
    handle = ui_of(request).tether.parent(parent.agent, parent.name)

    async def rewind() -> dict[str, Any]:
        answer = await handle.rewind(state.run_id, detached=True)
        if (refused := getattr(answer, "error", None)) is not None:
            raise ForkRefusedByParent(refused)
        return {"run_id": state.run_id, "message": f"rewound {state.run_id}"}

    return await _act_with(rewind())


class ForkRefusedByParent(Exception):
    """The parent refused a fork or a rewind; the message says why."""


async def _act_with(action) -> Response:
    """`_act` for an action that answers with more than a message."""
    try:
        answer = await action
    except ForkRefusedByParent as refused:
        return JSONResponse({"error": str(refused)}, status_code=409)
    except (TetherError, TimeoutError) as error:
        return JSONResponse({"error": str(error) or type(error).__name__}, status_code=503)
    return JSONResponse({"ok": True, **answer})


async def clear_runs(request: Request) -> Response:
    parent = await parent_of(request)
    body = await _json_body(request)
    statuses = body.get("status", FINISHED)
    if (not isinstance(statuses, list) or not statuses
            or any(status not in STATUSES for status in statuses)):
        raise HTTPException(400, f"status: expected a list of some of {', '.join(STATUSES)}")
    handle = ui_of(request).tether.parent(parent.agent, parent.name)

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

