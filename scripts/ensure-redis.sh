#!/usr/bin/env bash
# Make redis-server available for the limits tests: a binary on this machine, else Debian's
# redis-server package. Idempotent and quick when present. The tests start their own servers
# on free loopback ports (so they can kill one); a running system Redis is left alone.
set -euo pipefail
if command -v redis-server >/dev/null 2>&1 || [ -x /usr/bin/redis-server ]; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
echo "installing redis-server (Debian package) for the limits tests..."
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server >/dev/null
