"""Identifiers that end up in NATS subjects and Postgres keys.

A run id, an agent or parent name and a hook method name all travel inside subjects
(`tether.evt.<agent>.<name>.<run_id>`), so anything that could add a token, a wildcard or
whitespace is refused before it reaches one.
"""

import hashlib
import re
from functools import lru_cache
from typing import Annotated

import msgspec
from pydantic import StringConstraints

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
    digest = hashlib.blake2b(f"{parent_agent}/{parent_name}/{run_id}".encode(),
                             digest_size=_TREE_DIGEST_BYTES).hexdigest()
    return f"{run_id[:_MAX_IDENTIFIER - len(digest) - 1]}:{digest}"


@lru_cache(maxsize=4096)  # each process folds a run's request several times
def incarnation_of(requested_event_id: str) -> str:
    """A short token for one life of a run id, from the id of the `run.requested` that began
    it. A cleared run id may be requested again at once: every id derived for its new life
    (events, work items, hooks, chat messages) carries the token, so the streams' duplicate
    windows never mistake it for the earlier life's."""
    return hashlib.blake2b(requested_event_id.encode(), digest_size=5).hexdigest()
