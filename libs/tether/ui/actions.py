"""The UI's actions on runs: cancel, re-request, continue, send, fork, rewind, clear. Each
acts as the run's parent through the client, and answers `{"ok": true, "message": ...}`
or `{"error": ...}` with the status that says why. An action that decides from the run's
state (re-request, continue, rewind) reads it from the log, not the projections, which
may lag it.

Every command expires `ACTION_EXPIRES_IN_S` after it is sent, as the CLI's do: a click
while no parent service runs is not applied by one started much later, and the answer
says it is queued (docs/concepts.md "Commands sent while no parent serves them")."""

import json
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tether.client.arguments import build_run_command, expires_in_ms, fork_request
from tether.client.errors import InputTooLarge, MessageRefused, TetherError
from tether.client.sending import SEND_TIMEOUT_S
from tether.domain.commands import MAX_STEERING_TEXT, ContinueCommand
from tether.domain.events import ParentRef
from tether.domain.ids import run_message_id
from tether.domain.recorded import ForkPoint
from tether.domain.run_state import as_builtins
from tether.ui.paths import UiState, logged_run_of, parent_of, run_of, ui_of
from tether.ui.views import STATUSES

FINISHED = ["completed", "error", "aborted", "interrupted"]
# As the CLI's default `--expires-in`.
ACTION_EXPIRES_IN_S = 60.0
# How long a send waits for the parent to record the message when no parent service
# runs: long enough to store it, not the client's 30 s for a busy parent.
QUEUED_SEND_WAIT_S = 2.0
# How long a fork or a rewind waits for the parent to take it (detached: accepted or
# refused), when a parent service runs but is slow (or stops meanwhile).
BRANCH_WAIT_S = 30.0
QUEUED = f"queued: no parent service is running; it expires in {ACTION_EXPIRES_IN_S:g} s"


def _failed(error: Exception) -> Response | None:
    """The answer for a failure of the client under an action, or None: not one of
    these."""
    if isinstance(error, InputTooLarge):
        return JSONResponse({"error": str(error)}, status_code=413)
    if isinstance(error, TetherError | TimeoutError):
        return JSONResponse({"error": str(error) or type(error).__name__}, status_code=503)
    if isinstance(error, ValueError | TypeError):
        # An argument the client refused that the checks here let through.
        return JSONResponse({"error": str(error)}, status_code=400)
    return None


async def _act(action: Awaitable[str], ui: UiState, parent: ParentRef) -> Response:
    try:
        message = await action
    except MessageRefused:
        raise
    except (TetherError, TimeoutError, ValueError, TypeError) as error:
        failed = _failed(error)
        assert failed is not None
        return failed
    if await ui.tether.parent_unavailable(parent) is not None:
        message = f"{message}; {QUEUED}"
    return JSONResponse({"ok": True, "message": message})


async def cancel_run(request: Request) -> Response:
    parent, state = await run_of(request)
    await _json_body(request)
    ui = ui_of(request)
    handle = ui.tether.parent(parent.agent, parent.name)

    async def cancel() -> str:
        await handle.cancel(state.run_id, expires_in=ACTION_EXPIRES_IN_S)
        return f"cancel requested for {state.run_id}"

    return await _act(cancel(), ui, parent)


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
                                detached=detached, started_by=state.started_by,
                                expires_in=ACTION_EXPIRES_IN_S)

    async def rerequest() -> str:
        # One command per position of the run in the log: a second click on the same
        # interrupted run is a duplicate, a request after a later interruption is new.
        await ui.tether.publish_command("run", command, run_message_id(state.run_id, last_seq, state.parent))
        return f"re-requested {state.run_id}"

    return await _act(rerequest(), ui, parent)


async def continue_run(request: Request) -> Response:
    parent, state, _ = await logged_run_of(request)
    body = await _json_body(request)
    for given_by_path in ("run_id", "parent"):
        if given_by_path in body:
            raise HTTPException(400, f"{given_by_path}: given by the path")
    if "expires_in_ms" in body:
        raise HTTPException(400, f"expires_in_ms: an action's command expires in "
                                 f"{ACTION_EXPIRES_IN_S:g} s")
    try:
        command = ContinueCommand(run_id=state.run_id, parent=parent,
                                  expires_in_ms=expires_in_ms(ACTION_EXPIRES_IN_S), **body)
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

    return await _act(resume(), ui, parent)


