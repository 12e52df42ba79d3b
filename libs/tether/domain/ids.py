"""Identifiers that end up in NATS subjects and Postgres keys.

A run id, an agent or parent name and a hook method name all travel inside subjects
(`tether.evt.<agent>.<name>.<run_id>`), so anything that could add a token, a wildcard or
whitespace is refused before it reaches one.
"""

from __future__ import annotations

import hashlib
import json
import re
from functools import lru_cache
from typing import TYPE_CHECKING, Annotated, Any

import msgspec
from pydantic import StringConstraints
from pydantic_core import to_jsonable_python

if TYPE_CHECKING:
    from tether.domain.chat import ChatKey
    from tether.domain.events import ParentRef
    from tether.domain.run_state import RunState

IDENTIFIER_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_:-]{0,127}$"
_IDENTIFIER = re.compile(IDENTIFIER_PATTERN)


def _whole(pattern: str) -> str:
    r"""`pattern` for msgspec, which matches with Python's `re.search`: there `$` also
    matches before a last newline, so `(?!\n)` refuses one. JSON Schema's (ECMAScript)
    `$` is already the end, where the lookahead changes nothing."""
    return pattern + r"(?!\n)"


# Pydantic models (commands, messages) check it by its pattern; the records that hold one
# (events and their parts) check theirs with `check_identifier` as they are made or
# decoded.
Identifier = Annotated[str, StringConstraints(pattern=IDENTIFIER_PATTERN)]


class InvalidIdentifier(ValueError):
    """An identifier that would be unsafe in a subject or a key."""


# Identifiers that passed, so that each is searched for once: a run's id and parent come
# back in every event of the run and every subject made for it, and a pattern search each
# time would cost more than decoding the rest of the event.
_PASSED: set[str] = set()
_PASSED_LIMIT = 16_384


def check_identifier(value: object, what: str = "identifier") -> str:
    if type(value) is str and value in _PASSED:
        return value
    if not isinstance(value, str) or _IDENTIFIER.fullmatch(value) is None:
        raise InvalidIdentifier(
            f"invalid {what} {value!r}: it must match {IDENTIFIER_PATTERN} "
            "(a letter or digit, then at most 127 letters, digits, '_', ':' or '-')"
        )
    if len(_PASSED) >= _PASSED_LIMIT:
        _PASSED.clear()
    _PASSED.add(value)
    return value


EVENT_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_:.-]{0,299}$"
EventId = Annotated[str, StringConstraints(pattern=EVENT_ID_PATTERN),
                    msgspec.Meta(pattern=_whole(EVENT_ID_PATTERN))]


def derived_event_id(run_id: str, *parts: object) -> str:
    """A deterministic event id, so that a retried append is deduplicated by the log."""
    return ":".join([run_id, *(str(part) for part in parts)])


def run_token(agent: str, name: str, run_id: str) -> str:
    """A short token for one run of one parent (80 bits), for the ids of events one run
    appends about another (a budget's charges and reservations of a run below it): run
    ids and names may hold what an event id may not, and are long."""
    return hashlib.blake2b(f"{agent}/{name}/{run_id}".encode(),
                           digest_size=_TREE_DIGEST_BYTES).hexdigest()


def delivery_batch_id(parent_agent: str, deliveries: list[str]) -> str:
    """`deliveries:<agent>:<digest>`: the id of a batch of one parent agent's finish-hook
    deliveries (`deliveries.recorded`), from what it records (each its parent's name, the
    hook's method and message id, which names the run and its life), so a command
    handled again appends a repeat the log drops."""
    digest = hashlib.blake2b("\n".join(sorted(deliveries)).encode(),
                             digest_size=_TREE_DIGEST_BYTES).hexdigest()
    return f"deliveries:{parent_agent}:{digest}"


def parent_scope(agent: str, name: str) -> str:
    """A short token for one parent instance, for ids that must not be mistaken for those
    of another parent's run with the same run id."""
    return hashlib.blake2b(f"{agent}/{name}".encode(), digest_size=4).hexdigest()


# The digest that makes a run's name as a parent its own: 80 bits, so no parent can pick
# a run id whose name collides with another tree's by searching for one.
_TREE_DIGEST_BYTES = 10
_MAX_IDENTIFIER = 128


def nested_parent_name(parent_agent: str, parent_name: str, run_id: str) -> str:
    """The name of run `run_id` of parent `parent_agent/parent_name` as the parent of the
    runs it starts (nested agent tools): `<run id>:<digest of its full path>`.

    A run id is unique per parent only, so the run id alone would make two parents' runs
    of one id share their nested runs; the digest of the owner and the run id (the owner
    being a nested run's own such name, the whole path from the root is in it) keeps every
    tree apart, across parents and tenants. A long run id is cut to fit an identifier; the
    digest still names all of it.
    """
    return _with_digest(run_id, ":", f"{parent_agent}/{parent_name}/{run_id}")


