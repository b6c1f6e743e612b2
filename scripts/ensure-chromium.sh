#!/usr/bin/env bash
# Install Debian's chromium if /usr/bin/chromium is missing: the dashboard's browser tests drive it
# with Playwright (pointed at this binary; Playwright's own browser downloads are never used).
# Idempotent and quick when present. Waits (up to 10 minutes) while another apt-get holds a lock.
set -euo pipefail
if [ -x /usr/bin/chromium ]; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
apt_get() {
  for _ in $(seq 60); do
    if $SUDO apt-get -o DPkg::Lock::Timeout=10 "$@"; then return 0; fi
    echo "apt-get $1 failed (another apt-get holding a lock?): retrying in 10 s" >&2
    sleep 10
  done
  return 1
}
echo "installing chromium (Debian package) for the dashboard's browser tests..."
apt_get update -qq
apt_get install -y -qq --no-install-recommends chromium fonts-dejavu-core >/dev/null
test -x /usr/bin/chromium
