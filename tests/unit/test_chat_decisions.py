"""Which chat message is the model's answer to a message (`tether.domain.chat.answers`),
read from the raw message so that an answer a client cannot read is still known; and when
a durable chat reader's handover lapsed (`handover_lapsed`)."""

import pytest

from tether.domain.chat import answers, handover_lapsed

pytestmark = pytest.mark.unit


def test_the_models_message_in_reply_to_the_id_answers_it():
    message = {"role": "robot", "metadata": {"source": "model", "in_reply_to": ["user:a", "user:b"]}}
    assert answers(message, "user:b")


@pytest.mark.parametrize("message", [
    {"metadata": {"source": "model", "in_reply_to": ["user:other"]}},
    {"metadata": {"source": "user", "in_reply_to": ["user:m"]}},
    {"metadata": {"source": "model", "in_reply_to": "user:m-and-more"}},
    {"metadata": "user:m"},
    ["user:m"],
    "user:m",
])
def test_anything_else_answers_nothing(message):
    assert not answers(message, "user:m")


def test_a_handover_lapses_only_once_unrenewed_near_its_ack_wait():
    """Renewed every third of the ack wait, a reader is late by a scheduling delay; one
    unrenewed for (nearly) the whole ack wait was paused, and its message may be another
    reader's."""
    assert not handover_lapsed(20.0, 60.0)
    assert not handover_lapsed(50.0, 60.0)
    assert handover_lapsed(55.0, 60.0)
    assert handover_lapsed(600.0, 60.0)
