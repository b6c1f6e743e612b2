"""The soak of bench/soak.py, one minute long: churn under steady load leaks nothing and fails
no request that had not started streaming."""

from __future__ import annotations

import os
from pathlib import Path

from bench.soak import Soak, growth

from tests.faults.support import Row

DURATION = float(os.environ.get("SHOAL_SOAK_SECONDS", "60"))


async def test_one_minute_of_churn_under_load_leaks_nothing_and_fails_nothing(
    tmp_path: Path,
) -> None:
    figures = await Soak(DURATION, churn_seconds=3, clients=8, tmp=tmp_path).run()
    ratios = growth(figures)
    Row(
        f"soak {DURATION:g} s: workers churned, adapters swapped, a frontend restarted",
        "sqlite", figures["requests_sent"], figures["failed_before_first_byte"],
        figures["failed_mid_stream"], 0.0, figures["registry_after"] - figures["registry_baseline"],
        "SHOAL_SOAK_SECONDS=60 pytest tests/faults/test_soak.py",
    ).record()  # fmt: skip
    assert figures["failed_before_first_byte"] == 0, figures["failures"]
    assert figures["workers_churned"] >= DURATION / 6
    for name, ratio in ratios.items():
        assert ratio["rss_kib"] <= 1.10, (name, figures["after_warmup"], figures["end"])
        # a few descriptors come and go with connections in flight: 10 % or 4, whichever is more
        limit = max(
            figures["after_warmup"][name]["fds"] * 1.10, figures["after_warmup"][name]["fds"] + 4
        )
        assert figures["end"][name]["fds"] <= limit, (name, figures["after_warmup"], figures["end"])
    assert figures["registry_after"] == figures["registry_baseline"]
    assert figures["worker_models_after"] == figures["worker_models_baseline"]