async def send_to_run(request: Request) -> Response:
    """A steering message from the run page: `{"text": ..., "mode": "queue"|"interrupt"}`."""
    parent, state = await run_of(request)
    body = await _json_body(request)
    text, mode = body.get("text"), body.get("mode", "queue")
    if not isinstance(text, str) or not text.strip():
        raise HTTPException(400, "text: the message to send, a non-empty string")
    if len(text) > MAX_STEERING_TEXT:
        raise HTTPException(400, f"text: at most {MAX_STEERING_TEXT:,} characters, not "
                                 f"{len(text):,}")
    if mode not in ("queue", "interrupt"):
        raise HTTPException(400, "mode: expected \"queue\" or \"interrupt\"")
    ui = ui_of(request)
    handle = ui.tether.parent(parent.agent, parent.name)
    message_id = uuid.uuid4().hex
    # With no parent service, the message is stored and the answer says so at once,
    # rather than after the client's wait for a parent to record it.
    unserved = await ui.tether.parent_unavailable(parent) is not None

    async def send() -> str:
        try:
            receipt = await handle.send(
                state.run_id, text, mode=mode, message_id=message_id,
                expires_in=ACTION_EXPIRES_IN_S,
                timeout=QUEUED_SEND_WAIT_S if unserved else SEND_TIMEOUT_S)
        except TimeoutError:
            if not unserved:
                raise
            return f"message {message_id} for {state.run_id}"
        return f"message {receipt.message_id} sent to {state.run_id}"

    try:
        return await _act(send(), ui, parent)
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
    overrides = {"instructions": instructions} if instructions else None
    try:
        fork_request(state.run_id, point, overrides)
    except ValueError as error:  # (`at` too long, say)
        raise HTTPException(400, str(error).removeprefix("invalid fork request: ")) from None
    ui = ui_of(request)
    handle = ui.tether.parent(parent.agent, parent.name)

    async def fork() -> dict[str, Any]:
        answer = await handle.fork(state.run_id, at=point, agent_overrides=overrides,
                                   detached=True, expires_in=ACTION_EXPIRES_IN_S,
                                   timeout=BRANCH_WAIT_S)
        if (refused := getattr(answer, "error", None)) is not None:
            raise ForkRefusedByParent(refused)
        return {"run_id": answer.run_id,
                "message": f"forked {state.run_id} at {point}: {answer.run_id}"}

    return await _act_with(fork, ui, parent, f"fork of {state.run_id}")


async def rewind_run(request: Request) -> Response:
    """A failed run taken up again from its last recorded step, detached."""
    parent, state, _ = await logged_run_of(request)
    await _json_body(request)
    if state.status != "error":
        raise HTTPException(409, f"run {state.run_id} is {state.status}: only a failed run "
                                 "is rewound")
    ui = ui_of(request)
    handle = ui.tether.parent(parent.agent, parent.name)

    async def rewind() -> dict[str, Any]:
        answer = await handle.rewind(state.run_id, detached=True,
                                     expires_in=ACTION_EXPIRES_IN_S, timeout=BRANCH_WAIT_S)
        if (refused := getattr(answer, "error", None)) is not None:
            raise ForkRefusedByParent(refused)
        return {"run_id": state.run_id, "message": f"rewound {state.run_id}"}

    return await _act_with(rewind, ui, parent, f"rewind of {state.run_id}")


class ForkRefusedByParent(Exception):
    """The parent refused a fork or a rewind; the message says why."""


async def _act_with(action: Callable[[], Awaitable[dict[str, Any]]], ui: UiState,
                    parent: ParentRef, what: str) -> Response:
    """`_act` for a detached fork or rewind, which answers with more than a message. With
    no parent service running, nothing is sent: a 503 says so at once, where the client
    would wait for a parent (a rewind's run has events already, so the client cannot
    tell an untaken request from a slow parent)."""
    if (unavailable := await ui.tether.parent_unavailable(parent)) is not None:
        return JSONResponse({"error": f"{what}: no parent service is running, nothing was "
                                      f"sent: {unavailable}"}, status_code=503)
    try:
        answer = await action()
    except ForkRefusedByParent as refused:
        return JSONResponse({"error": str(refused)}, status_code=409)
    except (TetherError, TimeoutError, ValueError, TypeError) as error:
        failed = _failed(error)
        assert failed is not None
        return failed
    return JSONResponse({"ok": True, **answer})


async def clear_runs(request: Request) -> Response:
    parent = await parent_of(request)
    body = await _json_body(request)
    statuses = body.get("status", FINISHED)
    if (not isinstance(statuses, list) or not statuses
            or any(status not in STATUSES for status in statuses)):
        raise HTTPException(400, f"status: expected a list of some of {', '.join(STATUSES)}")
    ui = ui_of(request)
    handle = ui.tether.parent(parent.agent, parent.name)

    async def clear() -> str:
        await handle.clear(status=statuses, expires_in=ACTION_EXPIRES_IN_S)
        return f"clear requested for {parent.agent}/{parent.name}: {', '.join(statuses)}"

    return await _act(clear(), ui, parent)


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

