"""CPU of masking a provider's key in a 200 SSE stream (`virtual.masking.Masked.feed`):
~1.1 MB of ~140-byte chat-completion chunks, one event a packet and 16 a packet; best of 5.

    PYTHONPATH=$PWD/src:$PWD .venv/bin/python -m bench.mask_cost [KEY]
"""

from __future__ import annotations

import json
import sys
import time

from shoal.frontend.virtual.masking import Masked


def main() -> None:
    key = (sys.argv[1] if len(sys.argv) > 1 else "sk-live/PROVIDER+SECRET=0123456789~x").encode()
    chunk = {"id": "chatcmpl-abc", "object": "chat.completion.chunk"}
    events = [
        f"data: {json.dumps({**chunk, 'choices': [{'delta': {'content': f'token {i}'}}]})}\n\n".encode()
        for i in range(8000)
    ]
    size = sum(map(len, events))
    for per in (1, 16):
        packets = [b"".join(events[i : i + per]) for i in range(0, len(events), per)]
        best = 1e9
        for _ in range(5):
            t = time.process_time()
            masked = Masked(key)
            out = b"".join(masked.feed(p) for p in packets) + masked.rest()
            best = min(best, time.process_time() - t)
        assert len(out) == size
        print(f"{per} event(s) a packet: {best / size * 1e9:.1f} ms of CPU per MB ({size:,} bytes)")


if __name__ == "__main__":
    main()
