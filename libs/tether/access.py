"""Who may do what on the NATS server of a Tether installation: its accounts and users.

Tenants are separated by the broker, not by subject rules alone. Tether's services, their
streams and an admin live in one account (`TETHER`, with JetStream); each application
has an account of its own (`APP_<USER>`), and the people who run the CLI and the UI
another (`OPERATORS`). An account outside Tether's sees only what it imports, and Tether's
account exports each of them exactly its share:

- services (requests into Tether's account; the reply is mapped back to the requester,
  so it cannot be sent anywhere else): the commands and queries of the parent agents it
  owns (`<prefix>.cmd.<kind>.<agent>.*`, `<prefix>.rpc.<kind>.<agent>.*`; the parent
  refuses a payload that names another parent than its subject), its hook methods'
  registration (`<prefix>.rpc.serve_hook.<agent>.<method>`), pulling from and
  acknowledging those methods' consumers, which the parent makes, and its hook handler's
  own records of its deliveries (its agents' keys of the deliveries bucket, which refuses
  rollups: `adapters/tenant_deliveries.py`);
- streams (messages Tether's account publishes): its parents' events, progress and
  chat as the streams republish them (`<prefix>.live.<kind>.<agent>.>`);
- and Tether's account imports from it the answer to whether it still awaits a run
  (`<prefix>.ctl.awaiter.<agent>.>`).

No other JetStream API is exported: a consumer's configuration, a direct get's reply
subject and a put's headers are in places permissions cannot see. The stored part of a timeline
comes from the parent's `history` query instead (`tether.client.run_events`), which the client
uses by itself when its account has no JetStream. Inside each account a user's own
permissions repeat its imports, so a request for anything else is refused at once.

The configuration is generated from the contract (`Subjects`), so a changed prefix or a
new stream cannot drift from it, and rendered as a nats-server `accounts` block
(`deploy/nats/auth.conf`):

    python -m tether.access --application demo:Assistant:on_import_done > deploy/nats/auth.conf

Passwords are not in the file: each user's is `$TETHER_NATS_<USER>_PASSWORD`, which the
server resolves from its environment (a Kubernetes Secret, compose's environment).
`tether.access_jwt` renders the same accounts for operator (JWT) mode.
"""

import argparse
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import nkeys

from tether.contract.subjects import Subjects
from tether.domain.ids import check_identifier

