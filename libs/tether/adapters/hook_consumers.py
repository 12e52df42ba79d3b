"""A hook method's registration and its durable consumer, made the same way by a handler
that may create them itself and by the parent service for one that may not (an
application in an account of its own asks `<prefix>.rpc.serve_hook`)."""

import json

from nats.js import JetStreamContext
from nats.js import api as js_api

from tether.contract.subjects import Subjects
from tether.ports import SYSTEM_CLOCK


def registry_key(parent_agent: str, method: str) -> str:
    """`hook.<parent_agent>.<method>`: NATS KV keys take no ':', identifiers may."""
    key = f"hook.{parent_agent}.{method}"
    if ":" in key:
        raise ValueError(f"hook {parent_agent}.{method}: a hook's parent agent and method "
                         "names cannot contain ':' (they become a NATS KV key)")
    return key


def consumer_name(parent_agent: str, method: str) -> str:
    return f"hooks-{parent_agent}-{method}"


def consumer_config(subjects: Subjects, parent_agent: str, method: str, *, lease_s: float,
                    max_ack_pending: int) -> js_api.ConsumerConfig:
    durable = consumer_name(parent_agent, method)
    return js_api.ConsumerConfig(
        name=durable, durable_name=durable, filter_subject=subjects.hook(parent_agent, method),
        ack_policy=js_api.AckPolicy.EXPLICIT, deliver_policy=js_api.DeliverPolicy.ALL,
        ack_wait=lease_s, max_deliver=-1, max_ack_pending=max_ack_pending)


def registration() -> bytes:
    return json.dumps({"registered_at": SYSTEM_CLOCK.now()}).encode()


async def serve_hook(js: JetStreamContext, subjects: Subjects, parent_agent: str, method: str,
                     *, lease_s: float, max_ack_pending: int) -> str:
    """Create (or update: a changed lease applies) the method's consumer, then register
    the method so the parent accepts runs that name it; returns the consumer's name."""
    key = registry_key(parent_agent, method)
    config = consumer_config(subjects, parent_agent, method, lease_s=lease_s,
                             max_ack_pending=max_ack_pending)
    await js.add_consumer(subjects.hooks_stream, config)
    registry = await js.key_value(subjects.registry_bucket)
    await registry.put(key, registration())
    assert config.durable_name is not None
    return config.durable_name
