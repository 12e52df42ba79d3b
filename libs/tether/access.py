"""Who may publish and subscribe where: the NATS users of a Tether installation.

Each service gets a user whose permissions are what its role needs; an application gets
a user that may act only for the parent agents it owns. The rules are generated from the
contract (`Subjects`), so a changed prefix or a new stream cannot drift from them, and
rendered as a nats-server `authorization` block (`deploy/nats/auth.conf`):

    python -m tether.access --application demo:Assistant:on_import_done > deploy/nats/auth.conf

Passwords are not in the file: each user's is `$TETHER_NATS_<USER>_PASSWORD`, which the
server resolves from its environment (a Kubernetes Secret, compose's environment).

An application may act for its own parents only. That needs the parent in the subject of
everything it sends: commands on `<prefix>.cmd.<kind>.<parent_agent>.<parent_name>` and
queries on `<prefix>.rpc.<kind>.<parent_agent>.<parent_name>` (the parent service must
refuse a payload that names another parent than its subject), timeline consumers created by name so the
filter is part of the API subject (`$JS.API.CONSUMER.CREATE.<stream>.<name>.<filter>`,
which the server matches against the request), an awaited run's events on its live
subject (`<prefix>.live.evt.<parent_agent>.<parent_name>.<run_id>`, republished by the
events stream) with its stored events read through requests that name the run
(`tether.client.live`), its presence as the awaiter of a run answered on
`<prefix>.ctl.awaiter.<parent_agent>.<parent_name>.<run_id>`, replies on an inbox of its own
(`_INBOX_<user>.>`, the client's `inbox_prefix`), and the hook ledger recorded by the
parent service (`<prefix>.cmd.delivered.<parent_agent>.<parent_name>`) instead of an
event the application appends itself. It may not publish work, events or hooks.
"""

import argparse
import json
import sys
from dataclasses import dataclass, field

from tether.contract.subjects import Subjects
from tether.domain.ids import check_identifier

SERVICE_ROLES = ("parent", "child-runner", "reconciler", "projector")
COMMAND_KINDS = ("run", "cancel", "clear", "continue", "delivered", "message")
QUERY_KINDS = ("inspect", "list", "has_run")
ADMIN_USER = "operator"


@dataclass(frozen=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    allow_responses: bool = False

    def as_config(self) -> dict:
        config: dict = {"publish": {"allow": list(self.publish)},
                        "subscribe": {"allow": list(self.subscribe)}}
        if self.allow_responses:
            # Replies to requests it received, to whatever inbox the requester uses,
            # without a publish permission on every inbox.
            config["allow_responses"] = True
        return config


@dataclass(frozen=True)
class Application:
    """An application's user, the parent agents it owns, and the hook methods it serves."""

    user: str
    parent_agents: tuple[str, ...]
    hook_methods: tuple[str, ...] = ()
    inbox_prefix: str = field(default="")

    def __post_init__(self) -> None:
        check_identifier(self.user, "application user")
        for agent in self.parent_agents:
            check_identifier(agent, "parent agent")
        for method in self.hook_methods:
            check_identifier(method, "hook method")
        if not self.inbox_prefix:
            object.__setattr__(self, "inbox_prefix", f"_INBOX_{self.user}")

    @classmethod
    def parse(cls, text: str) -> "Application":
        """`user:Agent1,Agent2[:method1,method2]`."""
        user, _, rest = text.partition(":")
        agents, _, methods = rest.partition(":")
        return cls(user, tuple(filter(None, agents.split(","))),
                   tuple(filter(None, methods.split(","))))


def _streams(subjects: Subjects) -> list[str]:
    names = [subjects.commands_stream, subjects.events_stream, subjects.progress_stream,
             subjects.work_stream, subjects.hooks_stream, subjects.chat_stream]
    return [*names, f"KV_{subjects.registry_bucket}", f"KV_{subjects.slots_bucket}",
            f"KV_{subjects.deliveries_bucket}"]


def _provision(subjects: Subjects) -> list[str]:
    """Every service creates or updates the streams and buckets at start-up."""
    rules = ["$JS.API.INFO"]
    for stream in _streams(subjects):
        rules += [f"$JS.API.STREAM.{op}.{stream}" for op in ("CREATE", "UPDATE", "INFO")]
    return rules


def _read_log(subjects: Subjects) -> list[str]:
    """Replay a run or the whole log: ordered consumers and last-message lookups."""
    events = subjects.events_stream
    return [f"$JS.API.CONSUMER.CREATE.{events}", f"$JS.API.CONSUMER.CREATE.{events}.>",
            f"$JS.API.DIRECT.GET.{events}", f"$JS.API.DIRECT.GET.{events}.>",
            f"$JS.API.STREAM.MSG.GET.{events}", "$JS.FC.>"]


def _pull(stream: str, consumer: str) -> list[str]:
    """A durable pull consumer: create or update it, fetch, acknowledge."""
    return [f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.{consumer}",
            f"$JS.API.CONSUMER.CREATE.{stream}.{consumer}",
            f"$JS.API.CONSUMER.CREATE.{stream}.{consumer}.>",
            f"$JS.API.CONSUMER.INFO.{stream}.{consumer}",
            f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer}",
            f"$JS.ACK.{stream}.{consumer}.>"]


