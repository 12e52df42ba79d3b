"""Settings shared by the services and the CLI, from the environment (`TETHER_*`).

A wrong value stops the program with a message that names the variable and what it
accepts; nothing falls back silently.
"""

import os
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from tether.contract.subjects import Subjects

HOUR_MS = 60 * 60 * 1000


class ConfigurationError(ValueError):
    pass


class Settings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    nats_url: str = "nats://127.0.0.1:4222"
    database_url: str = "postgresql://postgres@127.0.0.1:5432/tether"
    prefix: str = "tether"
    projection_schema: str = Field(default="tether", pattern=r"^[a-z_][a-z0-9_]{0,40}$")
    stream_replicas: int = Field(default=1, ge=1, le=5)
    duplicate_window_ms: int = Field(default=2 * 60 * 1000, ge=1000)
    projector_batch_size: int = Field(default=1000, ge=1, le=50_000)
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
    hook_lease_ms: int = Field(default=60_000, ge=100)
    runner_concurrency: int = Field(default=16, ge=1)
    work_ack_wait_ms: int = Field(default=30_000, ge=500)
    max_attempts: int = Field(default=5, ge=1)
    # An object (`module:attribute`) with format_detached_completion(run, result) and/or
    # format_detached_milestone(run, milestone) overriding the chat texts.
    formatters: str | None = None
    # Re-attach after a parent restart (the seed's agentToolReattach* options).
    reattach_no_progress_timeout_ms: int = Field(default=120_000, gt=0)
    reattach_max_window_ms: int | None = Field(default=None, gt=0)  # None: infinite
    recovery_inspect_timeout_ms: int = Field(default=2_000, gt=0)
    recovery_deadline_ms: int = Field(default=5_000, gt=0)
    delivery_lease_ms: int = Field(default=60_000, gt=0)
    delivery_max_backoff_ms: int = Field(default=15 * 60_000, gt=0)
    # Cancel requests wait this long for a runner to confirm the child stopped.
    cancel_grace_ms: int = Field(default=2_000, gt=0)
    health_host: str = "0.0.0.0"
    # None: the service's own default (parent 8081, child-runner 8082, reconciler 8083,
    # projector 8084); 0 picks a free port.
    health_port: int | None = Field(default=None, ge=0, le=65535)
    log_level: str = Field(default="info", pattern=r"^(debug|info|warning|error)$")
    log_format: str = Field(default="auto", pattern=r"^(auto|json|console)$")

    @field_validator("nats_url")
    @classmethod
    def _nats_scheme(cls, value: str) -> str:
        if not value.startswith(("nats://", "tls://", "ws://", "wss://")):
            raise ValueError("expected a URL like nats://HOST:PORT")
        return value

    @field_validator("database_url")
    @classmethod
    def _postgres_scheme(cls, value: str) -> str:
        if not value.startswith(("postgresql://", "postgres://")):
            raise ValueError("expected a URL like postgresql://USER@HOST:PORT/DATABASE")
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

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> "Settings":
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for name in cls.model_fields:
            variable = f"TETHER_{name.upper()}"
            if variable in environ:
                values[name] = environ[variable]
        values.update({k: v for k, v in overrides.items() if v is not None})
        try:
            return cls(**values)
        except ValidationError as error:
            raise ConfigurationError(_explain(error)) from None


def _explain(error: ValidationError) -> str:
    lines = []
    for problem in error.errors():
        name = str(problem["loc"][0]) if problem["loc"] else "?"
        lines.append(f"TETHER_{name.upper()}={problem.get('input')!r}: {problem['msg']}")
    return "invalid configuration:\n  " + "\n  ".join(lines)
