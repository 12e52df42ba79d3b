"""Settings shared by the services and the CLI: a TOML file, the environment, flags.

Each setting comes from, in increasing precedence: the optional TOML file named by
`--config` or `TETHER_CONFIG_FILE` (top-level keys are the setting names, e.g.
`stream_replicas = 3`), the variable `TETHER_<NAME>`, and a command-line flag. A wrong
value stops the program with a message that names the setting, where it came from and
what it accepts; nothing falls back silently.
"""

import os
import re
import ssl
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal
from urllib.parse import quote, urlsplit, urlunsplit

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator

from tether.contract.subjects import Subjects
from tether.domain.versions import ResumePolicy

HOUR_MS = 60 * 60 * 1000
CONFIG_FILE_VARIABLE = "TETHER_CONFIG_FILE"


class ConfigurationError(ValueError):
    pass


class Settings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    nats_url: str = "nats://127.0.0.1:4222"
    # Credentials of an auth-enabled NATS (deploy/nats): kept out of the URL so the URL can
    # sit in a ConfigMap and the password in a Secret. `nats_connect_url` combines them.
    nats_user: str | None = None
    nats_password: SecretStr | None = None
    # Instead of a password: an NKey seed file (`SU...`), or a JWT credentials file
    # (`.creds`, operator mode); see docs/operations.md.
    nats_nkey_seed_file: str | None = None
    nats_creds_file: str | None = None
    # TLS to NATS (`tls://` URLs): the CA that signed the server's certificate, and this
    # client's own certificate and key where the server verifies clients.
    nats_tls_ca_file: str | None = None
    nats_tls_cert_file: str | None = None
    nats_tls_key_file: str | None = None
    database_url: str = "postgresql://postgres@127.0.0.1:5432/tether"
    prefix: str = "tether"
    projection_schema: str = Field(default="tether", pattern=r"^[a-z_][a-z0-9_]{0,40}$")
    stream_replicas: int = Field(default=1, ge=1, le=5)
    duplicate_window_ms: int = Field(default=2 * 60 * 1000, ge=1000)
    projector_batch_size: int = Field(default=1000, ge=1, le=50_000)
    # A batch smaller than that waits this long for more before it is written: fewer,
    # larger transactions under load, at most this much more projection lag.
    projector_linger_ms: int = Field(default=20, ge=0, le=1_000)
    input_preview_chars: int = Field(default=500, ge=0)
    detached_max_budget_ms: int = Field(default=24 * HOUR_MS, gt=0)
    detached_no_progress_budget_ms: int = Field(default=HOUR_MS, ge=0)
    # Child agents by import path (`module:Class`), comma-separated in TETHER_AGENTS.
    agents: tuple[str, ...] = ()
    # Per parent instance; None: unlimited. A ChildAgent's own class attribute sets the
    # cap when that child acts as a parent.
    max_concurrent_agent_tools: int | None = Field(default=None, ge=1)
    max_input_bytes: int = Field(default=256 * 1024, ge=1)
    progress_coalesce_ms: int = Field(default=200, ge=0)
    # Of the signals sent, a snapshot goes to the log at most once per this window (the
    # first, `fraction >= 1` and `persist=True` ones at once; the latest other one when
    # its window ends, or before the run's outcome). 0: every signal sent. Capped at a
    # quarter of a detached run's no-progress budget.
    progress_persist_ms: int = Field(default=1_000, ge=0)
    hook_lease_ms: int = Field(default=60_000, ge=100)
    # The parent's `has_run` and `history` queries, per requester outside Tether's NATS
    # account (an application's or the operators' account), per parent replica: this
    # many a second, and this many at once.
    tenant_query_rate_per_s: float = Field(default=50.0, gt=0)
    tenant_query_burst: int = Field(default=200, ge=1)
    runner_concurrency: int = Field(default=16, ge=1)
    # A child-runner logs `event_loop.blocked` (the run whose child blocked it, and where)
    # when its event loop has not run for this long: a child calling blocking code
    # (time.sleep, a sync HTTP client) stops every run and service in the process.
    loop_blocked_warn_ms: int = Field(default=1_000, ge=50)
    # A run begun under another version of its agent's code (`run.running`'s
    # `agent_version`): `resume` it with a `run.version_changed` warning, or `refuse`:
    # the run fails, naming both versions, instead of running new code over old steps.
    resume_other_versions: ResumePolicy = "resume"
    work_ack_wait_ms: int = Field(default=30_000, ge=500)
    max_attempts: int = Field(default=5, ge=1)
    # On SIGTERM a child-runner lets running children finish this long, then stops them
    # and hands their work back; keep it below the orchestrator's grace period.
    runner_shutdown_grace_ms: int = Field(default=20_000, ge=0)
    # An object (`module:attribute`) with format_detached_completion(run, result) and/or
    # format_detached_milestone(run, milestone) overriding the chat texts.
    formatters: str | None = None
    # Recovery of awaited runs whose awaiting application is gone, and re-attach (the
    # agentToolReattach* options of agents-as-tools APIs); docs/recovery.md.
    reattach_no_progress_timeout_ms: int = Field(default=120_000, gt=0)
    reattach_max_window_ms: int | None = Field(default=None, gt=0)  # None: infinite
    recovery_inspect_timeout_ms: int = Field(default=2_000, gt=0)
    recovery_deadline_ms: int = Field(default=5_000, gt=0)
    # At most this many children are inspected at once, so a recovery of many runs whose
    # runners do not answer meets its total deadline.
    recovery_inspect_concurrency: int = Field(default=2, ge=1)
    # How often the reconciler asks whether each open awaited run is still awaited; a run
    # whose awaiter is missing at two checks in a row is recovered.
    awaiter_check_interval_ms: int = Field(default=5_000, gt=0)
    delivery_lease_ms: int = Field(default=60_000, gt=0)
    delivery_max_backoff_ms: int = Field(default=15 * 60_000, gt=0)
    # Cancel requests wait this long for a runner to confirm the child stopped.
    cancel_grace_ms: int = Field(default=2_000, gt=0)
    # The active projector and reconciler confirm their lease this often (and within this
    # long); a new holder waits two of these and a half second before it acts.
    leadership_check_ms: int = Field(default=1_000, ge=50, le=60_000)
    # Every service compares its wall clock with the broker's (deadlines are measured on
    # the broker's) and logs `clock.skewed` when they differ by more than this.
    clock_skew_warn_ms: int = Field(default=2_000, ge=1)
    # Durable chat readers (`messages(durable=...)`): at most this many per parent
    # instance, each dropped by the server once unused for the inactivity threshold.
    chat_readers_per_parent: int = Field(default=16, ge=1)
    chat_reader_inactive_ms: int = Field(default=86_400_000, ge=1_000)
    # A service starting retries an unreachable NATS or Postgres this long, then exits 1
    # naming it (an orchestrator restarts it). Applications: `connect(connect_timeout=)`.
    startup_timeout_ms: int = Field(default=30_000, ge=100)
    health_host: str = "0.0.0.0"
    # None: the service's own default (parent 8081, child-runner 8082, reconciler 8083,
    # projector 8084); 0 picks a free port.
    health_port: int | None = Field(default=None, ge=0, le=65535)
    # The web timeline (`tether ui`, or the `ui` service): where it listens.
    ui_host: str = "127.0.0.1"
    ui_port: int = Field(default=8090, ge=0, le=65535)
    # The MCP and A2A gateway (`tether gateway`, or the `gateway` service): where it
    # listens, and the callers it lets in (`tether.gateway.callers`; none: it refuses to
    # start, so that nobody is let in by default).
    gateway_host: str = "127.0.0.1"
    gateway_port: int = Field(default=8092, ge=0, le=65535)
    gateway_callers_file: str | None = None
    # Where callers reach the gateway, when not at its own address (behind a proxy or an
    # ingress): the A2A agent cards name it.
    gateway_public_url: str | None = None
    # Whether A2A push notifications may go to private, loopback and link-local addresses
    # (off: a caller cannot make the gateway call into its own network).
    gateway_push_private_urls: bool = False
    # How long a gateway holds the A2A push configs it sends for without renewing them
    # (it renews them every second): past that, another replica takes them over.
    gateway_push_lease_ms: int = Field(default=15_000, ge=3_000, le=600_000)
    # HTTPS: the gateway's certificate and key (PEM); with a client CA it also asks callers
    # for certificates that CA signed, and a caller may be let in by its certificate.
    gateway_tls_cert_file: str | None = None
    gateway_tls_key_file: str | None = None
    gateway_tls_client_ca_file: str | None = None
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["auto", "json", "console"] = "auto"
    # The services' event loop: uvloop (faster I/O) where it is installed, else asyncio's.
    event_loop: Literal["auto", "uvloop", "asyncio"] = "auto"
    # The services' and the CLI's NATS client with nats-py's message path sped up
    # (tether.adapters.nats_fastpath); off: nats-py's own client, as applications get.
    nats_fast_path: bool = True
    # The services' young-generation GC threshold (objects allocated between collections,
    # Python's default 700); 0 leaves the interpreter's settings alone.
    gc_threshold: int = Field(default=10_000, ge=0)

    @field_validator("nats_url")
    @classmethod
    def _nats_scheme(cls, value: str) -> str:
        servers = [server.strip() for server in value.split(",")]
        if not all(servers):
            raise ValueError("expected a URL like nats://HOST:PORT, or several separated "
                             "by commas without empty entries")
        for server in servers:
            if not server.startswith(("nats://", "tls://", "ws://", "wss://")):
                raise ValueError(f"expected URLs like nats://HOST:PORT, not {server!r}")
        return ",".join(servers)

    @field_validator("database_url")
    @classmethod
    def _postgres_scheme(cls, value: str) -> str:
        if not value.startswith(("postgresql://", "postgres://")):
            raise ValueError("expected a URL like postgresql://USER@HOST:PORT/DATABASE")
        return value

    @field_validator("nats_user")
    @classmethod
    def _no_credentials_twice(cls, value: str | None, info: Any) -> str | None:
        if value is not None and urlsplit(info.data.get("nats_url", "")).username:
            raise ValueError("the NATS URL already carries a user; set one or the other")
        return value

    @field_validator("projection_schema", mode="before")
    @classmethod
    def _schema_name(cls, value: Any) -> Any:
        if isinstance(value, str) and not re.fullmatch(r"[a-z_][a-z0-9_]{0,40}", value):
            raise ValueError("expected a lowercase SQL identifier: a letter or '_', then up "
                             "to 40 lowercase letters, digits or '_'")
        return value

    @field_validator("agents", mode="before")
    @classmethod
    def _split_agents(cls, value: Any) -> Any:
        if isinstance(value, str):
            return tuple(part.strip() for part in value.split(",") if part.strip())
        return value

    @field_validator("prefix")
    @classmethod
    def _valid_prefix(cls, value: str) -> str:
        Subjects(value)
        return value

    @property
    def subjects(self) -> Subjects:
        return Subjects(self.prefix)

    @property
    def nats_connect_url(self) -> str:
        """`nats_url` with `nats_user`/`nats_password` in each server's URL, for the
        connection only (never log it)."""
        if self.nats_user is None:
            return self.nats_url
        password = self.nats_password.get_secret_value() if self.nats_password else ""
        userinfo = quote(self.nats_user, safe="")
        if password:
            userinfo += ":" + quote(password, safe="")
        return ",".join(urlunsplit(parts._replace(netloc=f"{userinfo}@{parts.netloc}"))
                        for parts in map(urlsplit, self.nats_url.split(",")))

    def nats_credentials(self) -> str:
        """The settings that give the connection its NATS user, as an error names them."""
        if self.nats_creds_file:
            return "TETHER_NATS_CREDS_FILE"
        if self.nats_nkey_seed_file:
            return "TETHER_NATS_NKEY_SEED_FILE"
        if self.nats_user is not None:
            return "TETHER_NATS_USER and TETHER_NATS_PASSWORD"
        return ("none set: the server requires a user; set TETHER_NATS_USER and "
                "TETHER_NATS_PASSWORD, TETHER_NATS_NKEY_SEED_FILE or TETHER_NATS_CREDS_FILE")

    def nats_options(self) -> dict[str, Any]:
        """nats-py connect options for the credentials and TLS settings."""
        options: dict[str, Any] = {}
        if self.nats_nkey_seed_file:
            options["nkeys_seed"] = self.nats_nkey_seed_file
        if self.nats_creds_file:
            options["user_credentials"] = self.nats_creds_file
        if self.nats_tls_ca_file or self.nats_tls_cert_file:
            context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH,
                                                 cafile=self.nats_tls_ca_file)
            if self.nats_tls_cert_file:
                context.load_cert_chain(self.nats_tls_cert_file, self.nats_tls_key_file)
            options["tls"] = context
        return options

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, *,
                 config_file: str | os.PathLike | None = None, **overrides: Any) -> "Settings":
        """The file (`config_file`, else `$TETHER_CONFIG_FILE`), then the environment, then
        `overrides` (None values are skipped, so unset flags can be passed as they are)."""
        environ = os.environ if environ is None else environ
        sources: dict[str, str] = {}
        values: dict[str, Any] = {}
        path = config_file if config_file is not None else environ.get(CONFIG_FILE_VARIABLE)
        if path:
            for name, value in load_config_file(Path(path)).items():
                values[name], sources[name] = value, f"{name} = {{value}} in {path}"
        for name in cls.model_fields:
            variable = f"TETHER_{name.upper()}"
            if variable in environ:
                values[name], sources[name] = environ[variable], variable + "={value}"
        for name, value in overrides.items():
            if value is not None:
                values[name], sources[name] = value, f"--{name.replace('_', '-')} {{value}}"
        try:
            return cls(**values)
        except ValidationError as error:
            raise ConfigurationError(_explain(error, sources)) from None


