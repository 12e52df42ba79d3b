"""What a page shows of a run: pure functions from folded states to JSON documents."""

from collections.abc import Iterable, Sequence
from typing import Any

from tether.client.timeline import run_view
from tether.contract.messages import ProgressSignal
from tether.domain import spending
from tether.domain.branches import BranchDiff, Side
from tether.domain.fold import evolve
from tether.domain.run_state import RunState, as_builtins
from tether.ports import StoredEvent

# The tail of a run's streamed output a timeline carries; the run page has all of it.
OUTPUT_TAIL_CHARS = 2_000
STATUSES = ("starting", "running", "completed", "error", "aborted", "interrupted")


def run_document(state: RunState, signal: ProgressSignal | None = None, *,
                 output_chars: int | None = OUTPUT_TAIL_CHARS) -> dict[str, Any]:
    """One run as the timeline draws it: the client's `RunView` plus what a page needs on
    top (attempts, deadlines, the waterfall's moments, what a paused run waits for)."""
    view = run_view(state, signal)
    document = view.model_dump(mode="json", exclude={"output_parts"})
    text = view.output_text
    if output_chars is not None and len(text) > output_chars:
        document["output_text"], document["output_truncated"] = text[-output_chars:], True
    else:
        document["output_text"], document["output_truncated"] = text, False
    delivered = list(state.ledger.finish.values())  # when each finish hook was acknowledged
    document.update(
        parent={"agent": state.parent.agent, "name": state.parent.name},
        # The run as the owner of its nested runs: their `parent`.
        as_parent={"agent": state.agent_type, "name": state.as_parent().name},
        attempt=state.attempt,
        agent_version=state.agent_version,
        reattach_attempts=state.reattach_attempts,
        max_budget_deadline=state.max_budget_deadline,
        no_progress_deadline=state.no_progress_deadline,
        delivered_at=min(delivered) if delivered else None,
        pending=list(state.paused.pending) if state.paused else [],
        step_count=len(state.steps),
        finished=state.status in ("completed", "error", "aborted", "interrupted"),
        # An interrupted run that a request under its run id resumes (the UI's Re-request).
        resumable=state.resumable,
        budget=budget_document(state),
    )
    return document


def budget_document(state: RunState) -> dict[str, Any] | None:
    """Its budget in tokens and cost over it and the runs below it: the limits, spent,
    reserved by open runs below it, left; None without one."""
    if not spending.has_budget(state):
        return None
    used, held = spending.spent(state), spending.reserved(state)
    tokens, cost = spending.left(state)
    return {"max_tokens": state.max_tokens, "max_cost": state.max_cost,
            "spent_tokens": used.tokens, "reserved_tokens": held.tokens, "left_tokens": tokens,
            "spent_cost": used.cost, "reserved_cost": held.cost, "left_cost": cost}


def state_as_of(events: Iterable[StoredEvent], seq: int) -> RunState | None:
    """The run folded from its events up to stream sequence `seq` (inclusive)."""
    state: RunState | None = None
    for stored in events:
        if stored.seq > seq:
            break
        if stored.event is not None:
            state = evolve(state, stored.event, stored.logged_at).state
    return state


def event_documents(events: Sequence[StoredEvent]) -> list[dict[str, Any]]:
    """A run's events as its page lists them: sequence, type, time and payload."""
    documents = []
    for stored in events:
        if stored.event is None:
            documents.append({"seq": stored.seq, "type": "undecodable", "occurred_at": None,
                              "data": str(stored.error)})
            continue
        event = stored.event
        documents.append({"seq": stored.seq, "type": event.type,
                          "occurred_at": event.occurred_at,
                          "data": as_builtins(event.data)})
    return documents


def status_counts(rows: Iterable[tuple[str, str, str, int]]) -> list[dict[str, Any]]:
    """(agent, name, status, runs) rows -> one entry per parent with its counts by status."""
    parents: dict[tuple[str, str], dict[str, Any]] = {}
    for agent, name, status, runs in rows:
        entry = parents.setdefault((agent, name), {"agent": agent, "name": name, "total": 0,
                                                   "counts": dict.fromkeys(STATUSES, 0)})
        entry["counts"][status] = entry["counts"].get(status, 0) + runs
        entry["total"] += runs
    return [parents[key] for key in sorted(parents)]


def diff_document(compared: BranchDiff) -> dict[str, Any]:
    """Two runs side by side as the comparison page draws them: each one's outcome, usage
    and origin, where they part, the steps from there (paired, with what each says), and
    their output."""
    def side(one: Side) -> dict[str, Any]:
        return {"run_id": one.run_id, "agent_type": one.agent_type, "status": one.status,
                "summary": one.summary, "error": one.error, "output": one.output,
                "output_text": one.output_text, "steps": one.steps,
                "tokens": one.usage.tokens, "cost": one.usage.cost,
                "spent_tokens": one.spent.tokens, "forked_from": one.forked_from,
                "fork_seq": one.fork_seq}

    return {"a": side(compared.a), "b": side(compared.b), "shared": compared.shared,
            "diverged_at": compared.diverged_at, "same_output": compared.same_output,
            "same_outcome": compared.same_outcome,
            "steps": [{"index": pair.index, "same": pair.same, "a": pair.a, "b": pair.b}
                      for pair in compared.steps]}
