"""The accounts of `tether.access` for nats-server's operator (JWT) mode.

The same accounts, imports, exports and user permissions as the configuration-file form,
as JWTs the way `nsc` makes them: an operator, a system account, Tether's account, the
operators' account and one per application, and a user per service role, person role
and application. Exports are private (`token_req`): each import carries an activation
token, signed by the exporting account, for the importing account only.

    python -m tether.access_jwt --application demo:Assistant:on_import_done --out DIR

writes `DIR/keys/<name>.nk` (the seeds: the operator's, every account's and user's;
made once and reused, so running it again keeps every identity), `DIR/creds/<user>.creds`
(what each service or application connects with: `TETHER_NATS_CREDS_FILE`), and
`DIR/resolver.conf`, the server's operator, system account and a memory resolver
preloaded with every account (`include` it in nats.conf). The keys directory is the
operator's secret: keep it outside the server; a creds file goes to its user only.
"""

import argparse
import base64
import hashlib
import json
import os
import sys
from pathlib import Path

import nkeys

from tether.access import (
    ADMIN_USER,
    SERVICE_ACCOUNT,
    USERS,
    Application,
    accounts,
)
from tether.contract.subjects import Subjects
from tether.ports import SYSTEM_CLOCK

SYSTEM_ACCOUNT = "SYS"
# What the server allows a response permission for, as `allow_responses: true` does.
RESPONSE_TTL_NS = 2 * 60 * 1_000_000_000
UNLIMITED = {"subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1,
             "wildcards": True, "conn": -1, "leaf": -1}
JETSTREAM = {"mem_storage": -1, "disk_storage": -1, "streams": -1, "consumer": -1}
NO_JETSTREAM = {"mem_storage": 0, "disk_storage": 0, "streams": 0, "consumer": 0}
PREFIXES = {"operator": nkeys.PREFIX_BYTE_OPERATOR, "account": nkeys.PREFIX_BYTE_ACCOUNT,
            "user": nkeys.PREFIX_BYTE_USER}


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


class Keys:
    """Seeds by name under `directory` (`<kind>-<name>.nk`), made where missing."""

    def __init__(self, directory: Path) -> None:
        self._directory = directory
        directory.mkdir(parents=True, exist_ok=True)

    def pair(self, kind: str, name: str) -> "nkeys.KeyPair":
        path = self._directory / f"{kind}-{name}.nk"
        if not path.exists():
            seed = nkeys.encode_seed(os.urandom(32), PREFIXES[kind])
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(descriptor, "wb") as out:
                out.write(seed + b"\n")
        return nkeys.from_seed(bytearray(path.read_bytes().strip()))


def public(pair: "nkeys.KeyPair") -> str:
    return pair.public_key.decode()


