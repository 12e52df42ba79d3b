"""Keeping a conversation acceptable to a model: tool-history repair and output truncation."""

from tether.agents.model_messages import Message

UNANSWERED_TOOL_CALL = "This tool call was not answered (the run was interrupted before it ran)."


def repair_tool_history(messages: "list[Message] | tuple[Message, ...]") -> list[Message]:
    """Answer orphaned tool calls and drop tool results that answer no call.

    Providers reject a history in which an assistant's tool call has no result before the
    next turn, or a tool result names no earlier call. An orphaned call gets an error
    result right after the results that were given; a result for an unknown (or already
    answered) call is dropped. Everything else keeps its order.
    """
    repaired: list[Message] = []
    open_calls: dict[str, str] = {}  # id -> tool name, of the latest assistant turn

    def close_open_calls() -> None:
        for call_id, name in open_calls.items():
            repaired.append(Message.tool(call_id, name, UNANSWERED_TOOL_CALL, is_error=True))
        open_calls.clear()

    for message in messages:
        if message.role == "tool":
            if message.tool_call_id in open_calls:
                del open_calls[message.tool_call_id]
                repaired.append(message)
            continue
        close_open_calls()
        repaired.append(message)
        if message.role == "assistant":
            open_calls.update({call.id: call.name for call in message.tool_calls})
    close_open_calls()
    return repaired


def truncate_tool_output(text: str, limit: int) -> str:
    """Keep the head and the tail of `text` within `limit` characters, saying what was cut."""
    if limit < 0:
        raise ValueError(f"limit must be >= 0, not {limit}")
    if len(text) <= limit:
        return text
    cut = len(text) - limit
    # The notice's own length depends on the count it shows; settle it in two passes.
    for _ in range(2):
        notice = f"\n[… {cut} characters truncated …]\n"
        kept = limit - len(notice)
        if kept <= 0:
            return text[:limit]
        cut = len(text) - kept
    head = (kept + 1) // 2
    tail = kept - head
    return text[:head] + notice + (text[len(text) - tail:] if tail else "")
