"""The secrets the shipped development deployments read: a CA, TLS certificates for NATS
and Postgres, and an NKey for every NATS user.

    python -m tether.dev_secrets --out DIR [--application demo:Assistant:on_import_done]

writes under DIR (what exists is kept, so running it again changes nothing):

- `ca.crt`, `ca.key`: a CA of this installation's own (valid ten years);
- `nats-tls/tls.crt`, `tls.key` and `postgres-tls/tls.crt`, `tls.key`: a certificate for
  each server, signed by the CA, for its name in compose and in the cluster, `localhost`
  and `127.0.0.1`;
- `nkeys/<user>.nk`: each user's NKey seed (the services, `operator`, `admin`, each
  application), what it signs in with (`TETHER_NATS_NKEY_SEED_FILE`);
- `nats-public-keys.env`: `TETHER_NATS_<USER>_NKEY=<public key>` per user, the NATS
  server's environment (`deploy/nats/auth.conf` names them).

`docker compose up` runs it in a one-shot container (`secrets`, as root: `--tether-uid`
and `--postgres-uid` hand the seeds and Postgres's key to the users that read them);
`make dev-secrets` writes the Kubernetes dev overlay's (`deploy/k8s/overlays/dev/secrets`).
Certificates come from the `openssl` command. For development: production takes its
certificates from its own CA (cert-manager, say) and its seeds from a secrets manager.
"""

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

from tether.access import USERS, Application, nkey_files, nkey_variable

CA_DAYS = 3650
CERT_DAYS = 825
# Where each server is reached: its compose service name and its Kubernetes Service.
SERVERS = {"nats": ("nats", "nats.tether.svc", "nats.tether.svc.cluster.local",
                    "*.nats-headless", "*.nats-headless.tether.svc"),
           "postgres": ("postgres", "postgres.tether.svc", "postgres.tether.svc.cluster.local")}
LOCAL_NAMES = ("localhost",)
LOCAL_ADDRESSES = ("127.0.0.1",)
CURVE = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")


class SecretsFailed(RuntimeError):
    """What could not be made, and why."""


def _openssl(*args: str, cwd: Path) -> None:
    if shutil.which("openssl") is None:
        raise SecretsFailed("the openssl command is not installed: it makes the certificates "
                            "(Debian/Ubuntu: apt-get install openssl)")
    result = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True,
                            timeout=60, check=False)
    if result.returncode != 0:
        raise SecretsFailed(f"openssl {args[0]} failed: {result.stderr.strip()}")


def _private(path: Path) -> None:
    path.chmod(0o600)


def certificate_authority(out: Path) -> None:
    if (out / "ca.crt").exists() and (out / "ca.key").exists():
        return
    _openssl("req", "-x509", *CURVE, "-keyout", "ca.key", "-out", "ca.crt",
             "-days", str(CA_DAYS), "-subj", "/CN=tether-dev-ca", cwd=out)
    _private(out / "ca.key")


def server_certificate(out: Path, server: str, names: tuple[str, ...]) -> Path:
    directory = out / f"{server}-tls"
    directory.mkdir(parents=True, exist_ok=True)
    if (directory / "tls.crt").exists() and (directory / "tls.key").exists():
        return directory
    alternative = ",".join([*(f"DNS:{name}" for name in (*names, *LOCAL_NAMES)),
                            *(f"IP:{address}" for address in LOCAL_ADDRESSES)])
    (directory / "tls.ext").write_text(f"subjectAltName={alternative}\n"
                                       "extendedKeyUsage=serverAuth,clientAuth\n")
    _openssl("req", *CURVE, "-keyout", "tls.key", "-out", "tls.csr", "-subj", f"/CN={server}",
             cwd=directory)
    _private(directory / "tls.key")
    _openssl("x509", "-req", "-in", "tls.csr", "-CA", str(out / "ca.crt"), "-CAkey",
             str(out / "ca.key"), "-CAcreateserial", "-out", "tls.crt",
             "-days", str(CERT_DAYS), "-extfile", "tls.ext", cwd=directory)
    for leftover in ("tls.csr", "tls.ext"):
        (directory / leftover).unlink()
    return directory


def generate(out: Path, applications: list[Application], *, tether_uid: int | None = None,
             postgres_uid: int | None = None) -> dict[str, str]:
    """Write every secret under `out` (keeping what is there); returns each user's public
    NKey."""
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    certificate_authority(out)
    for server, names in SERVERS.items():
        server_certificate(out, server, names)
    users = (*USERS, *(app.user for app in applications))
    public = nkey_files(out / "nkeys", users)
    (out / "nats-public-keys.env").write_text(
        "".join(f"{nkey_variable(user)}={key}\n" for user, key in public.items()))
    if tether_uid is not None:
        for seed in (out / "nkeys").iterdir():
            os.chown(seed, tether_uid, tether_uid)
        os.chown(out / "nkeys", tether_uid, tether_uid)
    if postgres_uid is not None:
        os.chown(out / "postgres-tls" / "tls.key", postgres_uid, postgres_uid)
    return public


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tether.dev_secrets", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, metavar="DIR")
    parser.add_argument("--application", action="append", default=[],
                        metavar="USER:AGENT[,AGENT][:METHOD[,METHOD]]",
                        help="an application user that gets an NKey too (repeatable)")
    parser.add_argument("--tether-uid", type=int, metavar="UID",
                        help="hand the NKey seeds to this user (the services' in the image)")
    parser.add_argument("--postgres-uid", type=int, metavar="UID",
                        help="hand Postgres's key to this user (the postgres image's)")
    args = parser.parse_args(argv)
    try:
        public = generate(Path(args.out), [Application.parse(t) for t in args.application],
                          tether_uid=args.tether_uid, postgres_uid=args.postgres_uid)
    except (SecretsFailed, OSError) as error:
        print(f"python -m tether.dev_secrets: {error}", file=sys.stderr)
        return 1
    print(f"{args.out}: the CA, certificates for {', '.join(SERVERS)}, and NKeys for "
          f"{', '.join(public)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