def encode(claims: dict, issuer: "nkeys.KeyPair") -> str:
    """A JWT of `claims` signed by `issuer`: `jti` is the hash of the claims, as nsc makes it."""
    claims = {"iat": SYSTEM_CLOCK.now() // 1000, "iss": public(issuer), **claims}
    claims.pop("jti", None)
    body = json.dumps(claims, separators=(",", ":"), sort_keys=True).encode()
    digest = hashlib.new("sha512_256", body).digest()
    claims["jti"] = base64.b32encode(digest).decode().rstrip("=")
    header = _b64(json.dumps({"typ": "JWT", "alg": "ed25519-nkey"}).encode())
    payload = _b64(json.dumps(claims, separators=(",", ":")).encode())
    signature = issuer.sign(f"{header}.{payload}".encode())
    return f"{header}.{payload}.{_b64(signature)}"


def _user_claims(name: str, user: dict) -> dict:
    permissions = user["permissions"]
    nats: dict = {"type": "user", "version": 2, "subs": -1, "data": -1, "payload": -1,
                  "pub": {"allow": permissions["publish"]["allow"]},
                  "sub": {"allow": permissions["subscribe"]["allow"]}}
    if permissions.get("allow_responses"):
        nats["resp"] = {"max": 1, "ttl": RESPONSE_TTL_NS}
    return {"name": name, "nats": nats}


def covers(pattern: str, subject: str) -> bool:
    """Whether every subject `subject` matches also matches `pattern` (NATS wildcards)."""
    wanted, given = pattern.split("."), subject.split(".")
    for index, token in enumerate(wanted):
        if token == ">":
            return len(given) > index
        if index >= len(given) or given[index] == ">" or (token != "*" and token != given[index]):
            return False
    return len(given) == len(wanted)


def _widest(exports: list[dict]) -> list[tuple[str, str, bool]]:
    """Each export once, at its widest: an account's exports may not overlap in JWT mode,
    and an activation token grants an importer the narrower subject it imports."""
    entries = [("service" if "service" in e else "stream", e.get("service") or e["stream"],
                bool(e.get("response_type"))) for e in exports]
    return list(dict.fromkeys(
        entry for entry in entries
        if not any(other != entry and other[0] == entry[0] and covers(other[1], entry[1])
                   and not covers(entry[1], other[1]) for other in entries)))


def creds(jwt: str, seed: bytes) -> str:
    return ("-----BEGIN NATS USER JWT-----\n" + jwt + "\n------END NATS USER JWT------\n\n"
            "************************* IMPORTANT *************************\n"
            "NKEY Seed printed below can be used to sign and prove identity.\n"
            "NKEYs are sensitive and should be treated as secrets.\n\n"
            "-----BEGIN USER NKEY SEED-----\n" + seed.decode() + "\n"
            "------END USER NKEY SEED------\n\n"
            "*************************************************************\n")


def generate(subjects: Subjects, applications: list[Application], out: Path) -> dict[str, Path]:
    """Write the keys, every user's creds file and the server's resolver configuration
    under `out`; returns each user's creds file."""
    keys = Keys(out / "keys")
    operator = keys.pair("operator", "tether")
    layout = accounts(subjects, applications, passwords={
        user: "" for user in (*USERS, *(app.user for app in applications))})
    account_keys = {name: keys.pair("account", name) for name in (*layout, SYSTEM_ACCOUNT)}
    system = public(account_keys[SYSTEM_ACCOUNT])
    jwts = {system: encode({"sub": system, "name": SYSTEM_ACCOUNT, "nats": {
        "type": "account", "version": 2, "limits": {**UNLIMITED, **NO_JETSTREAM},
        "exports": [{"name": "account-monitoring-services", "subject": "$SYS.REQ.ACCOUNT.*.*",
                     "type": "service", "response_type": "Stream",
                     "account_token_position": 4}]}}, operator)}
    creds_files: dict[str, Path] = {}
    (out / "creds").mkdir(parents=True, exist_ok=True)
    for name, account in layout.items():
        pair = account_keys[name]
        exports = [{"name": subject, "subject": subject, "type": kind, "token_req": True,
                    **({"response_type": "Stream"} if streamed else {})}
                   for kind, subject, streamed in _widest(account["exports"])]
        imports = []
        for entry in account["imports"]:
            kind = "service" if "service" in entry else "stream"
            source = entry[kind]
            exporter = account_keys[source["account"]]
            activation = encode({"sub": public(pair), "name": source["subject"], "nats": {
                "type": "activation", "version": 2, "subject": source["subject"],
                "kind": kind}}, exporter)
            imports.append({"name": source["subject"], "subject": source["subject"],
                            "account": public(exporter), "type": kind, "token": activation})
        limits = {**UNLIMITED, **(JETSTREAM if account.get("jetstream") else NO_JETSTREAM)}
        jwts[public(pair)] = encode({"sub": public(pair), "name": name, "nats": {
            "type": "account", "version": 2, "limits": limits, "exports": exports,
            "imports": imports}}, operator)
        for user in account["users"]:
            user_pair = keys.pair("user", user["user"])
            claims = _user_claims(user["user"], user)
            claims["sub"] = public(user_pair)
            path = out / "creds" / f"{user['user']}.creds"
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(descriptor, "w") as file:
                file.write(creds(encode(claims, pair), user_pair.seed))
            creds_files[user["user"]] = path
    operator_jwt = encode({"sub": public(operator), "name": "tether", "nats": {
        "type": "operator", "version": 2, "system_account": system}}, operator)
    preload = "\n".join(f"  {key}: {json.dumps(jwt)}" for key, jwt in jwts.items())
    (out / "resolver.conf").write_text(
        "# Generated by `python -m tether.access_jwt`: the operator, its system account and\n"
        f"# every account ({', '.join(layout)}), preloaded into a memory resolver.\n"
        f"operator: {json.dumps(operator_jwt)}\nsystem_account: {system}\n"
        f"resolver: MEMORY\nresolver_preload: {{\n{preload}\n}}\n"
        "# A service's user JWT, sent in its CONNECT line, is larger than the default 4 KiB.\n"
        "max_control_line: 64KB\n")
    assert ADMIN_USER in creds_files and SERVICE_ACCOUNT in layout
    return creds_files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tether.access_jwt", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefix", default="tether")
    parser.add_argument("--application", action="append", default=[],
                        metavar="USER:AGENT[,AGENT][:METHOD[,METHOD]]")
    parser.add_argument("--out", required=True, metavar="DIR")
    args = parser.parse_args(argv)
    written = generate(Subjects(args.prefix), [Application.parse(t) for t in args.application],
                       Path(args.out))
    print(f"wrote {Path(args.out) / 'resolver.conf'} and {len(written)} creds files "
          f"under {Path(args.out) / 'creds'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