SERVICE_ROLES = ("parent", "child-runner", "reconciler", "projector")
COMMAND_KINDS = ("run", "cancel", "clear", "continue", "delivered", "message", "send")
QUERY_KINDS = ("inspect", "list", "has_run", "history", "chat_next")
LIVE_KINDS = ("evt", "progress", "chat")
SERVICE_ACCOUNT = "TETHER"
OPERATOR_ACCOUNT = "OPERATORS"
OPERATOR_USER = "operator"
ADMIN_USER = "admin"
USERS = (*SERVICE_ROLES, OPERATOR_USER, ADMIN_USER)


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
                   subjects.command_dead_letters, f"{p}.ctl.cancel.>", f"{p}.ctl.message.>",
                   # The notice that a run request found its run already there.
                   subjects.all_live_events,
                   f"$KV.{subjects.slots_bucket}.>",
                   *_kv_read(subjects.slots_bucket), *_kv_read(subjects.registry_bucket),
                   *_kv_read(subjects.deliveries_bucket),
                   *_pull(subjects.commands_stream, "parent-commands"),
                   # The former deliveries consumer, removed at start-up.
                   f"$JS.API.CONSUMER.DELETE.{subjects.events_stream}.parent-deliverer",
                   # `clear` purges a run's events, progress and chat.
                   f"$JS.API.STREAM.PURGE.{subjects.events_stream}",
                   f"$JS.API.STREAM.PURGE.{subjects.progress_stream}",
                   f"$JS.API.STREAM.PURGE.{subjects.chat_stream}",
                   # /metrics: the hook consumers' backlog.
                   f"$JS.API.CONSUMER.LIST.{subjects.hooks_stream}",
                   # `has_run` with `command_seq`: whose command a duplicate repeated.
                   f"$JS.API.DIRECT.GET.{subjects.commands_stream}",
                   # `history`: the feeds an application reads through the parent.
                   f"$JS.API.DIRECT.GET.{subjects.progress_stream}",
                   f"$JS.API.DIRECT.GET.{subjects.chat_stream}",
                   # `serve_hook`: a method's registration and its consumer.
                   f"$KV.{subjects.registry_bucket}.hook.>",
                   f"$JS.API.CONSUMER.CREATE.{subjects.hooks_stream}.>",
                   f"$JS.API.CONSUMER.DURABLE.CREATE.{subjects.hooks_stream}.>",
                   # `chat_next`: durable chat readers' consumers, pulled for them.
                   f"$JS.API.CONSUMER.CREATE.{subjects.chat_stream}.>",
                   f"$JS.API.CONSUMER.DURABLE.CREATE.{subjects.chat_stream}.>",
                   f"$JS.API.CONSUMER.MSG.NEXT.{subjects.chat_stream}.>",
                   f"$JS.ACK.{subjects.chat_stream}.>",
                   # ... counted per parent instance, and dropped when asked.
                   f"$JS.API.CONSUMER.LIST.{subjects.chat_stream}",
                   f"$JS.API.CONSUMER.DELETE.{subjects.chat_stream}.>"]
        return Permissions(tuple(common + publish), (f"{p}.rpc.>", "_INBOX.>"), True)
    if role == "child-runner":
        work = subjects.work_stream
        publish = [f"{p}.evt.>", f"{p}.progress.>",
                   # The hooks and chat notifications of the outcomes and milestones it
                   # records; a model parent also answers in its conversation.
                   f"{p}.hook.>", f"{p}.chat.>", *_kv_read(subjects.registry_bucket),
                   # A child that delegates (nested agent tools) is a parent of its own runs.
                   f"{p}.cmd.>",
                   # Runners of one agent type compare the versions of its code.
                   f"{p}.ctl.versions.>",
                   f"$JS.API.CONSUMER.DURABLE.CREATE.{work}.>", f"$JS.API.CONSUMER.CREATE.{work}.>",
                   f"$JS.API.CONSUMER.INFO.{work}.>", f"$JS.API.CONSUMER.MSG.NEXT.{work}.>",
                   f"$JS.ACK.{work}.>"]
        # Its delegated runs are awaited on their live subjects, and it answers for them
        # as their awaiter.
        return Permissions(tuple(common + publish),
                           (f"{p}.ctl.cancel.>", f"{p}.ctl.inspect.>", f"{p}.ctl.versions.>",
                            f"{p}.ctl.message.>", subjects.all_live_events,
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


def _hook_consumers(subjects: Subjects, agent: str, methods: tuple[str, ...]) -> list[str]:
    """Pulling from a hook method's consumer and acknowledging its messages; the parent
    makes the consumer (`<prefix>.rpc.serve_hook`)."""
    hooks = subjects.hooks_stream
    rules: list[str] = []
    for method in methods:
        consumer = f"hooks-{agent}-{method}"
        rules += [f"$JS.API.CONSUMER.MSG.NEXT.{hooks}.{consumer}", f"$JS.ACK.{hooks}.{consumer}.>"]
    return rules


def _delivery_records(subjects: Subjects, agent: str) -> list[str]:
    """A hook handler's own records of its deliveries, the keys of its parent agent in
    the deliveries bucket: put, and read by a direct get that names the key
    (`adapters/tenant_deliveries.py`)."""
    bucket = subjects.deliveries_bucket
    return [f"$KV.{bucket}.{agent}.>", f"$JS.API.DIRECT.GET.KV_{bucket}.$KV.{bucket}.{agent}.>"]


@dataclass(frozen=True)
class Grant:
    """What an account outside Tether's may use of it: services (requests, answered or
    stored in the service account, the reply mapped back to the requester) and streams
    (messages the service account publishes, delivered into the importing account)."""

    services: tuple[str, ...]
    streams: tuple[str, ...]
    # Services of the importing account's own that Tether's account asks (the awaiter).
    answers: tuple[str, ...]


def application_grant(subjects: Subjects, app: Application) -> Grant:
    p = subjects.prefix
    services: list[str] = []
    streams: list[str] = []
    answers: list[str] = []
    for agent in app.parent_agents:
        services += [f"{p}.cmd.{kind}.{agent}.*" for kind in COMMAND_KINDS]
        services += [f"{p}.rpc.{kind}.{agent}.*" for kind in QUERY_KINDS]
        services += [f"{p}.rpc.serve_hook.{agent}.{method}" for method in app.hook_methods]
        services += _hook_consumers(subjects, agent, app.hook_methods)
        if app.hook_methods:
            services += _delivery_records(subjects, agent)
        streams += [f"{p}.live.{kind}.{agent}.>" for kind in LIVE_KINDS]
        streams.append(f"{p}.obs.{agent}.>")  # the reconciler's events of its runs
        answers.append(f"{p}.ctl.awaiter.{agent}.>")
    return Grant(tuple(services), tuple(streams), tuple(answers))


def operator_grant(subjects: Subjects) -> Grant:
    """The people who run the CLI and the UI: every parent's commands, queries, timelines
    and hooks, as an application of every parent agent; nothing that writes a stream
    directly, reads another connection's inbox or changes a stream."""
    p = subjects.prefix
    hooks = subjects.hooks_stream
    services = [f"{p}.cmd.{kind}.*.*" for kind in COMMAND_KINDS]
    services += [f"{p}.rpc.{kind}.*.*" for kind in (*QUERY_KINDS, "serve_hook")]
    services += [f"$JS.API.CONSUMER.MSG.NEXT.{hooks}.*", f"$JS.ACK.{hooks}.>",
                 *_delivery_records(subjects, "*")]
    streams = [*(f"{p}.live.{kind}.>" for kind in LIVE_KINDS), f"{p}.obs.>"]
    return Grant(tuple(services), tuple(streams), (f"{p}.ctl.awaiter.*.>",))


def grant_permissions(grant: Grant, user: str) -> Permissions:
    """The user's own rules inside its account: exactly what the account imports, so a
    request for anything else is refused (and said so) rather than left unanswered.
    Inboxes are the account's own; `_INBOX_<user>` is taken as well as `_INBOX`."""
    return Permissions(("$JS.API.INFO", *grant.services),
                       ("_INBOX.>", f"_INBOX_{user}.>", *grant.streams, *grant.answers), True)


def account_name(user: str) -> str:
    return "APP_" + user.upper().replace("-", "_")


def password_variable(user: str) -> str:
    return "TETHER_NATS_" + user.upper().replace("-", "_") + "_PASSWORD"


def nkey_variable(user: str) -> str:
    """The server's environment variable holding the user's public NKey (`--nkey-variables`)."""
    return "TETHER_NATS_" + user.upper().replace("-", "_") + "_NKEY"


def new_nkey() -> tuple[str, str]:
    """A new user NKey: its seed (the secret, `SU...`) and its public key (`U...`)."""
    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    return seed.decode(), nkeys.from_seed(bytearray(seed)).public_key.decode()


def accounts(subjects: Subjects, applications: list[Application], *,
             passwords: dict[str, str] | None = None,
             nkeys: dict[str, str] | None = None, nkey_variables: bool = False) -> dict:
    """The `accounts` block: Tether's (the services, the admin, JetStream), the
    operators', and one per application. A user in `nkeys` signs in with that public
    NKey; any other with a password, a `$VARIABLE` reference unless `passwords` has it,
    or with `nkey_variables` with the NKey `$TETHER_NATS_<USER>_NKEY` names."""
    nkeys = nkeys or {}

    def password(user: str) -> str:
        if passwords is not None:
            return json.dumps(passwords[user])
        return "$" + password_variable(user)

    def user(name: str, permissions: Permissions | dict) -> dict:
        config = permissions if isinstance(permissions, dict) else permissions.as_config()
        if name in nkeys:
            return {"user": name, "nkey": nkeys[name], "permissions": config}
        if nkey_variables:
            return {"user": name, "nkey": "$" + nkey_variable(name), "permissions": config}
        return {"user": name, "password": password(name), "permissions": config}

    tenants = [(OPERATOR_ACCOUNT, OPERATOR_USER, operator_grant(subjects))]
    tenants += [(account_name(app.user), app.user, application_grant(subjects, app))
                for app in applications]
    names = [name for name, _, _ in tenants]
    if len(set(names)) != len(names) or SERVICE_ACCOUNT in names:
        raise ValueError(f"two applications map to one account name: {names}")
    service_users = [user(role, service_permissions(subjects, role)) for role in SERVICE_ROLES]
    service_users.append(user(ADMIN_USER, {"publish": {"allow": [">"]},
                                           "subscribe": {"allow": [">"]}}))
    tether: dict = {"jetstream": "enabled", "users": service_users, "exports": [], "imports": []}
    result = {SERVICE_ACCOUNT: tether}
    for name, user_name, grant in tenants:
        tether["exports"] += [{"service": subject, "accounts": [name]}
                              for subject in grant.services]
        tether["exports"] += [{"stream": subject, "accounts": [name]}
                              for subject in grant.streams]
        tether["imports"] += [{"service": {"account": name, "subject": subject}}
                              for subject in grant.answers]
        imports = [{"service": {"account": SERVICE_ACCOUNT, "subject": subject}}
                   for subject in grant.services]
        imports += [{"stream": {"account": SERVICE_ACCOUNT, "subject": subject}}
                    for subject in grant.streams]
        result[name] = {"users": [user(user_name, grant_permissions(grant, user_name))],
                        "imports": imports,
                        "exports": [{"service": subject, "accounts": [SERVICE_ACCOUNT]}
                                    for subject in grant.answers]}
    for name, account in result.items():
        # Pull requests get their messages as several replies.
        for export in account["exports"]:
            if export.get("service", "").startswith("$JS.API.CONSUMER.MSG.NEXT."):
                export["response_type"] = "stream"
        del name
    return result


def render(subjects: Subjects, applications: list[Application], *,
           passwords: dict[str, str] | None = None, nkeys: dict[str, str] | None = None,
           nkey_variables: bool = False, header: str = "") -> str:
    """nats-server configuration text (its format reads JSON values; passwords and NKeys
    stay bare `$VARIABLE` references, which is why this is not plain json.dumps)."""
    lines = [header] if header else []
    lines.append("accounts {")
    for name, account in accounts(subjects, applications, passwords=passwords,
                                  nkeys=nkeys, nkey_variables=nkey_variables).items():
        lines.append(f"  {name}: {{")
        if "jetstream" in account:
            lines.append(f"    jetstream: {account['jetstream']}")
        lines.append("    users: [")
        for user in account["users"]:
            if "nkey" in user:  # named in a comment: an NKey user has no name of its own
                lines.append(f"      # {user['user']}")
                nkey = user["nkey"]
                lines.append(f"      {{nkey: {nkey if nkey.startswith('$') else json.dumps(nkey)},")
            else:
                lines.append(f"      {{user: {json.dumps(user['user'])}, "
                             f"password: {user['password']},")
            permissions = json.dumps(user["permissions"], indent=2).replace("\n", "\n        ")
            lines.append(f"        permissions: {permissions}}}")
        lines.append("    ]")
        for key in ("imports", "exports"):
            lines.append(f"    {key}: [")
            lines += [f"      {json.dumps(entry)}" for entry in account[key]]
            lines.append("    ]")
        lines.append("  }")
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
    parser.add_argument("--nkey", action="append", default=[], metavar="USER=PUBLIC_KEY",
                        help="the user signs in with this NKey instead of a password "
                             "(repeatable)")
    parser.add_argument("--nkey-variables", action="store_true",
                        help="every user signs in with an NKey whose public key the server "
                             "reads from $TETHER_NATS_<USER>_NKEY")
    parser.add_argument("--nkeys-dir", metavar="DIR",
                        help="every user signs in with an NKey: its seed is DIR/<user>.nk, "
                             "made when missing (mode 0600; give it to that user only)")
    parser.add_argument("--public-keys-env", metavar="FILE",
                        help="with --nkeys-dir: also write TETHER_NATS_<USER>_NKEY=<public key> "
                             "per user to FILE (the server's environment for "
                             "--nkey-variables)")
    args = parser.parse_args(argv)
    if args.public_keys_env and not args.nkeys_dir:
        parser.error("--public-keys-env needs --nkeys-dir")
    applications = [Application.parse(text) for text in args.application]
    users = (*USERS, *(app.user for app in applications))
    nkeys = dict(text.split("=", 1) for text in args.nkey)
    if args.nkeys_dir:
        made = nkey_files(Path(args.nkeys_dir), users)
        nkeys.update(made)
        if args.public_keys_env:
            Path(args.public_keys_env).write_text(
                "".join(f"{nkey_variable(user)}={key}\n" for user, key in made.items()))
    command = " ".join(["python -m tether.access", f"--prefix {args.prefix}",
                        *(f"--application {text}" for text in args.application),
                        *(f"--nkey {text}" for text in args.nkey),
                        *(["--nkey-variables"] if args.nkey_variables else []),
                        *([f"--nkeys-dir {args.nkeys_dir}"] if args.nkeys_dir else [])])
    credential = ("public NKey is $TETHER_NATS_<USER>_NKEY" if args.nkey_variables
                  else "password is $TETHER_NATS_<USER>_PASSWORD")
    header = (f"# Generated by `{command}`; do not edit (tests/integration/"
              f"test_access_control.py checks it).\n# Each {credential} in the server's "
              "environment; users: " + ", ".join(users) + ".")
    sys.stdout.write(render(Subjects(args.prefix), applications, nkeys=nkeys,
                            nkey_variables=args.nkey_variables, header=header))
    return 0


def nkey_files(directory: Path, users: "tuple[str, ...] | list[str]") -> dict[str, str]:
    """Each user's public NKey, from its seed file `<user>.nk` in `directory` (made, with
    a new seed, where it is missing)."""
    directory.mkdir(parents=True, exist_ok=True)
    public = {}
    for user in users:
        path = directory / f"{user}.nk"
        if not path.exists():
            new_seed, _ = new_nkey()
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(descriptor, "w") as out:
                out.write(new_seed + "\n")
        seed = path.read_bytes().strip()
        public[user] = nkeys.from_seed(bytearray(seed)).public_key.decode()
    return public


if __name__ == "__main__":
    sys.exit(main())
