#!/usr/bin/env bash
# Install Debian's nats-server if no nats-server binary is on this machine (the KV relay tests
# start their own, JetStream enabled, on a free loopback port). Idempotent and quick when present.
set -euo pipefail
if command -v nats-server >/dev/null 2>&1 || [ -x /usr/sbin/nats-server ]; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
echo "installing nats-server (Debian package) for the KV relay tests..."
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq nats-server >/dev/null
# The package may start a system server on the default port; the tests start their own.
$SUDO systemctl stop nats-server 2>/dev/null || true
