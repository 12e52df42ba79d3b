"""Who may call the gateway, and as which parent: the callers file.

Each caller is a bearer token (its SHA-256, never the token itself), or a TLS client
certificate (its SHA-256 fingerprint; the gateway serving HTTPS with
`TETHER_GATEWAY_TLS_CLIENT_CA_FILE`), or both, and the Tether parent its calls run under: a parent agent and a parent name, so one caller's runs, tasks and
timeline are its own, and another caller naming the same run id names another run. A
caller may be limited to some agent types, and may have a NATS identity of its own (an
application's NKey seed or credentials file), so that its calls reach the broker with
that application's permissions, in that application's account, as its own code would.

    # TETHER_GATEWAY_CALLERS_FILE
    [[caller]]
    name = "desktop"                    # the parent name of its runs
    token_sha256 = "5e88...42d8"        # sha256 of its bearer token, in hex
    client_cert_sha256 = "9f3a...01bc"  # or: sha256 of its client certificate (DER)
    parent_agent = "Assistant"          # default: "Gateway"
    agents = ["Researcher"]             # default: every agent type the gateway serves
    nats_nkey_seed_file = "/secrets/demo.nk"   # default: the gateway's own identity

`python -m tether.gateway.callers TOKEN` prints the hash of a token,
`python -m tether.gateway.callers --cert CERT.pem` a certificate's fingerprint.
"""

import hashlib
import hmac
import ssl
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tether.domain.events import ParentRef
from tether.domain.ids import InvalidIdentifier, check_identifier

DEFAULT_PARENT_AGENT = "Gateway"
_FIELDS = {"name", "token_sha256", "client_cert_sha256", "parent_agent", "agents",
           "nats_nkey_seed_file", "nats_creds_file"}


class CallersFileError(ValueError):
    """The callers file cannot be used; the message names the file, the caller and the
    field."""


@dataclass(frozen=True, slots=True)
class Caller:
    name: str
    token_sha256: str | None  # None: it calls with its client certificate only
    parent: ParentRef
    agents: frozenset[str] | None  # None: every agent type served
    nats_nkey_seed_file: str | None = None
    nats_creds_file: str | None = None
    client_cert_sha256: str | None = None

    def may_call(self, agent_type: str) -> bool:
        return self.agents is None or agent_type in self.agents

    @property
    def identity(self) -> tuple[str | None, str | None]:
        """The NATS identity its calls use (both None: the gateway's own)."""
        return self.nats_nkey_seed_file, self.nats_creds_file


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def certificate_fingerprint(pem: str) -> str:
    """The SHA-256 of a certificate's DER form, in hex (what `openssl x509 -fingerprint
    -sha256` prints, without the colons)."""
    return hashlib.sha256(ssl.PEM_cert_to_DER_cert(pem)).hexdigest()


class Callers:
    """The callers, found by their bearer token."""

    def __init__(self, callers: list[Caller]) -> None:
        self._by_hash = {caller.token_sha256: caller for caller in callers
                         if caller.token_sha256 is not None}
        self._by_certificate = {caller.client_cert_sha256: caller for caller in callers
                                if caller.client_cert_sha256 is not None}
        self.all = tuple(callers)

    def __len__(self) -> int:
        return len(self.all)

    def by_token(self, token: str) -> Caller | None:
        digest = token_hash(token)
        found = self._by_hash.get(digest)
        # The lookup is by hash already; the comparison keeps to constant time anyway.
        if found is not None and hmac.compare_digest(found.token_sha256 or "", digest):
            return found
        return None

    def by_certificate(self, pem: str) -> Caller | None:
        """The caller whose client certificate this is (the TLS handshake verified it)."""
        return self._by_certificate.get(certificate_fingerprint(pem))

    @property
    def with_certificates(self) -> bool:
        return bool(self._by_certificate)

    def by_name(self, name: str) -> Caller | None:
        return next((caller for caller in self.all if caller.name == name), None)