def load_config_file(path: Path) -> dict[str, Any]:
    """The settings of a TOML file: top-level keys named like the settings."""
    try:
        with path.open("rb") as file:
            data = tomllib.load(file)
    except OSError as error:
        raise ConfigurationError(f"{CONFIG_FILE_VARIABLE} / --config {path}: cannot read it: "
                                 f"{error.strerror or error}") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigurationError(f"{path}: not valid TOML: {error}") from None
    unknown = sorted(set(data) - set(Settings.model_fields))
    if unknown:
        known = ", ".join(sorted(Settings.model_fields))
        raise ConfigurationError(f"{path}: unknown setting(s) {', '.join(unknown)}; "
                                 f"the settings are: {known}")
    return data


def _explain(error: ValidationError, sources: Mapping[str, str] | None = None) -> str:
    lines = []
    for problem in error.errors():
        name = str(problem["loc"][0]) if problem["loc"] else "?"
        where = (sources or {}).get(name, f"TETHER_{name.upper()}={{value}}")
        value = "'***'" if name == "nats_password" else repr(problem.get("input"))
        message = problem["msg"].removeprefix("Value error, ")
        if problem["type"] == "literal_error":
            message = f"expected one of {problem['ctx']['expected']}"
        elif problem["type"] == "extra_forbidden":
            message = "no such setting"
        lines.append(f"{where.format(value=value)}: {message}")
    return "invalid configuration:\n  " + "\n  ".join(lines)
