import json

import pytest

from tether.parent.rate_limit import FORGET_AFTER_S, RequestRates, requester_of


def test_a_requester_gets_its_burst_then_one_request_per_refill():
    rates = RequestRates(rate_per_s=10, burst=3)
    assert [rates.take("a", 0.0) for _ in range(3)] == [0, 0, 0]
    assert rates.take("a", 0.0) == pytest.approx(0.1)
    assert rates.take("a", 0.05) == pytest.approx(0.05)  # half a token back: wait the rest
    assert rates.take("a", 0.1) == 0
    assert rates.take("a", 0.1) == pytest.approx(0.1)


def test_requesters_have_buckets_of_their_own_that_refill_to_the_burst_only():
    rates = RequestRates(rate_per_s=1, burst=2)
    assert [rates.take("a", 0.0) for _ in range(2)] == [0, 0]
    assert rates.take("b", 0.0) == 0
    assert rates.take("a", 0.0) > 0
    assert [rates.take("a", 100.0) for _ in range(3)][:2] == [0, 0]
    assert rates.take("a", 100.0) > 0


def test_idle_requesters_are_forgotten_full():
    rates = RequestRates(rate_per_s=1, burst=1)
    rates.take("a", 0.0)
    rates.take("b", FORGET_AFTER_S + 1)
    assert rates.remembered() == 1
    assert rates.take("b", FORGET_AFTER_S + 1) > 0  # b's bucket is the one kept, empty


def test_bad_limits_are_refused():
    for rate, burst in ((0, 1), (1, 0)):
        with pytest.raises(ValueError):
            RequestRates(rate, burst)


def test_the_requester_is_the_account_the_server_names():
    assert requester_of(None) is None
    assert requester_of({"Nats-Msg-Id": "x"}) is None
    assert requester_of({"Nats-Request-Info": json.dumps({"acc": "APP_ALICE", "rtt": 1})}) \
        == "APP_ALICE"
    assert requester_of({"Nats-Request-Info": json.dumps({"acc": "A", "user": "u"})}) == "A/u"
    assert requester_of({"Nats-Request-Info": "not json"}) == "unreadable"
    assert requester_of({"Nats-Request-Info": "[1]"}) == "unreadable"