def parse_callers(document: dict[str, Any], source: str) -> Callers:
    """The callers of a parsed callers file; `CallersFileError` names what is wrong."""
    unknown = set(document) - {"caller"}
    if unknown:
        raise CallersFileError(f"{source}: unknown key {min(unknown)!r}: the file holds "
                               "[[caller]] tables only")
    entries = document.get("caller", [])
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise CallersFileError(f"{source}: 'caller' must be an array of tables ([[caller]])")
    callers: list[Caller] = []
    for index, entry in enumerate(entries, start=1):
        callers.append(_caller(entry, f"{source}: caller {index}"))
    names = [caller.name for caller in callers]
    if len(set(names)) != len(names):
        twice = next(name for name in names if names.count(name) > 1)
        raise CallersFileError(f"{source}: two callers are named {twice!r}; each caller's "
                               "name is the parent name of its runs, so it must be unique")
    for field in ("token_sha256", "client_cert_sha256"):
        hashes = [getattr(caller, field) for caller in callers
                  if getattr(caller, field) is not None]
        if len(set(hashes)) != len(hashes):
            raise CallersFileError(f"{source}: two callers have the same {field}")
    return Callers(callers)


def _caller(entry: dict[str, Any], where: str) -> Caller:
    unknown = set(entry) - _FIELDS
    if unknown:
        raise CallersFileError(f"{where}: unknown field {min(unknown)!r} "
                               f"(known: {', '.join(sorted(_FIELDS))})")
    try:
        name = check_identifier(entry.get("name"), "caller name")
        parent_agent = check_identifier(entry.get("parent_agent", DEFAULT_PARENT_AGENT),
                                        "parent_agent")
    except InvalidIdentifier as error:
        raise CallersFileError(f"{where}: {error}") from None
    where = f"{where} ({name})"
    digest, fingerprint = entry.get("token_sha256"), entry.get("client_cert_sha256")
    if digest is None and fingerprint is None:
        raise CallersFileError(f"{where}: set token_sha256 (its bearer token's SHA-256) or "
                               "client_cert_sha256 (its client certificate's), or both")
    if digest is not None and not _is_sha256(digest):
        raise CallersFileError(f"{where}: token_sha256 must be the SHA-256 of the caller's "
                               "bearer token, 64 hex digits (python -m "
                               "tether.gateway.callers TOKEN prints it)")
    if fingerprint is not None and not _is_sha256(fingerprint.replace(":", "")):
        raise CallersFileError(f"{where}: client_cert_sha256 must be the SHA-256 of the "
                               "caller's client certificate, 64 hex digits (python -m "
                               "tether.gateway.callers --cert CERT.pem prints it)")
    agents = entry.get("agents")
    if agents is not None and (not isinstance(agents, list)
                               or not all(isinstance(a, str) for a in agents)):
        raise CallersFileError(f"{where}: agents must be a list of agent types")
    files = {}
    for field in ("nats_nkey_seed_file", "nats_creds_file"):
        value = entry.get(field)
        if value is not None and not (isinstance(value, str) and Path(value).is_file()):
            raise CallersFileError(f"{where}: {field} {value!r} is not a readable file")
        files[field] = value
    if files["nats_nkey_seed_file"] and files["nats_creds_file"]:
        raise CallersFileError(f"{where}: set nats_nkey_seed_file or nats_creds_file, "
                               "not both")
    return Caller(name=name, token_sha256=digest.lower() if digest else None,
                  client_cert_sha256=(fingerprint.replace(":", "").lower()
                                      if fingerprint else None),
                  parent=ParentRef(agent=parent_agent, name=name),
                  agents=None if agents is None else frozenset(agents), **files)


def _is_sha256(value: Any) -> bool:
    return (isinstance(value, str) and len(value) == 64
            and all(c in "0123456789abcdef" for c in value.lower()))


def load_callers(path: str) -> Callers:
    """The callers file at `path` (TETHER_GATEWAY_CALLERS_FILE)."""
    source = f"the callers file {path} (TETHER_GATEWAY_CALLERS_FILE)"
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as error:
        raise CallersFileError(f"{source}: cannot be read: {error.strerror or error}") from None
    except UnicodeDecodeError as error:
        raise CallersFileError(f"{source}: not UTF-8 text: {error.reason}") from None
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise CallersFileError(f"{source}: not TOML: {error}") from None
    return parse_callers(document, source)


def main(arguments: list[str]) -> str:
    """What `python -m tether.gateway.callers` prints: a token's hash, or with `--cert
    PATH` the fingerprint of a PEM certificate."""
    if len(arguments) == 2 and arguments[0] == "--cert":
        return certificate_fingerprint(Path(arguments[1]).read_text(encoding="ascii"))
    if len(arguments) != 1:
        raise SystemExit("usage: python -m tether.gateway.callers TOKEN | --cert CERT.pem")
    return token_hash(arguments[0])


if __name__ == "__main__":  # pragma: no cover - a one-line helper
    print(main(sys.argv[1:]))
