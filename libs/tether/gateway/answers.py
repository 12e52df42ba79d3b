"""The answer a paused run is sent through the gateway, checked against what it waits on,
for A2A and MCP alike: an answer that would resume the run with no decision (a
misspelt shape, an id it does not wait on, nothing at all) is refused with the field it
got wrong, because a run resumed with nothing has lost its human's approval for good.

Pure: a run's `pending` calls in, `Decisions` or `InvalidAnswer` out."""

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

ANSWER_FIELDS = ("approvals", "rejections", "tool_outputs", "human_input")


class InvalidAnswer(ValueError):
    """An answer the run cannot take; the message names the field."""


@dataclass(frozen=True)
class Decisions:
    """The `continue_run` answers of one message."""

    approvals: list[str] = field(default_factory=list)
    rejections: list[str] = field(default_factory=list)
    tool_outputs: dict[str, Any] = field(default_factory=dict)
    human_input: str | None = None

    @property
    def empty(self) -> bool:
        return not (self.approvals or self.rejections or self.tool_outputs
                    or self.human_input)

    def as_continue(self) -> dict[str, Any]:
        return {"approvals": self.approvals, "rejections": self.rejections,
                "tool_outputs": self.tool_outputs, "human_input": self.human_input}


def decisions_of(answers: Mapping[str, Any], pending: Iterable[Mapping[str, Any]], *,
                 where: str = "") -> Decisions:
    """The decisions of an answer `{"approvals": [ids], "rejections": [ids],
    "tool_outputs": {id: output}, "human_input": "words"}`, each id one of the calls in
    `pending`; `where` prefixes the field names in errors (`parts[0].data.`)."""
    unknown = sorted(set(answers) - set(ANSWER_FIELDS))
    if unknown:
        raise InvalidAnswer(f"{where}{unknown[0]}: not an answer; an answer holds "
                            f"{', '.join(ANSWER_FIELDS)}")
    waited_on = [str(item["tool_call_id"]) for item in pending if item.get("tool_call_id")]
    approvals = _ids(answers.get("approvals"), f"{where}approvals", waited_on)
    rejections = _ids(answers.get("rejections"), f"{where}rejections", waited_on)
    both = sorted(set(approvals) & set(rejections))
    if both:
        raise InvalidAnswer(f"{where}rejections: {both[0]!r} is approved and rejected")
    outputs = answers.get("tool_outputs")
    if outputs is None:
        outputs = {}
    if not isinstance(outputs, Mapping):
        raise InvalidAnswer(f"{where}tool_outputs: must be an object of tool call id to "
                            f"output, not {json_kind(outputs)}")
    for key in outputs:
        _check_waited_on(key, f"{where}tool_outputs.{key}", waited_on)
    human_input = answers.get("human_input")
    if human_input is not None and not isinstance(human_input, str):
        raise InvalidAnswer(f"{where}human_input: must be a string (the human's words), "
                            f"not {json_kind(human_input)}")
    return Decisions(approvals=approvals, rejections=rejections, tool_outputs=dict(outputs),
                     human_input=human_input if human_input and human_input.strip() else None)


def require_some(decisions: Decisions, run_id: str, waiting_for: str | None,
                 pending: Iterable[Mapping[str, Any]]) -> Decisions:
    """`decisions`, unless they answer nothing: a run resumed with nothing goes on
    without what it waited for."""
    if decisions.empty:
        raise InvalidAnswer(f"the answer to task {run_id} answers nothing: it is waiting "
                            f"for {waiting_words(waiting_for, pending)}")
    return decisions


def waiting_words(waiting_for: str | None, pending: Iterable[Mapping[str, Any]]) -> str:
    """What a paused run waits for, in words: "a human's approval of publish", "the
    output of search", or, with no call named, a human's input or the tools' output."""
    approvals: list[str] = []
    outputs: list[str] = []
    for item in pending:
        name = str(item.get("tool_name") or item.get("tool_call_id") or "a tool call")
        (approvals if item.get("reason") == "approval" else outputs).append(name)
    said = []
    if approvals:
        said.append(f"a human's approval of {_listed(approvals)}")
    if outputs:
        said.append(f"the output of {_listed(outputs)}")
    if said:
        return " and ".join(said)
    if waiting_for == "waiting_for_tools":
        return "the output of its tool calls"
    return "a human's input"


def _ids(value: Any, name: str, waited_on: list[str]) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise InvalidAnswer(f"{name}: must be a list of tool call ids, not {json_kind(value)}")
    for index, item in enumerate(value):
        if not isinstance(item, str):
            raise InvalidAnswer(f"{name}[{index}]: must be a tool call id (a string), not "
                                f"{json_kind(item)}")
        _check_waited_on(item, f"{name}[{index}]", waited_on)
    return list(dict.fromkeys(value))


def _check_waited_on(tool_call_id: str, name: str, waited_on: list[str]) -> None:
    if tool_call_id not in waited_on:
        raise InvalidAnswer(f"{name}: the task waits on no tool call {tool_call_id!r} "
                            f"(it waits on {sorted(waited_on)})")


def _listed(names: list[str]) -> str:
    unique = list(dict.fromkeys(names))
    return unique[0] if len(unique) == 1 else ", ".join(unique[:-1]) + " and " + unique[-1]


def json_kind(value: Any) -> str:
    """What a JSON value is, in words ("a list", "null"), for an error that names it."""
    return {bool: "a boolean", int: "a number", float: "a number", str: "a string",
            list: "a list", dict: "an object", type(None): "null"}.get(type(value),
                                                                     type(value).__name__)
