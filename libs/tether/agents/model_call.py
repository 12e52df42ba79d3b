"""The parts of one model call of the agent loop: its text as emitted across the call's
retries (`StepText`), its failure after them (`ModelCallFailed`), its interruption by a
steering message (`Interrupted`), and its GenAI `chat` span (`traced`)."""

from collections.abc import Awaitable, Callable

from tether import tracing
from tether.agents.errors import describe
from tether.agents.model_messages import ModelRequest, ModelResponse


class Interrupted(Exception):
    """An `interrupt` steering message came while the model was asked: the call is given
    up, and the loop takes the message in and asks again."""


class ModelCallFailed(Exception):
    """The model call failed, for good or after its retries: its last `error`, after
    `attempts` tries."""

    def __init__(self, error: BaseException, attempts: int) -> None:
        super().__init__(describe(error))
        self.error, self.attempts = error, attempts


class StepText:
    """The text of one model turn as emitted, across retries of the call.

    A retried call streams its answer again from the start; what an earlier attempt
    already emitted is not emitted twice (if the new answer starts the same way).
    """

    def __init__(self, separator: str) -> None:
        self._separator = separator
        self.emitted = ""
        self._attempt = ""
        self.fed = False

    def begin_attempt(self) -> None:
        self._attempt, self.fed = "", False

    def feed(self, delta: str) -> str:
        self.fed = True
        if not delta:
            return ""
        self._attempt += delta
        target = self._separator + self._attempt
        if target.startswith(self.emitted):
            new, self.emitted = target[len(self.emitted):], target
            return new
        if self.emitted.startswith(target):
            return ""
        self.emitted += delta  # the answer diverged from what was shown; keep both
        return delta


async def traced(call: Callable[[], Awaitable[tuple[ModelResponse, int, int]]],
                 request: ModelRequest, *, agent_id: str,
                 run_id: str) -> tuple[ModelResponse, int, int]:
    """The model call (with its retries) as a GenAI `chat` span."""
    with tracing.span(f"chat {request.model}", tracing.CLIENT, attributes={
            "gen_ai.operation.name": "chat", "gen_ai.request.model": request.model,
            "gen_ai.agent.name": agent_id, "tether.run.id": run_id,
    }) as span:
        response, attempts, duration_ms = await call()
        usage = response.usage
        span.set_attributes({
            "gen_ai.usage.input_tokens": usage.input_tokens,
            "gen_ai.usage.output_tokens": usage.output_tokens,
            "tether.model.attempts": attempts})
        for name, value in (("gen_ai.provider.name", response.provider),
                            ("gen_ai.response.model", response.model),
                            ("gen_ai.response.id", response.request_id)):
            if value:
                span.set_attribute(name, value)
        if response.finish_reason:
            span.set_attribute("gen_ai.response.finish_reasons", [response.finish_reason])
        return response, attempts, duration_ms
