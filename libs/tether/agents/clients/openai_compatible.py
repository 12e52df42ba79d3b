"""A model client for any server that speaks the OpenAI chat-completions API.

Streams by default (server-sent events), so the answer's text reaches the run as it is
written. HTTP errors become `ModelError`s that say whether a retry may help: 429 and
5xx are retryable, with the server's Retry-After (or retry-after-ms); a context-length
error is classified as an overflow; a body that is not the API's shape is reported as
`malformed_response`, quoting the start of what came back.
"""

import json
import os
from collections.abc import Mapping
from typing import Any

from tether.extras import MissingExtra

try:
    import httpx
except ModuleNotFoundError:
    raise MissingExtra("openai") from None

from tether.agents.errors import ModelError, kind_for_status, parse_retry_after
from tether.agents.model_messages import (
    Message,
    ModelRequest,
    ModelResponse,
    TextDelta,
    TokenUsage,
    ToolCall,
)

QUOTE_CHARS = 200


def wire_message(message: Message) -> dict[str, Any]:
    if message.role == "tool":
        return {"role": "tool", "tool_call_id": message.tool_call_id, "content": message.content}
    wire: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        wire["content"] = message.content or None
        wire["tool_calls"] = [{"id": call.id, "type": "function",
                               "function": {"name": call.name,
                                            "arguments": json.dumps(call.input)}}
                              for call in message.tool_calls]
    return wire


