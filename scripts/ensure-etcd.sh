#!/usr/bin/env bash
# Install Debian's etcd-server if no etcd binary is on this machine. Idempotent and quick when present.
set -euo pipefail
if command -v etcd >/dev/null 2>&1 || [ -x /usr/bin/etcd ]; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
echo "installing etcd-server (Debian package) for the store tests..."
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq etcd-server >/dev/null
# The package may start a system etcd on the default ports; the tests start their own.
$SUDO systemctl stop etcd 2>/dev/null || true
