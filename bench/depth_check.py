"""CPU of `shoal.bounds.json_depth_exceeds` on values the store accepts (1 MiB at most), and on
10 MB request bodies: best of 5, in thread CPU time (another process on the box does not
count). The store's values are checked on the event loop before they are decoded (cards,
instances, routes, grants), one call a value.

    PYTHONPATH=$PWD/src:$PWD .venv/bin/python -m bench.depth_check
"""

from __future__ import annotations

import json
import time

from shoal.bounds import json_depth_exceeds

MIB = 1 << 20


def values(size: int) -> dict[str, bytes]:
    nest = b"[" * 60 + b"]" * 60
    bound = b"[" * 63 + b"]" * 63  # (in the outer array: 64 levels, the bound)
    string_nest = b'["[",' * 30 + b'"]"' + b"]" * 30
    return {
        "nests 60 deep": b"[" + b",".join([nest] * (size // 121)) + b"]",
        "nests 64, the last 65": b"["
        + b",".join([bound] * (size // 127) + [b"[" + bound + b"]"])
        + b"]",
        "flat string": json.dumps("x" * (size - 2)).encode(),
        "strings of brackets": b"[" + b",".join([string_nest] * (size // 190)) + b"]",
        "escapes": json.dumps(['\\"[' * (size // 16)]).encode()[:size],
        "stray closers": b"]" * size,
        "a stray closer, then nests": b"]" + b",".join([nest] * (size // 121)),
    }


def best_ms(data: bytes) -> float:
    best = 1e9
    for _ in range(5):
        started = time.thread_time()
        json_depth_exceeds(data)
        best = min(best, time.thread_time() - started)
    return best * 1000


def main() -> None:
    for size, label in ((MIB, "1 MiB"), (10 * 1000 * 1000, "10 MB")):
        for name, data in values(size).items():
            print(f"{label:6} {name:24} {best_ms(data):7.2f} ms  ({json_depth_exceeds(data)})")


if __name__ == "__main__":
    main()