def request_body(request: ModelRequest, stream: bool) -> dict[str, Any]:
    messages = [{"role": "system", "content": request.instructions}] if request.instructions else []
    body: dict[str, Any] = {"model": request.model,
                            "messages": messages + [wire_message(m) for m in request.messages],
                            "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if request.tools:
        body["tools"] = [{"type": "function", "function": {
            "name": tool.id, "description": tool.description, "parameters": tool.parameters}}
            for tool in request.tools]
    sampling = request.sampling
    for name, value in (("temperature", sampling.temperature), ("top_p", sampling.top_p),
                        ("max_tokens", sampling.max_output_tokens), ("seed", sampling.seed)):
        if value is not None:
            body[name] = value
    if sampling.stop:
        body["stop"] = list(sampling.stop)
    if request.preset:
        body["preset"] = request.preset
    return body


def parse_tool_call(call_id: str, name: str, arguments: str) -> ToolCall:
    try:
        parsed = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError as error:
        return ToolCall(id=call_id, name=name, arguments_error=f"not JSON ({error.msg})")
    if not isinstance(parsed, dict):
        return ToolCall(id=call_id, name=name, arguments_error="not a JSON object")
    return ToolCall(id=call_id, name=name, input=parsed)


def parse_usage(usage: Any) -> TokenUsage:
    if not isinstance(usage, dict):
        return TokenUsage()
    details = usage.get("prompt_tokens_details") or {}
    return TokenUsage(input_tokens=usage.get("prompt_tokens") or 0,
                      output_tokens=usage.get("completion_tokens") or 0,
                      cached_tokens=details.get("cached_tokens") or 0,
                      total_tokens=usage.get("total_tokens") or 0)


class _StreamAssembler:
    """Builds one response from chat-completion chunks."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.reasoning: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}
        self.finish_reason: str | None = None
        self.usage: Any = None
        self.response_id: str | None = None
        self.model: str | None = None
        self.provider: str | None = None

    def add(self, chunk: dict[str, Any]) -> str:
        self.response_id = self.response_id or chunk.get("id")
        self.model = chunk.get("model") or self.model
        self.provider = chunk.get("provider") or self.provider
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        choices = chunk.get("choices") or []
        if not choices:
            return ""
        choice = choices[0]
        self.finish_reason = choice.get("finish_reason") or self.finish_reason
        delta = choice.get("delta") or {}
        for part in delta.get("tool_calls") or []:
            slot = self.calls.setdefault(part.get("index", len(self.calls)),
                                         {"id": "", "name": "", "arguments": ""})
            function = part.get("function") or {}
            slot["id"] = part.get("id") or slot["id"]
            slot["name"] += function.get("name") or ""
            slot["arguments"] += function.get("arguments") or ""
        if reasoning := delta.get("reasoning_content") or delta.get("reasoning"):
            self.reasoning.append(reasoning)
        text = delta.get("content") or ""
        self.text.append(text)
        return text

    def response(self, provider: str, request_id: str | None) -> ModelResponse:
        calls = tuple(parse_tool_call(slot["id"], slot["name"], slot["arguments"])
                      for _, slot in sorted(self.calls.items()))
        return ModelResponse(
            message=Message(role="assistant", content="".join(self.text), tool_calls=calls,
                            reasoning="".join(self.reasoning) or None),
            usage=parse_usage(self.usage), request_id=request_id or self.response_id,
            provider=self.provider or provider, model=self.model,
            finish_reason=self.finish_reason)


class OpenAICompatibleClient:
    def __init__(self, base_url: str, *, api_key: str | None = None,
                 provider: str = "openai-compatible", stream: bool = True,
                 timeout_s: float = 120.0, headers: Mapping[str, str] | None = None,
                 http: httpx.AsyncClient | None = None) -> None:
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.provider = provider
        self.stream = stream
        self._headers = {"Accept": "text/event-stream" if stream else "application/json",
                         **(headers or {})}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._timeout = httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0))
        self._http = http

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "OpenAICompatibleClient":
        """TETHER_MODEL_BASE_URL (e.g. http://127.0.0.1:11434/v1), TETHER_MODEL_API_KEY,
        TETHER_MODEL_PROVIDER."""
        environ = os.environ if environ is None else environ
        base_url = environ.get("TETHER_MODEL_BASE_URL")
        if not base_url:
            raise ValueError("TETHER_MODEL_BASE_URL is not set (the chat-completions API's "
                             "base URL, e.g. http://127.0.0.1:11434/v1)")
        return cls(base_url, api_key=environ.get("TETHER_MODEL_API_KEY"),
                   provider=environ.get("TETHER_MODEL_PROVIDER", "openai-compatible"))

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    async def complete(self, request: ModelRequest,
                       on_delta: TextDelta | None = None) -> ModelResponse:
        if self._http is None:
            self._http = httpx.AsyncClient(timeout=self._timeout)
        body = request_body(request, self.stream)
        try:
            async with self._http.stream("POST", self.url, json=body,
                                         headers=self._headers) as response:
                if response.status_code >= 400:
                    raise self._http_error(response, (await response.aread()).decode(
                        errors="replace"))
                request_id = response.headers.get("x-request-id")
                if self.stream and "text/event-stream" in response.headers.get("content-type", ""):
                    return await self._read_stream(response, request_id, on_delta)
                return self._parse_body((await response.aread()).decode(errors="replace"),
                                        request_id)
        except httpx.TimeoutException as error:
            raise ModelError(f"{self.provider}: no answer in time ({type(error).__name__})",
                             kind="timeout", provider=self.provider) from error
        except httpx.TransportError as error:
            raise ModelError(f"{self.provider}: connection failed ({type(error).__name__}: "
                             f"{error})", kind="connection", provider=self.provider) from error

    async def _read_stream(self, response: httpx.Response, request_id: str | None,
                           on_delta: TextDelta | None) -> ModelResponse:
        assembler, done = _StreamAssembler(), False
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue  # blank separators, comments (":"), event names
            payload = line[5:].strip()
            if payload == "[DONE]":
                done = True
                break
            try:
                chunk = json.loads(payload)
            except json.JSONDecodeError:
                raise self._malformed("a stream event is not JSON", payload, request_id) from None
            if not isinstance(chunk, dict):
                raise self._malformed("a stream event is not a JSON object", payload, request_id)
            if "error" in chunk:
                raise self._api_error(response.status_code, chunk["error"], payload,
                                      response.headers)
            text = assembler.add(chunk)
            if text and on_delta is not None:
                await on_delta(text)
        if not done and assembler.finish_reason is None:
            raise ModelError(f"{self.provider}: the stream ended before the answer was complete",
                             kind="connection", provider=self.provider, request_id=request_id)
        return assembler.response(self.provider, request_id)

    def _parse_body(self, text: str, request_id: str | None) -> ModelResponse:
        try:
            data = json.loads(text)
            choice = data["choices"][0]
            message = choice["message"]
        except (json.JSONDecodeError, KeyError, IndexError, TypeError):
            raise self._malformed("expected JSON with choices[0].message", text,
                                  request_id) from None
        calls = tuple(parse_tool_call(call.get("id", ""), call.get("function", {}).get("name", ""),
                                      call.get("function", {}).get("arguments") or "")
                      for call in message.get("tool_calls") or [])
        return ModelResponse(
            message=Message(role="assistant", content=message.get("content") or "",
                            tool_calls=calls,
                            reasoning=message.get("reasoning_content") or message.get("reasoning")),
            usage=parse_usage(data.get("usage")), request_id=request_id or data.get("id"),
            provider=data.get("provider") or self.provider, model=data.get("model"),
            finish_reason=choice.get("finish_reason"))

    def _http_error(self, response: httpx.Response, body: str) -> ModelError:
        try:
            error = json.loads(body).get("error", body)
        except (json.JSONDecodeError, AttributeError):
            error = body
        return self._api_error(response.status_code, error, body, response.headers)

    def _api_error(self, status: int, error: Any, body: str,
                   headers: Mapping[str, str]) -> ModelError:
        if isinstance(error, dict):
            message = str(error.get("message") or error)
            code = error.get("code") or error.get("type")
            if status < 400:  # an error event inside a 200 stream
                server_side = any(word in str(code) for word in ("server", "overloaded"))
                status = int(error.get("status") or (500 if server_side else 400))
        else:
            message, code = (str(error).strip()[:QUOTE_CHARS] or "(empty body)"), None
        code = str(code) if code is not None else None
        return ModelError(f"{self.provider} answered {status}: {message}",
                          kind=kind_for_status(status, code, message), status=status, code=code,
                          retry_after_ms=parse_retry_after(headers), provider=self.provider,
                          request_id=headers.get("x-request-id"), body=body[:2000])

    def _malformed(self, what: str, text: str, request_id: str | None) -> ModelError:
        return ModelError(f"malformed response from {self.provider} ({self.url}): {what}; "
                          f"it starts with {text[:QUOTE_CHARS]!r}", kind="malformed_response",
                          provider=self.provider, request_id=request_id, retryable=False,
                          body=text[:2000])


def from_env(agent_cls: Any = None) -> OpenAICompatibleClient:
    """For TETHER_MODEL_CLIENT=tether.agents.clients.openai_compatible:from_env."""
    return OpenAICompatibleClient.from_env()
