"""The OpenAI-compatible client against a local HTTP server that speaks the same API.

The server below is a real HTTP/1.1 server on 127.0.0.1: it parses each request, keeps
it for the assertions, and answers with the next planned reply — a JSON completion, a
server-sent-event stream written chunk by chunk, or an error status with headers.
"""

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import pytest
from pydantic import BaseModel

from tether.agents import Agent, AgentDefinition, ModelRetry, ToolContext, tool
from tether.agents.clients.openai_compatible import OpenAICompatibleClient

REASONS = {200: "OK", 400: "Bad Request", 429: "Too Many Requests", 500: "Internal Server Error"}


@dataclass
class Planned:
    status: int = 200
    body: str = ""
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)
    events: list[str] | None = None  # server-sent events, written one chunk at a time
    gate: asyncio.Event | None = None  # hold the rest of the stream until this is set,
    gate_after: int = 1  # after this event (0 is a keep-alive comment, 1 the first chunk)


class ChatServer:
    def __init__(self) -> None:
        self.plan: list[Planned] = []
        self.requests: list[dict[str, Any]] = []
        self._server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}/v1"

    async def start(self) -> "ChatServer":
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while request_line := await reader.readline():
                method, path, _ = request_line.decode().split(" ", 2)
                headers = {}
                while (line := (await reader.readline()).decode().strip()):
                    name, _, value = line.partition(":")
                    headers[name.strip().lower()] = value.strip()
                body = await reader.readexactly(int(headers.get("content-length", 0)))
                self.requests.append({"method": method, "path": path, "headers": headers,
                                      "body": json.loads(body)})
                await self._answer(writer, self.plan.pop(0))
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def _answer(self, writer: asyncio.StreamWriter, planned: Planned) -> None:
        content_type = "text/event-stream" if planned.events is not None else planned.content_type
        head = [f"HTTP/1.1 {planned.status} {REASONS.get(planned.status, 'Status')}",
                f"Content-Type: {content_type}", "x-request-id: req-local-1",
                *(f"{k}: {v}" for k, v in planned.headers.items())]
        if planned.events is None:
            payload = planned.body.encode()
            writer.write(("\r\n".join([*head, f"Content-Length: {len(payload)}"]) + "\r\n\r\n"
                          ).encode() + payload)
            await writer.drain()
            return
        writer.write(("\r\n".join([*head, "Transfer-Encoding: chunked"]) + "\r\n\r\n").encode())
        for number, event in enumerate(planned.events):
            data = event.encode()
            writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            await writer.drain()
            if number == planned.gate_after and planned.gate is not None:
                await asyncio.wait_for(planned.gate.wait(), timeout=5)
        writer.write(b"0\r\n\r\n")
        await writer.drain()


def sse(*chunks: dict[str, Any], done: bool = True) -> list[str]:
    events = [f"data: {json.dumps(chunk)}\n\n" for chunk in chunks]
    return [": keep-alive\n\n", *events, *(["data: [DONE]\n\n"] if done else [])]


