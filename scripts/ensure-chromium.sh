#!/usr/bin/env bash
# Install Debian's chromium if /usr/bin/chromium is missing: the dashboard's browser tests drive it
# with Playwright (pointed at this binary; Playwright's own browser downloads are never used).
# Idempotent and quick when present. Waits for another apt-get holding the dpkg lock.
set -euo pipefail
if [ -x /usr/bin/chromium ]; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
echo "installing chromium (Debian package) for the dashboard's browser tests..."
APT=(-o DPkg::Lock::Timeout=600)
$SUDO apt-get "${APT[@]}" update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get "${APT[@]}" install -y -qq --no-install-recommends \
  chromium fonts-dejavu-core >/dev/null
test -x /usr/bin/chromium
