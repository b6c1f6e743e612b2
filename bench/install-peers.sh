#!/usr/bin/env bash
# Install the peer gateways that bench/gateway.py compares shoal with, outside the repo's
# tracked files: a separate virtualenv in .bench/peers-venv (.bench/ is gitignored), plus wrk.
#
#     bash bench/install-peers.sh            # idempotent: re-running only checks
#
# Versions are pinned to releases checked on this kind of machine. LiteLLM 1.82.7 and 1.82.8
# were malicious releases: never move the pin to either of them.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${SHOAL_PEERS_VENV:-$ROOT/.bench/peers-venv}"
PYTHON="${PYTHON:-python3}"

VLLM_ROUTER="vllm-router==0.1.17"
SGLANG_ROUTER="sglang-router==0.3.2"
LITELLM="litellm[proxy]==1.108.7"

case "$LITELLM" in
*==1.82.7* | *==1.82.8*)
    echo "refusing to install a known-malicious LiteLLM release: $LITELLM" >&2
    exit 1
    ;;
esac

if ! command -v wrk >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1; then
        echo "installing wrk (apt-get)"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq wrk
    else
        echo "wrk is missing and apt-get is not available: install wrk by hand" >&2
    fi
fi

if [ ! -x "$VENV/bin/python" ]; then
    echo "creating $VENV"
    mkdir -p "$(dirname "$VENV")"
    "$PYTHON" -m venv "$VENV"
fi

status=0
install() {
    # One pip call per peer, so that one that fails to resolve does not keep the others out.
    # (This machine's pip config lists local indexes that hold only some packages: hide their
    # "is ignored" warnings, keep every other line.)
    if "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "$1" \
        2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); then
        echo "ok: $1"
    else
        echo "FAILED: $1" >&2
        status=1
    fi
}
install "$VLLM_ROUTER"
install "$SGLANG_ROUTER"
install "$LITELLM"

for exe in vllm-router sglang-router litellm; do
    if [ -x "$VENV/bin/$exe" ]; then echo "found: $VENV/bin/$exe"; else echo "missing: $VENV/bin/$exe" >&2; fi
done
if "$VENV/bin/python" -c "import sglang_router.launch_router" 2>/dev/null; then
    echo "found: sglang_router.launch_router"
else
    echo "missing: sglang_router.launch_router" >&2
fi
exit "$status"