def _kv_read(bucket: str) -> list[str]:
    return [f"$JS.API.DIRECT.GET.KV_{bucket}.>", f"$JS.API.STREAM.MSG.GET.KV_{bucket}"]


def service_permissions(subjects: Subjects, role: str) -> Permissions:
    p = subjects.prefix
    common = _provision(subjects) + _read_log(subjects)
    if role == "parent":
        publish = [f"{p}.evt.>", f"{p}.work.>", f"{p}.hook.>", f"{p}.chat.>",
                   subjects.command_dead_letters, f"{p}.ctl.cancel.>",
                   f"$KV.{subjects.slots_bucket}.>",
                   *_kv_read(subjects.slots_bucket), *_kv_read(subjects.registry_bucket),
                   *_kv_read(subjects.deliveries_bucket),
                   *_pull(subjects.commands_stream, "parent-commands"),
                   *_pull(subjects.events_stream, "parent-deliverer"),
                   # `clear` purges a run's events and progress.
                   f"$JS.API.STREAM.PURGE.{subjects.events_stream}",
                   f"$JS.API.STREAM.PURGE.{subjects.progress_stream}",
                   # /metrics: the hook consumers' backlog.
                   f"$JS.API.CONSUMER.LIST.{subjects.hooks_stream}"]
        return Permissions(tuple(common + publish), (f"{p}.rpc.>", "_INBOX.>"), True)
    if role == "child-runner":
        work = subjects.work_stream
        publish = [f"{p}.evt.>", f"{p}.progress.>",
                   # A model parent answers in its conversation.
                   f"{p}.chat.>",
                   # A child that delegates (nested agent tools) is a parent of its own runs.
                   f"{p}.cmd.>",
                   f"$JS.API.CONSUMER.DURABLE.CREATE.{work}.>", f"$JS.API.CONSUMER.CREATE.{work}.>",
                   f"$JS.API.CONSUMER.INFO.{work}.>", f"$JS.API.CONSUMER.MSG.NEXT.{work}.>",
                   f"$JS.ACK.{work}.>"]
        # Its delegated runs are awaited on their live subjects, and it answers for them
        # as their awaiter.
        return Permissions(tuple(common + publish),
                           (f"{p}.ctl.cancel.>", f"{p}.ctl.inspect.>", subjects.all_live_events,
                            f"{p}.ctl.awaiter.>", "_INBOX.>",
                            # A model parent's on_progress follows its runs' progress.
                            f"{p}.progress.>"), True)
    if role == "reconciler":
        publish = [f"{p}.evt.>", f"{p}.hook.>", f"{p}.chat.>", f"{p}.obs.>",
                   f"{p}.ctl.cancel.>", f"{p}.ctl.inspect.>", f"{p}.ctl.awaiter.>",
                   *_kv_read(subjects.registry_bucket), *_kv_read(subjects.deliveries_bucket)]
        return Permissions(tuple(common + publish), ("_INBOX.>",))
    if role == "projector":
        return Permissions(tuple(common), ("_INBOX.>",))
    raise ValueError(f"unknown role {role!r}; the roles are {', '.join(SERVICE_ROLES)}")


