"""The gateway's callers file: who may call, as which parent; what is wrong is named."""

import hashlib
import ssl

import pytest

from tether.domain.events import ParentRef
from tether.gateway.callers import (
    CallersFileError,
    load_callers,
    main,
    parse_callers,
    token_hash,
)

SHA = hashlib.sha256(b"secret").hexdigest()


def test_a_caller_is_found_by_its_token_and_runs_under_its_own_parent():
    callers = parse_callers({"caller": [
        {"name": "desktop", "token_sha256": SHA},
        {"name": "billing", "token_sha256": token_hash("other"), "parent_agent": "Assistant",
         "agents": ["Researcher"]}]}, "test")
    desktop = callers.by_token("secret")
    assert desktop is not None and desktop.parent == ParentRef(agent="Gateway", name="desktop")
    assert desktop.may_call("Anything")
    billing = callers.by_token("other")
    assert billing.parent == ParentRef(agent="Assistant", name="billing")
    assert billing.may_call("Researcher") and not billing.may_call("Waiter")
    assert callers.by_token("nobody's") is None
    assert callers.by_name("billing") is billing


@pytest.mark.parametrize(("entry", "named"), [
    ({"token_sha256": SHA}, "invalid caller name None"),
    ({"name": "a b", "token_sha256": SHA}, "invalid caller name 'a b'"),
    ({"name": "x", "token_sha256": "abc"}, "token_sha256 must be the SHA-256"),
    ({"name": "x", "token_sha256": SHA, "agents": "Researcher"}, "agents must be a list"),
    ({"name": "x", "token_sha256": SHA, "tokn": 1}, "unknown field 'tokn'"),
    ({"name": "x", "token_sha256": SHA, "parent_agent": ""}, "invalid parent_agent"),
    ({"name": "x", "token_sha256": SHA, "nats_creds_file": "/no/such.creds"},
     "nats_creds_file '/no/such.creds' is not a readable file"),
    ({"name": "x"}, "set token_sha256 (its bearer token's SHA-256) or client_cert_sha256"),
    ({"name": "x", "client_cert_sha256": "AB:CD"}, "client_cert_sha256 must be the SHA-256"),
])
def test_a_wrong_caller_is_refused_naming_the_field(entry, named):
    with pytest.raises(CallersFileError) as refused:
        parse_callers({"caller": [entry]}, "the file")
    assert named in str(refused.value)
    assert str(refused.value).startswith("the file: caller 1")


def test_two_callers_may_not_share_a_name_or_a_token():
    with pytest.raises(CallersFileError, match="two callers are named 'x'"):
        parse_callers({"caller": [{"name": "x", "token_sha256": SHA},
                                  {"name": "x", "token_sha256": token_hash("2")}]}, "f")
    with pytest.raises(CallersFileError, match="the same token_sha256"):
        parse_callers({"caller": [{"name": "x", "token_sha256": SHA},
                                  {"name": "y", "token_sha256": SHA.upper()}]}, "f")
    with pytest.raises(CallersFileError, match="the same client_cert_sha256"):
        parse_callers({"caller": [{"name": "x", "client_cert_sha256": SHA},
                                  {"name": "y", "client_cert_sha256": SHA}]}, "f")


def test_a_caller_is_found_by_its_certificate_fingerprint_with_or_without_colons(tmp_path):
    pem = ssl.DER_cert_to_PEM_cert(b"not really a certificate, but DER bytes all the same")
    fingerprint = hashlib.sha256(ssl.PEM_cert_to_DER_cert(pem)).hexdigest()
    colons = ":".join(fingerprint[i:i + 2] for i in range(0, 64, 2)).upper()
    callers = parse_callers({"caller": [{"name": "robot", "client_cert_sha256": colons}]}, "f")
    robot = callers.by_certificate(pem)
    assert robot is not None and robot.token_sha256 is None and callers.with_certificates
    assert callers.by_certificate(ssl.DER_cert_to_PEM_cert(b"another")) is None
    (tmp_path / "robot.pem").write_text(pem)
    assert main(["--cert", str(tmp_path / "robot.pem")]) == fingerprint
    assert main(["secret"]) == SHA
    with pytest.raises(SystemExit, match="usage"):
        main([])


def test_a_file_that_is_not_toml_or_missing_is_named(tmp_path):
    broken = tmp_path / "callers.toml"
    broken.write_text("[[caller]\n")
    with pytest.raises(CallersFileError, match="not TOML"):
        load_callers(str(broken))
    with pytest.raises(CallersFileError, match=r"TETHER_GATEWAY_CALLERS_FILE.*cannot be read"):
        load_callers(str(tmp_path / "absent.toml"))
    broken.write_bytes(b"\xff\xfe[[caller]]")
    with pytest.raises(CallersFileError, match="not UTF-8 text"):
        load_callers(str(broken))
    broken.write_text('callers = 1\n')
    with pytest.raises(CallersFileError, match="unknown key 'callers'"):
        load_callers(str(broken))
