"""What recording one pick costs the event loop once `RecentPicks` is at its capacity (not a
test): 2,000 picks of 1,024 blocks (a long prompt's), CPU time of each `record` call.

    .venv/bin/python -m bench.kv_recent_picks
"""

from __future__ import annotations

import random
import time

from shoal.frontend.kv.index import RecentPicks


def main() -> None:
    picks = RecentPicks()
    rnd = random.Random(1)
    spent = []
    for i in range(2000):
        hashes = [rnd.getrandbits(64) for _ in range(1024)]
        started = time.thread_time()
        picks.record(hashes, i % 3, 1000.0 + i * 0.001)
        spent.append(time.thread_time() - started)
    spent.sort()
    print(
        f"record of 1,024 blocks: max {spent[-1] * 1e3:.2f} ms, "
        f"p99 {spent[int(len(spent) * 0.99)] * 1e3:.2f} ms, p50 {spent[len(spent) // 2] * 1e3:.2f} ms, "
        f"over 5 ms: {sum(s > 0.005 for s in spent)} of {len(spent)}"
    )


if __name__ == "__main__":
    main()