def text_stream(*pieces: str, usage: dict[str, Any] | None = None) -> list[str]:
    chunks = [{"id": "chatcmpl-7", "model": "local-1",
               "choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]}
              for piece in pieces]
    chunks.append({"id": "chatcmpl-7", "choices": [{"index": 0, "delta": {},
                                                    "finish_reason": "stop"}]})
    chunks.append({"id": "chatcmpl-7", "choices": [], "usage": usage or {
        "prompt_tokens": 50, "completion_tokens": 7, "total_tokens": 57,
        "prompt_tokens_details": {"cached_tokens": 20}}})
    return sse(*chunks)


def tool_call_stream(call_id: str, name: str, arguments: str) -> list[str]:
    half = len(arguments) // 2
    return sse(
        {"id": "chatcmpl-6", "model": "local-1", "choices": [{"index": 0, "delta": {
            "role": "assistant", "content": None, "tool_calls": [
                {"index": 0, "id": call_id, "type": "function",
                 "function": {"name": name, "arguments": arguments[:half]}}]}}]},
        {"id": "chatcmpl-6", "choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "function": {"arguments": arguments[half:]}}]}}]},
        {"id": "chatcmpl-6", "choices": [{"index": 0, "delta": {},
                                          "finish_reason": "tool_calls"}]})


def error_body(message: str, code: str | None = None) -> str:
    return json.dumps({"error": {"message": message, "type": "invalid_request_error",
                                 "code": code}})


class Query(BaseModel):
    query: str


@tool
async def search(ctx: ToolContext, input: Query) -> str:
    """Search the web."""
    return f"{input.query}: runs over QUIC"


class SleepRecorder:
    def __init__(self) -> None:
        self.delays_ms: list[int] = []

    async def __call__(self, seconds: float) -> None:
        self.delays_ms.append(round(seconds * 1000))


@pytest.fixture
async def server():
    started = await ChatServer().start()
    yield started
    await started.stop()


@pytest.fixture
async def make_agent(server: ChatServer):
    clients: list[OpenAICompatibleClient] = []

    def make(stream: bool = True, **definition: Any) -> tuple[Agent, SleepRecorder]:
        client = OpenAICompatibleClient(server.url, api_key="sk-local", provider="local",
                                        stream=stream, timeout_s=5)
        clients.append(client)
        sleep = SleepRecorder()
        values = {"id": "researcher", "model": "local-1", "instructions": "Be brief.",
                  "tools": (search,), "model_retries": ModelRetry(count=2, backoff_ms=40)}
        return Agent(AgentDefinition(**(values | definition)), client=client, sleep=sleep), sleep

    yield make
    for client in clients:
        await client.aclose()


async def test_a_tool_calling_conversation_streams_over_http(server, make_agent) -> None:
    first_text = asyncio.Event()
    server.plan = [Planned(events=tool_call_stream("call_1", "search", '{"query": "HTTP/3"}')),
                   Planned(events=text_stream("HTTP/3 ", "runs over ", "QUIC."),
                           gate=first_text)]
    agent, _ = make_agent()
    deltas: list[str] = []

    def on_event(event: Any) -> None:
        if event.type == "text_delta":
            deltas.append(event.text)
            first_text.set()  # the server sends the rest only once this arrived

    result = await agent.run("What does HTTP/3 run over?", on_event=on_event)
    assert (result.status, result.output) == ("completed", "HTTP/3 runs over QUIC.")
    assert deltas == ["HTTP/3 ", "runs over ", "QUIC."]
    first, second = server.requests
    assert (first["method"], first["path"]) == ("POST", "/v1/chat/completions")
    assert first["headers"]["authorization"] == "Bearer sk-local"
    body = first["body"]
    assert (body["model"], body["stream"], body["stream_options"]) == (
        "local-1", True, {"include_usage": True})
    assert body["messages"] == [{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "What does HTTP/3 run over?"}]
    assert body["tools"] == [{"type": "function", "function": {
        "name": "search", "description": "Search the web.",
        "parameters": Query.model_json_schema()}}]
    assert second["body"]["messages"][2:] == [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "search", "arguments": '{"query": "HTTP/3"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "HTTP/3: runs over QUIC"}]
    turn = result.steps[1].turn
    assert (turn.request_id, turn.provider, turn.model, turn.finish_reason) == (
        "req-local-1", "local", "local-1", "stop")
    assert turn.usage.model_dump() == {"input_tokens": 50, "output_tokens": 7,
                                       "cached_tokens": 20, "total_tokens": 57}


async def test_a_json_completion_without_streaming(server, make_agent) -> None:
    server.plan = [Planned(body=json.dumps({
        "id": "chatcmpl-9", "model": "local-1", "provider": "upstream",
        "choices": [{"index": 0, "finish_reason": "stop",
                     "message": {"role": "assistant", "content": "Fine."}}],
        "usage": {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11}}))]
    agent, _ = make_agent(stream=False, sampling={"temperature": 0.2, "max_output_tokens": 64})
    result = await agent.run("How are you?")
    assert result.output == "Fine." and result.steps[0].turn.provider == "upstream"
    body = server.requests[0]["body"]
    assert (body["stream"], body["temperature"], body["max_tokens"]) == (False, 0.2, 64)
    assert "stream_options" not in body


async def test_a_429_is_retried_after_the_servers_retry_after(server, make_agent) -> None:
    server.plan = [Planned(status=429, body=error_body("Rate limit reached"),
                           headers={"Retry-After": "1"}),
                   Planned(events=text_stream("ok"))]
    agent, sleep = make_agent()
    result = await agent.run("hi")
    assert (result.status, result.output) == ("completed", "ok")
    assert sleep.delays_ms == [1000], "Retry-After: 1 means a second, not the 40 ms backoff"
    assert result.steps[0].turn.attempts == 2 and len(server.requests) == 2


async def test_a_500_is_retried_with_backoff(server, make_agent) -> None:
    server.plan = [Planned(status=500, body=error_body("upstream exploded")),
                   Planned(status=500, body="<html>oops</html>", content_type="text/html"),
                   Planned(events=text_stream("recovered"))]
    agent, sleep = make_agent()
    events: list[Any] = []
    result = await agent.run("hi", on_event=events.append)
    assert (result.status, result.output) == ("completed", "recovered")
    assert sleep.delays_ms == [40, 80]
    assert [e.data["error"] for e in events if e.type == "model_retry"] == [
        "local answered 500: upstream exploded", "local answered 500: <html>oops</html>"]


async def test_retries_that_run_out_fail_the_run_with_the_servers_error(server, make_agent):
    server.plan = [Planned(status=500, body=error_body("down")) for _ in range(3)]
    agent, _ = make_agent()
    result = await agent.run("hi")
    assert (result.status, result.error) == ("failed", "local answered 500: down")
    assert result.record.error_details == {
        "kind": "server", "message": "local answered 500: down", "status": 500,
        "code": "invalid_request_error", "provider": "local", "request_id": "req-local-1",
        "attempts": 3, "context_overflow": False}


async def test_a_malformed_response_is_reported_clearly_and_not_retried(server, make_agent):
    server.plan = [Planned(body="<html><body>Gateway login</body></html>",
                           content_type="text/html")]
    agent, _ = make_agent(stream=False)
    result = await agent.run("hi")
    assert result.status == "failed" and len(server.requests) == 1
    assert result.error == (
        f"malformed response from local ({server.url}/chat/completions): expected JSON with "
        "choices[0].message; it starts with '<html><body>Gateway login</body></html>'")
    assert result.record.error_details["kind"] == "malformed_response"

    server.plan = [Planned(events=[*text_stream("par")[:2], "data: {not json\n\n"])]
    streamed, _ = make_agent()
    result = await streamed.run("hi")
    assert result.status == "failed" and "a stream event is not JSON" in result.error
    assert "'{not json'" in result.error


async def test_a_context_overflow_fails_at_once(server, make_agent) -> None:
    server.plan = [Planned(status=400, body=error_body(
        "This model's maximum context length is 128000 tokens.", "context_length_exceeded"))]
    agent, sleep = make_agent()
    result = await agent.run("a very long question")
    assert result.status == "failed" and sleep.delays_ms == []
    assert result.record.error_details["kind"] == "context_overflow"
    assert result.record.error_details["context_overflow"] is True


async def test_a_stream_cut_short_is_a_connection_error_and_is_retried(server, make_agent):
    server.plan = [Planned(events=text_stream("half an ans")[:2]),  # no finish, no [DONE]
                   Planned(events=text_stream("half an answer"))]
    agent, sleep = make_agent()
    deltas: list[str] = []
    result = await agent.run("hi", on_event=lambda e: deltas.append(e.text)
                             if e.type == "text_delta" else None)
    assert result.output == "half an answer" and len(sleep.delays_ms) == 1
    assert "".join(deltas) == "half an answer", "the retry's repeated prefix is not shown twice"


async def test_an_unreachable_server_is_a_retryable_connection_error() -> None:
    client = OpenAICompatibleClient("http://127.0.0.1:9/v1", provider="nowhere", timeout_s=2)
    agent = Agent(AgentDefinition(id="a", model="m", model_retries=ModelRetry(count=1,
                                                                             backoff_ms=1)),
                  client=client, sleep=SleepRecorder())
    result = await agent.run("hi")
    await client.aclose()
    assert result.status == "failed" and result.record.error_details["kind"] == "connection"
    assert result.record.error_details["attempts"] == 2
    assert result.error.startswith("nowhere: connection failed (ConnectError")