def remote_run_id(parent_agent: str, parent_name: str, run_id: str, incarnation: str) -> str:
    """The id run `run_id` of parent `parent_agent/parent_name` goes by at a remote agent
    (an MCP call's `_meta["io.tether/run_id"]`; the ids of its messages to an A2A agent):
    `<run id>-<digest of its parent, its run id and its life>`.

    A remote that takes a repeated id for a repeated call (a Tether gateway does: the call
    made again after a crash finds its run) would take two parents' runs of one run id,
    or two lives of one (cleared, then asked for again), for one call, and give the
    second the first one's answer. A long run id is cut to fit an identifier; the digest
    still names all of it.
    """
    return _with_digest(run_id, "-", f"{parent_agent}/{parent_name}/{run_id}/{incarnation}")


def _with_digest(run_id: str, separator: str, named: str) -> str:
    """`<run id><separator><digest of named>`, the run id cut to fit an identifier."""
    digest = hashlib.blake2b(named.encode(), digest_size=_TREE_DIGEST_BYTES).hexdigest()
    return f"{run_id[:_MAX_IDENTIFIER - len(digest) - 1]}{separator}{digest}"


@lru_cache(maxsize=4096)  # each process folds a run's request several times
def incarnation_of(requested_event_id: str) -> str:
    """A short token for one life of a run id, from the id of the `run.requested` that began
    it. A cleared run id may be requested again at once: every id derived for its new life
    (events, work items, hooks, chat messages) carries the token, so the streams' duplicate
    windows never mistake it for the earlier life's."""
    return hashlib.blake2b(requested_event_id.encode(), digest_size=5).hexdigest()


def command_seq_of(causation_id: str | None) -> int | None:
    """`cmd:<seq>` (`decide.Cause.causation_id` of a command) -> seq."""
    if causation_id is None or not causation_id.startswith("cmd:"):
        return None
    seq = causation_id[4:]
    return int(seq) if seq.isdigit() else None


# --- idempotency: the ids that make a retry harmless ------------------------------------
#
# Event ids derive from the run and the decision's cause (`derived_event_id`, `Cause`),
# so the log keeps one copy of an event appended twice; the message ids below are what
# the streams' duplicate windows deduplicate publishes by. Every such id is made here.

GLOBAL_FINISH_HOOK = "on_agent_tool_finish"
TOOL_RUN_ID_PREFIX = "agent-tool:"
_RUN_ID_UNSAFE = re.compile(r"[^A-Za-z0-9_:-]")
_MAX_RUN_ID = 128


def tool_run_id(tool_call_id: str) -> str:
    """`agent-tool:<tool_call_id>`, made safe for a subject when the id is not.

    An id that had to be changed (or shortened) gets a hash of the original, so two
    different tool calls never share a run id.
    """
    if not tool_call_id:
        raise ValueError("a tool call id is required")
    return _safe_run_id(TOOL_RUN_ID_PREFIX, tool_call_id)


def framework_run_id(framework: str, *scope: str) -> str:
    """`<framework>-<scope>`: the id of the run a framework's Tether tool starts outside a
    Tether run, from what names the call there (its agent run or thread, then its tool
    call id), so the same call made again finds the same run; made safe like
    `tool_run_id`."""
    if not all(scope):
        raise ValueError(f"a {framework} tool call is named by its run and its tool call id")
    return _safe_run_id(f"{framework}-", "-".join(scope))


def _safe_run_id(prefix: str, raw: str) -> str:
    """`prefix + raw`, with what a subject cannot carry replaced and a hash of `raw` added
    when it had to be changed or shortened."""
    safe = _RUN_ID_UNSAFE.sub("-", raw)
    run_id = prefix + safe
    if safe != raw or len(run_id) > _MAX_RUN_ID:
        digest = hashlib.sha256(raw.encode()).hexdigest()[:16]
        run_id = f"{prefix}{safe[:_MAX_RUN_ID - len(prefix) - 17]}-{digest}"
    return check_identifier(run_id, "run id")


# Message ids end with the run's incarnation (`RunState.incarnation`): a run id cleared and
# requested again is a new life of it, whose messages the streams' duplicate windows must
# not drop as repeats of the earlier life's.

def _life(incarnation: str) -> str:
    return f":{incarnation}" if incarnation else ""




