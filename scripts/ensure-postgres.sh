#!/usr/bin/env bash
# Make PostgreSQL available to the catalog tests (tests/postgres_server.py picks it up):
# SHOAL_TEST_POSTGRES_URL when set, else a server on 127.0.0.1:5432, else Debian's postgresql
# package, from which the tests start a throwaway cluster on a free port. Idempotent.
set -euo pipefail
if [ -n "${SHOAL_TEST_POSTGRES_URL:-}" ]; then
  exit 0
fi
if (exec 3<>/dev/tcp/127.0.0.1/5432) 2>/dev/null; then
  exit 0
fi
if command -v initdb >/dev/null 2>&1 || ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
echo "installing postgresql (Debian package) for the catalog tests..."
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq postgresql >/dev/null
# The package may start a system cluster; the tests start their own on a free port.
$SUDO systemctl stop postgresql 2>/dev/null || true
