"""The contract's streams and key-value buckets: their configuration, created or brought
to it at start-up, and removed with their prefix."""

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nats.js import JetStreamContext
from nats.js import api as js_api
from nats.js.errors import APIError, NotFoundError
from nats.js.kv import KeyValue

from tether.adapters.tenant_deliveries import open_to_tenants
from tether.contract.subjects import Subjects

if TYPE_CHECKING:
    from tether.config import Settings

STREAM_NAME_IN_USE = 10058  # JSStreamNameExistErr: exists with another configuration
DAY_S = 24 * 60 * 60


@dataclass(frozen=True, slots=True)
class StreamSettings:
    replicas: int = 1
    duplicate_window_s: float = 120.0

    @classmethod
    def of(cls, settings: "Settings") -> "StreamSettings":
        """The stream settings every service and client of one installation shares."""
        return cls(replicas=settings.stream_replicas,
                   duplicate_window_s=settings.duplicate_window_ms / 1000)


def stream_configs(subjects: Subjects, settings: StreamSettings) -> list[js_api.StreamConfig]:
    """Every stream of the contract, with each setting spelled out."""
    p = subjects.prefix

    def config(name: str, subject: str, **overrides: Any) -> js_api.StreamConfig:
        values: dict[str, Any] = {
            "name": name,
            "subjects": [subject],
            "storage": js_api.StorageType.FILE,
            "retention": js_api.RetentionPolicy.LIMITS,
            "discard": js_api.DiscardPolicy.OLD,
            "num_replicas": settings.replicas,
            "duplicate_window": settings.duplicate_window_s,
            "max_msgs": -1,
            "max_bytes": -1,
            "max_age": 0,
            "max_msgs_per_subject": -1,
            "allow_direct": True,
            "deny_delete": False,
            "deny_purge": False,
        }
        values.update(overrides)
        return js_api.StreamConfig(**values)

    return [
        # Commands are kept a week for audit; the parent consumes them with a durable consumer.
        config(subjects.commands_stream, f"{p}.cmd.>", max_age=7 * DAY_S),
        # The log itself: kept forever; purged per run only by `clear`. Each stored event
        # is also republished (core NATS, in stream order, after it is stored) on
        # `<prefix>.live.evt.<agent>.<name>.<run_id>`, so awaiting a run needs a plain
        # subscription rather than a consumer of its own (client/parent.py).
        config(subjects.events_stream, subjects.all_events,
               republish=js_api.RePublish(src=subjects.all_events,
                                          dest=subjects.all_live_events)),
        # Ephemeral progress: the latest value per run for late subscribers. Progress and
        # chat are republished too (`<prefix>.live.progress.>`, `<prefix>.live.chat.>`):
        # what an application in an account of its own follows (tether.access). A signal
        # whose `data` was not asked to persist is kept only a moment (its `Nats-TTL`):
        # that data is for live subscribers only.
        config(subjects.progress_stream, f"{p}.progress.>", max_msgs_per_subject=1,
               max_age=7 * DAY_S, allow_msg_ttl=True,
               republish=js_api.RePublish(src=f"{p}.progress.>", dest=f"{p}.live.progress.>")),
        config(subjects.work_stream, f"{p}.work.>", retention=js_api.RetentionPolicy.WORK_QUEUE),
        config(subjects.hooks_stream, f"{p}.hook.>", max_age=7 * DAY_S),
        config(subjects.chat_stream, f"{p}.chat.>", max_age=30 * DAY_S,
               republish=js_api.RePublish(src=f"{p}.chat.>", dest=f"{p}.live.chat.>")),
    ]


async def ensure_streams(js: JetStreamContext, subjects: Subjects,
                         settings: StreamSettings) -> None:
    """Create every stream and KV bucket, or bring an existing one to the configured settings."""
    for config in stream_configs(subjects, settings):
        try:
            await js.add_stream(config)
        except APIError as error:
            if error.err_code != STREAM_NAME_IN_USE:
                raise
            await js.update_stream(config)
    for bucket in (subjects.registry_bucket, subjects.slots_bucket):
        await key_value(js, bucket, settings)
    # A delivery's key outlives every republication of its hook (the hooks stream keeps
    # a message 7 days).
    await key_value(js, subjects.deliveries_bucket, settings, ttl_s=30 * DAY_S)
    # Applications write their own keys in it (adapters/tenant_deliveries.py).
    await open_to_tenants(js, subjects.deliveries_bucket)


async def remove_streams(js: JetStreamContext, subjects: Subjects) -> None:
    """Delete every stream and bucket of one prefix (tests, demos, uninstall)."""
    names = [config.name for config in stream_configs(subjects, StreamSettings()) if config.name]
    names += [f"KV_{bucket}" for bucket in (subjects.registry_bucket, subjects.slots_bucket,
                                           subjects.deliveries_bucket)]
    for name in names:
        try:
            await js.delete_stream(name)
        except NotFoundError:
            pass


async def key_value(js: JetStreamContext, bucket: str, settings: StreamSettings, *,
                    ttl_s: float | None = None) -> KeyValue:
    """The bucket, created with the one configuration every service uses."""
    config = js_api.KeyValueConfig(bucket=bucket, history=1, storage=js_api.StorageType.FILE,
                                   ttl=ttl_s,
                                   replicas=settings.replicas)
    try:
        return await js.create_key_value(config)
    except APIError as error:
        if error.err_code != STREAM_NAME_IN_USE:
            raise
        return await js.key_value(bucket)