def application_permissions(subjects: Subjects, app: Application) -> Permissions:
    p = subjects.prefix
    deliveries = subjects.deliveries_bucket
    publish: list[str] = ["$JS.FC.>", f"$JS.API.STREAM.INFO.KV_{subjects.registry_bucket}",
                          f"$JS.API.STREAM.INFO.KV_{deliveries}"]
    subscribe: list[str] = [f"{app.inbox_prefix}.>"]
    feeds = ((subjects.events_stream, "evt"), (subjects.progress_stream, "progress"),
             (subjects.chat_stream, "chat"))
    for agent in app.parent_agents:
        publish += [f"{p}.cmd.{kind}.{agent}.*" for kind in COMMAND_KINDS]
        publish += [f"{p}.rpc.{kind}.{agent}.*" for kind in QUERY_KINDS]
        for stream, kind in feeds:
            # The filter is in the subject, so the server refuses another parent's.
            publish.append(f"$JS.API.CONSUMER.CREATE.{stream}.*.{p}.{kind}.{agent}.>")
        publish.append(f"$JS.API.DIRECT.GET.{subjects.events_stream}.{p}.evt.{agent}.>")
        # An awaited run's events, as the events stream republishes them, and the
        # reconciler's question whether the run is still awaited (answered to its inbox).
        subscribe += [f"{p}.live.evt.{agent}.>", f"{p}.ctl.awaiter.{agent}.>"]
        publish.append(f"$KV.{subjects.registry_bucket}.hook.{agent}.*")
        # Its hook handlers' own delivery records (adapters/deliveries.py).
        publish += [f"$KV.{deliveries}.{agent}.>",
                    f"$JS.API.DIRECT.GET.KV_{deliveries}.$KV.{deliveries}.{agent}.>"]
        for method in app.hook_methods:
            consumer = f"hooks-{agent}-{method}"
            hooks = subjects.hooks_stream
            publish += [f"$JS.API.CONSUMER.CREATE.{hooks}.{consumer}.{p}.hook.{agent}.{method}",
                        f"$JS.API.CONSUMER.INFO.{hooks}.{consumer}",
                        f"$JS.API.CONSUMER.MSG.NEXT.{hooks}.{consumer}",
                        f"$JS.ACK.{hooks}.{consumer}.>"]
    for stream, _ in feeds:
        publish.append(f"$JS.API.CONSUMER.INFO.{stream}.*")
    return Permissions(tuple(publish), tuple(subscribe), True)


def password_variable(user: str) -> str:
    return "TETHER_NATS_" + user.upper().replace("-", "_") + "_PASSWORD"


def authorization(subjects: Subjects, applications: list[Application], *,
                  passwords: dict[str, str] | None = None) -> dict:
    """The `authorization` block; passwords are `$VARIABLE` references unless given."""
    def password(user: str) -> str:
        if passwords is not None:
            return json.dumps(passwords[user])
        return "$" + password_variable(user)

    users = [{"user": role, "password": password(role),
              "permissions": service_permissions(subjects, role).as_config()}
             for role in SERVICE_ROLES]
    users += [{"user": app.user, "password": password(app.user),
               "permissions": application_permissions(subjects, app).as_config()}
              for app in applications]
    users.append({"user": ADMIN_USER, "password": password(ADMIN_USER),
                  "permissions": {"publish": {"allow": [">"]}, "subscribe": {"allow": [">"]}}})
    return {"users": users}


def render(subjects: Subjects, applications: list[Application], *,
           passwords: dict[str, str] | None = None, header: str = "") -> str:
    """nats-server configuration text (its format reads JSON values; passwords stay bare
    `$VARIABLE` references, which is why this is not plain json.dumps)."""
    lines = [header] if header else []
    lines.append("authorization {")
    lines.append("  users = [")
    for user in authorization(subjects, applications, passwords=passwords)["users"]:
        lines.append(f"    {{user: {json.dumps(user['user'])}, password: {user['password']},")
        permissions = json.dumps(user["permissions"], indent=2).replace("\n", "\n      ")
        lines.append(f"      permissions: {permissions}}}")
    lines.append("  ]")
    lines.append("}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tether.access", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefix", default="tether")
    parser.add_argument("--application", action="append", default=[],
                        metavar="USER:AGENT[,AGENT][:METHOD[,METHOD]]",
                        help="an application user, the parent agents it owns and the hook "
                             "methods it serves (repeatable)")
    args = parser.parse_args(argv)
    applications = [Application.parse(text) for text in args.application]
    command = " ".join(["python -m tether.access", f"--prefix {args.prefix}",
                        *(f"--application {text}" for text in args.application)])
    header = (f"# Generated by `{command}`; do not edit (tests/integration/"
              "test_access_control.py checks it).\n# Each password is "
              "$TETHER_NATS_<USER>_PASSWORD in the server's environment.")
    sys.stdout.write(render(Subjects(args.prefix), applications, header=header))
    return 0


if __name__ == "__main__":
    sys.exit(main())
