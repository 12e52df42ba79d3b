"""A model client that plays a script: for tests, demos, and runs without a model.

The reply is chosen by the conversation's turn (how many assistant messages the request
already holds), not by how many calls this object has seen, so a run resumed in another
process gets the same reply for the same turn. An entry may be a list: successive
attempts at that turn (e.g. a rate-limit error, then the answer).

`calls_file` appends one JSON line per call, so a test can count model calls across
runner processes.
"""

import asyncio
import json
import os
import re
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tether.agents.errors import ModelError
from tether.agents.model_messages import (
    Message,
    ModelRequest,
    ModelResponse,
    TextDelta,
    TokenUsage,
    ToolCall,
)


@dataclass(frozen=True)
class Reply:
    text: str = ""
    tool_calls: Sequence[ToolCall | tuple[str, Mapping[str, Any]]] = ()
    usage: TokenUsage | None = None  # None: estimated from the text (4 characters a token)
    reasoning: str | None = None
    finish_reason: str | None = None  # None: "tool_calls" or "stop"
    chunk_delay_ms: int = 0  # pause between streamed chunks, to act like a slow model

    def response(self, request: ModelRequest, turn: int, attempt: int) -> ModelResponse:
        calls = tuple(call if isinstance(call, ToolCall)
                      else ToolCall(id=f"call_{turn}_{n}", name=call[0], input=dict(call[1]))
                      for n, call in enumerate(self.tool_calls))
        usage = self.usage or TokenUsage(
            input_tokens=1 + (len(request.instructions)
                              + sum(len(m.content) for m in request.messages)) // 4,
            output_tokens=1 + len(self.text) // 4)
        return ModelResponse(
            message=Message(role="assistant", content=self.text, tool_calls=calls,
                            reasoning=self.reasoning),
            usage=usage, request_id=f"scripted-{turn}-{attempt}", provider="scripted",
            model=request.model,
            finish_reason=self.finish_reason or ("tool_calls" if calls else "stop"))


@dataclass(frozen=True)
class Fail:
    """Raise this error for the attempt (a ModelError says whether it is retryable)."""

    error: Exception


Entry = Reply | Fail | Callable[[ModelRequest], Reply]


@dataclass(frozen=True)
class ScriptedCall:
    turn: int
    attempt: int
    request_id: str
    model: str
    pid: int


@dataclass
class ScriptedModelClient:
    script: Sequence[Entry | Sequence[Entry]]
    calls_file: str | Path | None = None
    stream: bool = True
    calls: list[ScriptedCall] = field(default_factory=list)
    requests: list[ModelRequest] = field(default_factory=list)
    _attempts: Counter = field(default_factory=Counter, repr=False)

    async def complete(self, request: ModelRequest,
                       on_delta: TextDelta | None = None) -> ModelResponse:
        turn = sum(1 for m in request.messages if m.role == "assistant")
        self._attempts[turn] += 1
        attempt = self._attempts[turn]
        self.requests.append(request)
        call = ScriptedCall(turn=turn, attempt=attempt, request_id=f"scripted-{turn}-{attempt}",
                            model=request.model, pid=os.getpid())
        self.calls.append(call)
        self._log_call(call)
        entry = self._entry(turn, attempt)
        if isinstance(entry, Fail):
            raise entry.error
        reply = entry if isinstance(entry, Reply) else entry(request)
        response = reply.response(request, turn, attempt)
        if self.stream and on_delta is not None:
            for chunk in re.findall(r"\S+\s*|\s+", reply.text):
                if reply.chunk_delay_ms:
                    await asyncio.sleep(reply.chunk_delay_ms / 1000)
                await on_delta(chunk)
        return response

    def _log_call(self, call: ScriptedCall) -> None:
        # One short line, written at once, so a process killed right after still left it.
        if self.calls_file is not None:
            with open(self.calls_file, "a", encoding="utf-8") as log:
                log.write(json.dumps(call.__dict__) + "\n")

    def _entry(self, turn: int, attempt: int) -> Entry:
        if turn >= len(self.script):
            raise ModelError(f"the script has no reply for turn {turn} "
                             f"(it has {len(self.script)})", kind="bad_request",
                             provider="scripted")
        entry = self.script[turn]
        if isinstance(entry, (Reply, Fail)) or callable(entry):
            return entry
        return entry[min(attempt, len(entry)) - 1]


def read_calls(path: str | Path) -> list[dict[str, Any]]:
    """The calls a `calls_file` recorded, in order, from every process that wrote it."""
    if not Path(path).exists():
        return []
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line]
