"""A remote A2A agent for the tests, served by the official SDK's own server
(`DefaultRequestHandler`, its in-memory task store, Starlette routes), as a process of its
own: `python remote_a2a_server.py PORT TOKEN`.

What it does is said by the first word of the message's text:
- `echo <words>`: working (a status message), a text artifact `echo: <words>` and a data
  artifact `{"words": n}`, then completed with the message `done`;
- `hold <words>`: working, then waits until `POST /control/release`, then as `echo`;
- `ask`: working, then input-required ("Which language?"); the answer completes the task
  with the artifact `in <answer>`;
- `ask late`: as `ask`, but the answer is acknowledged before it is taken: the task is
  sent back as it stands, still asking, until `POST /control/release`;
- `fail`: failed, with the message `no such thing`.

`GET /control/stats` says what it saw: every execution (task id and text), every cancel,
how often a task asking a question already answered was read (`read_asking_answered`),
how often its card was read (`card_reads`). Every call needs `Authorization: Bearer
TOKEN`, but the card and /control. Options (`... PORT TOKEN polled held-card`): `polled`,
its card offers no streaming; `held-card`, the first read of its card is answered only
after `POST /control/release`.
"""

import asyncio
import sys
from typing import Any

import uvicorn
from a2a.helpers.proto_helpers import get_message_text, new_task_from_user_message
from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.context import ServerCallContext
from a2a.server.events import EventQueue
from a2a.server.request_handlers import DefaultRequestHandler
from a2a.server.routes import create_agent_card_routes, create_jsonrpc_routes
from a2a.server.tasks import InMemoryTaskStore, TaskUpdater
from a2a.types import (
    AgentCapabilities,
    AgentCard,
    AgentInterface,
    AgentSkill,
    GetTaskRequest,
    Part,
    Task,
    TaskState,
)
from google.protobuf.json_format import ParseDict
from google.protobuf.struct_pb2 import Value
from starlette.applications import Starlette
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

SEEN: dict[str, Any] = {"executions": [], "cancels": [], "read_asking_answered": 0,
                        "card_reads": 0}
RELEASE = asyncio.Event()
LATE: set[str] = set()  # tasks that take their answer late


def card(base: str, streaming: bool) -> AgentCard:
    return AgentCard(
        name="Echo", description="Says back what it is told", version="7",
        supported_interfaces=[AgentInterface(protocol_binding="JSONRPC",
                                             protocol_version="1.0", url=f"{base}/jsonrpc")],
        capabilities=AgentCapabilities(streaming=streaming, push_notifications=False),
        default_input_modes=["text/plain"], default_output_modes=["text/plain"],
        skills=[AgentSkill(id="echo", name="echo", description="echo", tags=["test"])])


class Echo(AgentExecutor):
    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        text = get_message_text(context.message) if context.message else ""
        task = context.current_task
        if task is None:
            task = new_task_from_user_message(context.message)
            await event_queue.enqueue_event(task)
        SEEN["executions"].append({"task_id": task.id, "text": text})
        updater = TaskUpdater(event_queue, task.id, task.context_id)
        if task.status.state == TaskState.TASK_STATE_INPUT_REQUIRED:
            if task.id in LATE:
                LATE.discard(task.id)
                await event_queue.enqueue_event(task)  # acknowledged: it still asks
                await RELEASE.wait()
            await updater.add_artifact([Part(text=f"in {text}")], name="answer")
            await updater.complete(updater.new_agent_message([Part(text="done")]))
            return
        word, _, rest = text.partition(" ")
        await updater.start_work(updater.new_agent_message([Part(text=f"reading {rest}")]))
        if word == "ask":
            if rest == "late":
                LATE.add(task.id)
            await updater.requires_input(updater.new_agent_message(
                [Part(text="Which language?")]))
            return
        if word == "fail":
            await updater.failed(updater.new_agent_message([Part(text="no such thing")]))
            return
        if word == "hold":
            await RELEASE.wait()
        await updater.add_artifact([Part(text=f"echo: {rest}")], name="echo")
        await updater.add_artifact([Part(data=ParseDict({"words": len(rest.split())},
                                                        Value()))], name="count")
        await updater.complete(updater.new_agent_message([Part(text="done")]))

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        SEEN["cancels"].append(context.task_id)
        task = context.current_task
        updater = TaskUpdater(event_queue, context.task_id,
                              task.context_id if task else context.context_id)
        await updater.cancel()


async def stats(request: Request) -> JSONResponse:
    return JSONResponse(SEEN)


async def release(request: Request) -> JSONResponse:
    RELEASE.set()
    return JSONResponse({"released": True})


class Handler(DefaultRequestHandler):
    async def on_get_task(self, params: GetTaskRequest, context: ServerCallContext) -> Task | None:
        task = await super().on_get_task(params, context)
        if (task is not None and task.status.state == TaskState.TASK_STATE_INPUT_REQUIRED
                and [e["task_id"] for e in SEEN["executions"]].count(task.id) > 1):
            SEEN["read_asking_answered"] += 1
        return task


class Bearer(BaseHTTPMiddleware):
    def __init__(self, app, token: str, held_card: bool) -> None:
        super().__init__(app)
        self.token, self.held_card = token, held_card

    async def dispatch(self, request: Request, call_next):
        if (request.url.path == "/jsonrpc"
                and request.headers.get("authorization") != f"Bearer {self.token}"):
            return JSONResponse({"error": "unauthorized"}, status_code=401)
        if request.url.path.startswith("/.well-known/"):
            SEEN["card_reads"] += 1
            if self.held_card and SEEN["card_reads"] == 1:
                await RELEASE.wait()
        return await call_next(request)


def app(port: int, token: str, streaming: bool, held_card: bool) -> Starlette:
    agent_card = card(f"http://127.0.0.1:{port}", streaming)
    handler = Handler(agent_executor=Echo(), task_store=InMemoryTaskStore(),
                      agent_card=agent_card)
    application = Starlette(routes=[
        *create_agent_card_routes(agent_card), *create_jsonrpc_routes(handler, rpc_url="/jsonrpc"),
        Route("/control/stats", stats), Route("/control/release", release, methods=["POST"])])
    application.add_middleware(Bearer, token=token, held_card=held_card)
    return application


if __name__ == "__main__":
    port, token = int(sys.argv[1]), sys.argv[2]
    options = sys.argv[3:]
    uvicorn.run(app(port, token, streaming="polled" not in options,
                    held_card="held-card" in options),
                host="127.0.0.1", port=port, log_level="warning")
