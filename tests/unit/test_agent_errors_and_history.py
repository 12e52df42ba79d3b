"""Error classification, Retry-After parsing, tool-history repair and output truncation."""

import pytest

from tether.agents import (
    Message,
    ModelError,
    ToolCall,
    is_context_overflow,
    is_retryable,
    repair_tool_history,
    retry_after_ms,
    truncate_tool_output,
)
from tether.agents.definition import ModelRetry
from tether.agents.errors import kind_for_status, parse_retry_after
from tether.agents.history import UNANSWERED_TOOL_CALL


@pytest.mark.parametrize(("error", "retryable"), [
    (ModelError("rate limited", status=429), True),
    (ModelError("bad gateway", status=502), True),
    (ModelError("timeout", kind="timeout"), True),
    (ModelError("reset", kind="connection"), True),
    (ModelError("bad request", status=400), False),
    (ModelError("no key", status=401), False),
    (ModelError("overloaded", status=400, retryable=True), True),
    (ModelError("too long", kind="context_overflow", status=500), False),
    (ModelError("garbage", kind="malformed_response", retryable=False), False),
    (TimeoutError("read timed out"), True),
    (ConnectionResetError("peer reset"), True),
    (ValueError("a bug"), False),
])
def test_which_errors_are_retryable(error: BaseException, retryable: bool) -> None:
    assert is_retryable(error) is retryable


def test_retry_after_comes_from_the_error_or_its_headers() -> None:
    assert retry_after_ms(ModelError("slow down", status=429, retry_after_ms=750)) == 750
    assert retry_after_ms(ModelError("slow down", status=429)) is None
    assert retry_after_ms(TimeoutError()) is None
    assert parse_retry_after({"Retry-After": "2"}) == 2000
    assert parse_retry_after({"retry-after": "0.5"}) == 500
    assert parse_retry_after({"retry-after-ms": "120", "Retry-After": "9"}) == 120
    assert parse_retry_after({"Retry-After": "Wed, 21 Oct 2015 07:28:03 GMT"},
                             now_s=1445412480.0) == 3000
    assert parse_retry_after({"Retry-After": "soon"}) is None
    assert parse_retry_after({}) is None


def test_context_overflow_is_recognised_by_kind_code_or_message() -> None:
    assert is_context_overflow(ModelError("x", kind="context_overflow"))
    assert is_context_overflow(ModelError("x", status=400, code="context_length_exceeded"))
    assert is_context_overflow(ModelError("This model's maximum context length is 8192 tokens",
                                          status=400))
    assert is_context_overflow(ValueError("prompt is too long: 210000 tokens > 200000 maximum"))
    assert not is_context_overflow(ModelError("rate limited: too many tokens per minute",
                                              status=429, kind="rate_limit"))
    assert not is_context_overflow(ModelError("bad request", status=400))
    assert kind_for_status(413, None, "Request exceeds the maximum context") == "context_overflow"
    assert kind_for_status(400, "context_length_exceeded") == "context_overflow"
    assert kind_for_status(503) == "server" and kind_for_status(404) == "not_found"


def test_the_backoff_grows_and_is_capped_and_retry_after_replaces_it() -> None:
    policy = ModelRetry(count=5, backoff_ms=100, multiplier=2, max_backoff_ms=500)
    assert [policy.delay_ms(n, None) for n in range(1, 6)] == [100, 200, 400, 500, 500]
    assert policy.delay_ms(1, 350) == 350
    assert policy.delay_ms(1, 60_000) == 500
    with pytest.raises(ValueError):
        ModelRetry(count=-1)


def call(call_id: str, name: str = "search") -> ToolCall:
    return ToolCall(id=call_id, name=name, input={"query": call_id})


def test_repair_answers_orphaned_calls_and_drops_results_without_a_call() -> None:
    messages = [
        Message.user("go"),
        Message.tool("ghost", "search", "answers nothing"),
        Message.assistant("", [call("a"), call("b")]),
        Message.tool("a", "search", "result a"),
        Message.user("interrupting"),  # b was never answered
        Message.assistant("", [call("c")]),
        Message.tool("c", "search", "result c"),
        Message.tool("c", "search", "a second answer"),
        Message.assistant("", [call("d")]),
    ]
    repaired = repair_tool_history(messages)
    assert [(m.role, m.tool_call_id, m.content) for m in repaired] == [
        ("user", None, "go"),
        ("assistant", None, ""),
        ("tool", "a", "result a"),
        ("tool", "b", UNANSWERED_TOOL_CALL),
        ("user", None, "interrupting"),
        ("assistant", None, ""),
        ("tool", "c", "result c"),
        ("assistant", None, ""),
        ("tool", "d", UNANSWERED_TOOL_CALL),
    ]
    assert repaired[3].is_error and repaired[3].name == "search"
    assert repair_tool_history(repaired) == repaired, "a repaired history needs no repair"


def test_truncation_keeps_head_and_tail_with_a_notice_within_the_limit() -> None:
    text = "HEAD" + "x" * 1000 + "TAIL"
    cut = truncate_tool_output(text, 60)
    assert len(cut) == 60
    assert cut.startswith("HEAD") and cut.endswith("TAIL")
    kept = len(cut) - len(cut[cut.index("\n"):cut.rindex("\n") + 1])
    assert f"{len(text) - kept} characters truncated" in cut
    assert truncate_tool_output("short", 60) == "short"
    assert truncate_tool_output(text, 10) == text[:10], "no room for a notice: a plain cut"
    with pytest.raises(ValueError):
        truncate_tool_output(text, -1)