def nested_call_digest(agent_type: str, input: Any) -> str:
    """What makes a nested call the same call again: a digest of its agent type and its
    input (as JSON, keys sorted)."""
    canonical = json.dumps([agent_type, to_jsonable_python(input)], sort_keys=True,
                           separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:12]


def nested_run_id(run_id: str, call: str, n: int) -> str:
    """`<run_id>:<call>:<n>`: the `n`-th nested call alike (`nested_call_digest`) of run
    `run_id`; a run id too long for it is hashed."""
    suffix = f":{call}:{n}"
    owner = run_id
    if len(owner) + len(suffix) > 128:
        owner = hashlib.sha256(owner.encode()).hexdigest()[:16]
    return check_identifier(owner + suffix, "run id")


def run_message_id(run_id: str, vacated_at: int = 0, parent: ParentRef | None = None) -> str:
    """A run request's id: `run:<parent_agent>/<parent_name>/<run_id>` (`run:<run_id>`
    without a parent), with `:<seq>` after it when the run id has events but no run (the
    last was a rejection or a clear, at stream sequence `seq`). Requests for one run
    repeated inside the duplicate window make one command, two parents' runs of one run
    id are two, and a request after a rejection or a clear is a new one that reaches the
    parent."""
    key = run_id if parent is None else f"{parent.agent}/{parent.name}/{run_id}"
    return f"run:{key}:{vacated_at}" if vacated_at else f"run:{key}"


def work_message_id(run_id: str, dispatch: int, why: str = "start", incarnation: str = "") -> str:
    """`work:<run_id>:<why>:<n>:<incarnation>`: a re-dispatch for a new reason is never
    mistaken for a retry of an earlier one inside the stream's duplicate window."""
    return f"work:{run_id}:{why}:{dispatch}{_life(incarnation)}"


def finish_message_id(state: RunState, status: str, method: str) -> str:
    """`finish:<run_id>:<status>:<incarnation>` (`finish-global:...` for the parent's
    global finish hook); a retry after the lease adds `:retry<n>`."""
    return finish_id_head(state.run_id, status, method) + _life(state.incarnation)


def finish_id_head(run_id: str, status: str, method: str) -> str:
    """A finish hook's message id without the run's life: what every life's shares."""
    prefix = "finish-global" if method == GLOBAL_FINISH_HOOK else "finish"
    return f"{prefix}:{run_id}:{status}"


def unknown_life_finish_id(run_id: str, status: str, method: str) -> str:
    """The id of a hook message that came without one: it names no life of the run."""
    return finish_id_head(run_id, status, method)


def names_this_life(message_id: str, state: RunState, status: str, method: str) -> bool:
    """Whether a hook's message id names this life of the run, not a cleared earlier one.
    An id without an incarnation (from an earlier version) names no life, and passes."""
    head = finish_id_head(state.run_id, status, method)
    return any(message_id == head + life or message_id.startswith(f"{head}{life}:retry")
               for life in (_life(state.incarnation), ""))


def chat_finish_id(state: RunState, status: str) -> str:
    return f"detached-finish:{state.run_id}:{status}{_life(state.incarnation)}"


def chat_milestone_id(state: RunState, name: str) -> str:
    return f"detached-ms:{state.run_id}:{name}{_life(state.incarnation)}"


def user_message_id(chat: ChatKey, message_id: str) -> str:
    """The chat message id of a conversation's user message (a `message` command),
    `user:<parent_agent>/<parent_name>[/<run_id>]/<message_id>`: the chat stream's
    duplicate window is the whole stream's, so the id names the conversation (its parent
    instance and, for a run's conversation, the run; `/` is in no identifier, so no two
    conversations' ids read alike), and another application's message with the same
    `message_id` is another message."""
    run = "" if chat.run_id is None else f"/{chat.run_id}"
    return f"user:{chat.parent.agent}/{chat.parent.name}{run}/{message_id}"


def reply_message_id(run_id: str, incarnation: str, call: int) -> str:
    """The chat message id of a model parent's answer to one conversation call,
    `reply:<run_id>:<incarnation>:<call>`: the run's life names it among every parent's."""
    return f"reply:{run_id}:{incarnation}:{call}"


def fork_run_id(run_id: str, at: str, input: Any, overrides: Any) -> str:
    """A fork's run id, `<run_id>:fork-<digest>`: the digest of where it is taken and what it
    changes, so the same fork asked for twice is one fork (a long run id is cut to fit)."""
    what = json.dumps([at, input, overrides], sort_keys=True, separators=(",", ":"))
    digest = hashlib.blake2b(what.encode(), digest_size=6).hexdigest()
    return f"{run_id[:_MAX_IDENTIFIER - len(digest) - 6]}:fork-{digest}"
