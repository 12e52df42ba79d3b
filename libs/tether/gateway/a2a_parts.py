"""An A2A message's parts as what Tether takes: a run's input (a data part, or text for
an agent whose input is one text field), or a paused run's answer (a data part of
decisions, or text: the human's words). A part that says something else (a file, a URL,
raw bytes, a text beside the input's data part) is refused by its place, `parts[i]`,
rather than dropped: a dropped part runs the agent on less than the caller sent."""

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from a2a.types import Part
from google.protobuf.json_format import MessageToDict

from tether.gateway.answers import ANSWER_FIELDS, Decisions, InvalidAnswer, decisions_of

KINDS = {"file": "a file", "raw": "a raw bytes", "url": "a URL", "data": "a data",
         "text": "a text"}


def input_of(parts: Sequence[Part], agent_type: str, text_field: str | None) -> dict[str, Any]:
    """The run's input a message to `agent_type` carries; `InvalidAnswer` (naming the
    part) when it carries anything else as well, or nothing."""
    takes = (f"{agent_type} takes one data part with its input (see its card)"
             + (f", or text (its {text_field!r})" if text_field else ""))
    if not parts:
        raise InvalidAnswer(f"message.parts: empty; {takes}")
    kinds = [_kind(part) for part in parts]
    for index, kind in enumerate(kinds):
        if kind not in ("data", "text"):
            raise InvalidAnswer(f"parts[{index}]: {KINDS.get(kind, 'an unknown')} part is "
                                f"not taken; {takes}")
    if "data" in kinds:
        for index, kind in enumerate(kinds):
            if index != kinds.index("data"):
                raise InvalidAnswer(f"parts[{index}]: {KINDS[kind]} part beside the data "
                                    f"part at parts[{kinds.index('data')}]; {takes}")
        value = MessageToDict(parts[kinds.index("data")].data)
        if not isinstance(value, dict):
            raise InvalidAnswer(f"parts[{kinds.index('data')}].data: must be an object "
                                f"(the agent's input); {takes}")
        return value
    if text_field is None:
        raise InvalidAnswer(f"parts[0]: a text part is not taken; {takes}")
    return {text_field: "".join(part.text for part in parts)}


def answer_of(parts: Sequence[Part], pending: Iterable[Mapping[str, Any]]) -> Decisions:
    """The decisions of a message answering a paused run: a data part of `approvals`,
    `rejections`, `tool_outputs`, `human_input`, and/or text (the human's words)."""
    pending = list(pending)
    data: tuple[int, Any] | None = None
    texts: list[str] = []
    for index, part in enumerate(parts):
        kind = _kind(part)
        if kind == "text":
            texts.append(part.text)
        elif kind == "data" and data is None:
            data = (index, MessageToDict(part.data))
        elif kind == "data":
            raise InvalidAnswer(f"parts[{index}]: a second data part; an answer is one data "
                                f"part {{{', '.join(ANSWER_FIELDS)}}} and/or text")
        else:
            raise InvalidAnswer(f"parts[{index}]: {KINDS.get(kind, 'an unknown')} part is "
                                f"no answer; an answer is a data part "
                                f"{{{', '.join(ANSWER_FIELDS)}}} and/or text")
    answers: Mapping[str, Any] = {}
    if data is not None:
        index, answers = data
        if not isinstance(answers, dict):
            raise InvalidAnswer(f"parts[{index}].data: must be an object "
                                f"{{{', '.join(ANSWER_FIELDS)}}}")
    text = "".join(texts)
    if text and answers.get("human_input") is not None:
        raise InvalidAnswer("parts: both text and a data part's human_input; send the "
                            "human's words once")
    if text:
        answers = {**answers, "human_input": text}
    where = f"parts[{data[0]}].data." if data is not None else ""
    return decisions_of(answers, pending, where=where)


def _kind(part: Part) -> str:
    return part.WhichOneof("content") or "empty"
