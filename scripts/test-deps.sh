#!/usr/bin/env bash
# The system programs the test suite needs besides Python: Debian's Chromium and its driver
# (the UI's browser tests), redis-server (the benchmark's Celery peer), faketime (the
# chaos scenarios' skewed clocks), npm (the Restate peer's server is an npm package).
# Installs the missing ones with apt-get as root, or with `sudo -n` where that needs no
# password; otherwise names them and the command, and fails.
set -euo pipefail
missing=()
if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
    missing+=(chromium chromium-driver)
fi
command -v redis-server >/dev/null || missing+=(redis-server)
command -v faketime >/dev/null || missing+=(faketime)
command -v npm >/dev/null || missing+=(npm)
[ ${#missing[@]} -eq 0 ] && exit 0

install=(apt-get install -y -q --no-install-recommends "${missing[@]}")
if ! command -v apt-get >/dev/null; then
    echo "test-deps: the tests need ${missing[*]} (Debian package names), and this machine" \
         "has no apt-get: install them with its package manager, then run make test again" >&2
    exit 2
fi
if [ "$(id -u)" -eq 0 ]; then
    as_root=()
elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
    as_root=(sudo -n)
else
    echo "test-deps: the tests need ${missing[*]}; install them as root:" >&2
    echo "  sudo apt-get update && sudo ${install[*]}" >&2
    exit 2
fi
echo "test-deps: installing ${missing[*]}" >&2
"${as_root[@]}" apt-get update -q
DEBIAN_FRONTEND=noninteractive "${as_root[@]}" "${install[@]}"
