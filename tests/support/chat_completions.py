"""A stand-in for an OpenAI-compatible model server, for tests that drive a real client.

A Starlette app served by uvicorn on 127.0.0.1 (port 0) that speaks the chat-completions
wire format: `POST /v1/chat/completions` with `stream: true` is answered with
server-sent events (text deltas, tool calls whose arguments arrive in pieces, a usage
chunk, `[DONE]`), and without it with one JSON completion. What to answer is decided
by `decide(body)`, from the conversation the request carries, as a model would; every
request is kept for the test's assertions.
"""

import asyncio
import contextlib
import itertools
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Self

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route


@dataclass(frozen=True)
class Answer:
    """One completion: its text, and its tool calls as (id, name, arguments)."""

    text: str = ""
    tool_calls: tuple[tuple[str, str, dict[str, Any]], ...] = ()


@dataclass
class ChatCompletionsServer:
    decide: Callable[[dict[str, Any]], Answer]
    model: str = "fake-model"
    requests: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    _server: uvicorn.Server | None = None
    _task: asyncio.Task | None = None
    _ids: Any = field(default_factory=itertools.count)

    @property
    def url(self) -> str:
        assert self._server is not None
        port = self._server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}/v1"

    async def __aenter__(self) -> Self:
        app = Starlette(routes=[Route("/v1/chat/completions", self._complete, methods=["POST"])])
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0,
                                                     log_level="warning", lifespan="off"))
        self._task = asyncio.create_task(self._server.serve())
        async with asyncio.timeout(10):
            while not self._server.started:
                if self._task.done():
                    self._task.result()
                await asyncio.sleep(0.01)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._server is not None and self._task is not None
        self._server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(self._task, timeout=10)

    async def _complete(self, request: Request) -> Response:
        body = await request.json()
        self.requests.append(body)
        self.headers.append(dict(request.headers))
        answer = self.decide(body)
        completion_id = f"chatcmpl-{next(self._ids)}"
        usage = {"prompt_tokens": sum(len(str(m.get("content") or "")) for m in body["messages"]) // 4 + 1,
                 "completion_tokens": len(answer.text) // 4 + 1}
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        finish = "tool_calls" if answer.tool_calls else "stop"
        if not body.get("stream"):
            message: dict[str, Any] = {"role": "assistant", "content": answer.text}
            if answer.tool_calls:
                message["tool_calls"] = [
                    {"id": call_id, "type": "function",
                     "function": {"name": name, "arguments": json.dumps(arguments)}}
                    for call_id, name, arguments in answer.tool_calls]
            return JSONResponse({"id": completion_id, "model": self.model, "usage": usage,
                                 "choices": [{"index": 0, "message": message,
                                              "finish_reason": finish}]})
        return StreamingResponse(self._chunks(completion_id, answer, finish, usage),
                                 media_type="text/event-stream")

    async def _chunks(self, completion_id: str, answer: Answer, finish: str,
                      usage: dict[str, int]) -> AsyncIterator[str]:
        def event(delta: dict[str, Any] | None, finish_reason: str | None = None,
                  **extra: Any) -> str:
            choices = [] if delta is None else [{"index": 0, "delta": delta,
                                                 "finish_reason": finish_reason}]
            chunk = {"id": completion_id, "object": "chat.completion.chunk",
                     "model": self.model, "choices": choices, **extra}
            return f"data: {json.dumps(chunk)}\n\n"

        yield event({"role": "assistant", "content": ""})
        for word in answer.text.split(" "):
            yield event({"content": word + " "} if word != answer.text.split(" ")[-1]
                        else {"content": word})
            await asyncio.sleep(0)
        for index, (call_id, name, arguments) in enumerate(answer.tool_calls):
            text = json.dumps(arguments)
            middle = len(text) // 2  # the arguments arrive in two pieces, as models send them
            yield event({"tool_calls": [{"index": index, "id": call_id, "type": "function",
                                         "function": {"name": name, "arguments": text[:middle]}}]})
            yield event({"tool_calls": [{"index": index, "function": {"arguments": text[middle:]}}]})
        yield event({}, finish)
        yield event(None, usage=usage)
        yield "data: [DONE]\n\n"
