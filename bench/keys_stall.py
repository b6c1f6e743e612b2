"""How long 9 MB requests with an API key hold a frontend's event loop (not a test).

    PYTHONPATH=src:. .venv/bin/python -m bench.keys_stall [--router prefix] [--base DIR]

Starts a mocker worker and `shoal frontend --auth keys` (a grant for the bench's bearer in the
store, as `gateway_targets.start_shoal` writes it; `--base DIR`: the frontend from that source
tree), runs ../shared/tools/stall_probe.py on its `/live` (a request every 5 ms) and
meanwhile sends, with the key, `--rounds` rounds of: a 9 MB chat of 31,000 messages and a
9 MB chat of one message, `--clients` at a time. The bodies are encoded before the probe
starts. The worker may refuse them (its context length): what is judged is the frontend's
work before that. Prints each round's answers and the probe's line (its max is the longest
the loop was held, in wall time, with the worker and the client on the same cores).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from bench.gateway_targets import API_KEY, Session, start_shoal, start_worker
from bench.kv_stall import PROBE

MODEL = "bench-model"
WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "by", "the", "bank")


def bodies() -> dict[str, bytes]:
    text = " ".join(WORDS[i % len(WORDS)] for i in range(2_000_000))[:9_000_000]
    many = [
        {"role": "user" if i % 2 else "assistant", "content": text[i * 250 : i * 250 + 250]}
        for i in range(31_000)
    ]
    return {
        "9 MB chat, 31,000 messages": json.dumps(
            {"model": MODEL, "max_tokens": 1, "messages": many}
        ).encode(),
        "9 MB chat, one message": json.dumps(
            {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": text}]}
        ).encode(),
    }


def post(url: str, data: bytes) -> str:
    """The answer's status, and the start of its error message if any."""
    request = urllib.request.Request(
        url + "/v1/chat/completions",
        data=data,
        method="POST",
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"},
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            response.read()
            return str(response.status)
    except urllib.error.HTTPError as exc:
        message = json.loads(exc.read() or b"{}").get("error", {}).get("message", "")
        return f"{exc.code} {message[:60]!r}"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--router", default="round-robin")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--base", type=Path, default=None, help="run the frontend from DIR/src")
    args = ap.parse_args(argv)
    if not PROBE.exists():
        print(f"{PROBE} not found", file=sys.stderr)
        return 1
    tmp = Path(tempfile.mkdtemp(prefix="shoal-keys-stall-"))
    session = Session(tmp, pin=False)
    store = f"sqlite:///{tmp / 'store.db'}"
    try:
        start_worker(session, MODEL, store)
        target = start_shoal(session, MODEL, store, auth="keys", base=args.base, router=args.router)
        encoded = bodies()
        seconds = 3 + 2.5 * args.rounds
        probe = [sys.executable, str(PROBE), f"{target.url}/live", "--seconds", f"{seconds:g}"]
        spy = subprocess.Popen(probe, stdout=subprocess.PIPE, text=True)
        time.sleep(1)
        for round_ in range(args.rounds):
            for name, data in encoded.items():
                answers: list[str] = []

                def send(data: bytes = data, answers: list[str] = answers) -> None:
                    answers.append(post(target.url, data))

                sending = [threading.Thread(target=send) for _ in range(args.clients)]
                for thread in sending:
                    thread.start()
                for thread in sending:
                    thread.join()
                print(f"round {round_ + 1}: {name}: {sorted(answers)}", flush=True)
        out, _ = spy.communicate(timeout=120)
        print(f"{target.name} ({target.version}, --router {args.router}): {out.strip()}")
    finally:
        session.stop_all()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
