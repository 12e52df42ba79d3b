"""Subject and stream names of the wire contract (docs/contract.md).

Every name is derived from one prefix (default `tether`), so several Tether installations,
or several test cases, can share one NATS server without seeing each other.
"""

import re
from dataclasses import dataclass

from tether.domain.events import ParentRef
from tether.domain.ids import check_identifier

_PREFIX = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,31}$")
LEDGER_TOKEN = "_ledger"  # `<prefix>.evt.<agent>._ledger`: a parent agent's delivery ledger


def is_delivery_ledger(subject: str) -> bool:
    """Whether a subject of the events stream is a parent agent's delivery ledger, not a
    run's (`<prefix>.evt.<agent>.<name>.<run id>`, one token longer)."""
    return subject.endswith("." + LEDGER_TOKEN) and subject.count(".") == 3


@dataclass(frozen=True, slots=True)
class Subjects:
    prefix: str = "tether"

    def __post_init__(self) -> None:
        if not _PREFIX.fullmatch(self.prefix):
            raise ValueError(
                f"invalid subject prefix {self.prefix!r}: a letter, then at most 31 letters, "
                "digits, '_' or '-'"
            )

    # --- streams ---------------------------------------------------------------------
    def stream(self, kind: str) -> str:
        return f"{self.prefix.upper().replace('-', '_')}_{kind}"

    @property
    def commands_stream(self) -> str:
        return self.stream("CMD")

    @property
    def events_stream(self) -> str:
        return self.stream("EVENTS")

    @property
    def progress_stream(self) -> str:
        return self.stream("PROGRESS")

    @property
    def work_stream(self) -> str:
        return self.stream("WORK")

    @property
    def hooks_stream(self) -> str:
        return self.stream("HOOKS")

    @property
    def chat_stream(self) -> str:
        return self.stream("CHAT")

    # --- subjects --------------------------------------------------------------------
    def command(self, kind: str) -> str:
        return f"{self.prefix}.cmd.{kind}"

    def command_for(self, kind: str, parent: ParentRef) -> str:
        """The per-parent form `<prefix>.cmd.<kind>.<agent>.<name>`, which NATS permissions
        can grant to the application that owns the parent (see `tether.access`)."""
        return f"{self.prefix}.cmd.{kind}.{parent.agent}.{parent.name}"

    def rpc_for(self, kind: str, parent: ParentRef) -> str:
        return f"{self.prefix}.rpc.{kind}.{parent.agent}.{parent.name}"

    @property
    def command_dead_letters(self) -> str:
        """Commands that could not be parsed, with the reason in a `Tether-Error` header."""
        return f"{self.prefix}.cmd.dead_letter"

    def run_events(self, parent: ParentRef, run_id: str) -> str:
        return f"{self.prefix}.evt.{parent.agent}.{parent.name}.{check_identifier(run_id, 'run id')}"

    def parent_events(self, parent: ParentRef) -> str:
        return f"{self.prefix}.evt.{parent.agent}.{parent.name}.>"

    def delivery_ledger(self, parent_agent: str) -> str:
        """Where the parent records a batch of one parent agent's finish-hook deliveries
        (`deliveries.recorded`): in the events stream, beside the agent's runs, under a
        name no parent may have ('_' begins no identifier)."""
        return f"{self.prefix}.evt.{check_identifier(parent_agent, 'parent agent')}.{LEDGER_TOKEN}"

    @property
    def all_events(self) -> str:
        return f"{self.prefix}.evt.>"

    def run_live(self, parent: ParentRef, run_id: str) -> str:
        """Core: the events stream republishes each run event here once it is stored."""
        return (f"{self.prefix}.live.evt.{parent.agent}.{parent.name}."
                f"{check_identifier(run_id, 'run id')}")

    @property
    def all_live_events(self) -> str:
        return f"{self.prefix}.live.evt.>"

    def live(self, stored_subject: str) -> str:
        """Core: where the stream that stores `stored_subject` (an event, progress or chat
        subject) republishes it: `<prefix>.live.<kind>.<...>`."""
        prefix, _, rest = stored_subject.partition(".")
        if prefix != self.prefix or not rest:
            raise ValueError(f"{stored_subject!r} is not a subject under {self.prefix!r}")
        return f"{self.prefix}.live.{rest}"

    def run_progress(self, parent: ParentRef, run_id: str) -> str:
        return f"{self.prefix}.progress.{parent.agent}.{parent.name}.{check_identifier(run_id, 'run id')}"

    def parent_progress(self, parent: ParentRef) -> str:
        return f"{self.prefix}.progress.{parent.agent}.{parent.name}.>"

    def work(self, agent_type: str) -> str:
        return f"{self.prefix}.work.{check_identifier(agent_type, 'agent type')}"

    def hook(self, parent_agent: str, method: str) -> str:
        return (f"{self.prefix}.hook.{check_identifier(parent_agent, 'parent agent')}."
                f"{check_identifier(method, 'hook method')}")

    def chat(self, parent: ParentRef, run_id: str | None = None) -> str:
        """A parent instance's chat, or (`run_id`) the conversation of one of its runs
        (`tether.domain.chat`)."""
        if run_id is None:
            return f"{self.prefix}.chat.{parent.agent}.{parent.name}"
        return f"{self.prefix}.chat.{parent.agent}.{parent.name}.{check_identifier(run_id, 'run id')}"

    def cancel_signal(self, agent_type: str) -> str:
        return f"{self.prefix}.ctl.cancel.{check_identifier(agent_type, 'agent type')}"

    def message_signal(self, agent_type: str) -> str:
        """Core: the runner holding the run has a steering message to hand its child
        (`MessageSignal`)."""
        return f"{self.prefix}.ctl.message.{check_identifier(agent_type, 'agent type')}"

    def runner_versions(self, agent_type: str) -> str:
        """Core request to the runners of an agent type: which version of its code do you
        run? (`RunnerVersion`; every runner answers.)"""
        return f"{self.prefix}.ctl.versions.{check_identifier(agent_type, 'agent type')}"

    def inspect_child(self, agent_type: str) -> str:
        """Core request to the runners of an agent type: do you hold this run?"""
        return f"{self.prefix}.ctl.inspect.{check_identifier(agent_type, 'agent type')}"

    def awaiter(self, parent: ParentRef, run_id: str) -> str:
        """Core: the application awaiting the run answers here while it awaits; a request
        nobody answers (no responders) says the awaiting side is gone (docs/recovery.md)."""
        return (f"{self.prefix}.ctl.awaiter.{parent.agent}.{parent.name}."
                f"{check_identifier(run_id, 'run id')}")

    @property
    def registry_bucket(self) -> str:
        """KV: `hook.<parent_agent>.<method>` for every registered hook handler."""
        return self.stream("REGISTRY")

    @property
    def deliveries_bucket(self) -> str:
        """KV: one key per finish hook an application handled (adapters/deliveries.py)."""
        return self.stream("DELIVERIES")

    @property
    def slots_bucket(self) -> str:
        """KV: `<parent_agent>.<parent_name>` -> the parent's open runs, for the cap."""
        return self.stream("SLOTS")

    def rpc(self, kind: str) -> str:
        return f"{self.prefix}.rpc.{kind}"

    def observability(self, event: str, parent: ParentRef) -> str:
        """`agent_tool:recovery:row` of parent A/b ->
        `<prefix>.obs.A.b.agent_tool.recovery.row`: the parent in the subject, so that an
        application is granted its own parents' events (`tether.access`)."""
        return f"{self.prefix}.obs.{parent.agent}.{parent.name}.{event.replace(':', '.')}"

    def observing(self, pattern: str, parent_agent: str | None = None) -> str:
        """What `observe(pattern)` subscribes to: every parent's events, or one parent
        agent's (`agent_tool:detached:>` -> `<prefix>.obs.*.*.agent_tool.detached.>`)."""
        return f"{self.prefix}.obs.{parent_agent or '*'}.*.{pattern.replace(':', '.')}"

    def parse_run_events(self, subject: str) -> tuple[ParentRef, str]:
        """The parent and run id of a run-events subject."""
        parts = subject.split(".")
        if len(parts) != 5 or parts[0] != self.prefix or parts[1] != "evt":
            raise ValueError(f"{subject!r} is not a run-events subject under {self.prefix!r}")
        return ParentRef(agent=parts[2], name=parts[3]), parts[4]
