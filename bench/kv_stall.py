"""How long huge prompts hold a kv frontend's event loop (not a test).

    .venv/bin/python -m bench.kv_stall [TARGET] [--base-src DIR]

Starts two mocker workers and one gateway as `bench/kv_routing.py` does (TARGET: shoal:kv by
default, or shoal:prefix, base:kv with --base-src), runs ../shared/tools/stall_probe.py on its
`/live` (a request every 5 ms) and meanwhile sends: a 10 MB chat of one message, a 10 MB chat of
40,000 messages, a 30 KB chat, a 10 MB completion prompt, then 20 chats of ~6 KB. The workers
refuse the 10 MB ones (context length): what is judged is the frontend's work before that.
Prints the probe's line (its max is the longest the loop was held, in wall time) and the kv
policy's counters.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import bench.kv_routing as k
from bench.gateway_targets import ROOT, Session, http

PROBE = (
    next(
        (p for p in (ROOT.parent / "shared", ROOT.parent.parent / "shared") if p.is_dir()),
        ROOT.parent / "shared",
    )
    / "tools"
    / "stall_probe.py"
)  # ../shared beside the repository (or its worktrees' folder)


def post(url: str, body: dict[str, Any], data: bytes | None = None) -> tuple[int, float]:
    """POST `body` (encoded already as `data`: this process's own work stays out of the
    probe's window on a small machine)."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    request = urllib.request.Request(
        url + path,
        data=json.dumps(body).encode() if data is None else data,
        method="POST",
        headers={"Content-Type": "application/json", "Authorization": "Bearer x"},
    )
    start = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            response.read()
            status = int(response.status)
    except urllib.error.HTTPError as exc:
        exc.read()
        status = exc.code
    return status, round(time.monotonic() - start, 2)


def main(argv: list[str]) -> int:
    target = argv[0] if argv and not argv[0].startswith("--") else "shoal:kv"
    args = k.parse_args(["--workers", "2", "--quick", *[a for a in argv if a != target]])
    if not PROBE.exists():
        print(f"{PROBE} not found", file=sys.stderr)
        return 1
    tmp = Path(tempfile.mkdtemp(prefix="shoal-kv-stall-"))
    session = Session(tmp, pin=False)
    store = f"sqlite:///{tmp / 'store.db'}"
    try:
        workers = k.start_workers(session, args, store)
        _, url, _, _ = k.start_target(session, target, workers, store, args)
        text = " ".join(k.WORDS[i % 100] for i in range(2_000_000))[:10_000_000]
        model = k.MODEL
        cases: dict[str, dict[str, Any]] = {
            "10 MB chat, one message": {"messages": [{"role": "user", "content": text}]},
            "10 MB chat, 40,000 messages": {
                "messages": [
                    {
                        "role": "user" if i % 2 else "assistant",
                        "content": text[i * 250 : i * 250 + 250],
                    }
                    for i in range(40_000)
                ]
            },
            "30 KB chat": {"messages": [{"role": "user", "content": text[:30_000]}]},
            "10 MB completion": {"prompt": text},
        }
        bodies = {name: {"model": model, "max_tokens": 1, **body} for name, body in cases.items()}
        encoded = {name: json.dumps(body).encode() for name, body in bodies.items()}
        argv_probe = [sys.executable, str(PROBE), f"{url}/live", "--seconds", "14"]
        spy = subprocess.Popen(argv_probe, stdout=subprocess.PIPE, text=True)
        time.sleep(1)
        for name, body in bodies.items():
            print(name, post(url, body, encoded[name]), flush=True)
        for i in range(20):
            chat = [{"role": "user", "content": text[i * 500 : i * 500 + 6000]}]
            post(url, {"model": model, "max_tokens": 1, "messages": chat})
        out, _ = spy.communicate(timeout=60)
        print(out.strip())
        metrics = http("GET", f"{url}/metrics").decode()
        print("\n".join(re.findall(r"^shoal_frontend_kv_\w+_total \S+$", metrics, re.M)))
    finally:
        session.stop_all()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
