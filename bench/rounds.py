"""What the side-by-side benchmarks share: rounds over named setups, one median row per setup,
and where the raw results go (`.bench/NAME-results.json`, beside the printed table)."""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from bench.gateway_targets import ROOT


def percentile(values: list[float], q: float) -> float:
    """The `q` quantile by rank (nan for no values)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_rounds(
    names: Iterable[str], rounds: int, run_one: Callable[[str], dict[str, Any]]
) -> list[dict[str, Any]]:
    """Each setup once per round, interleaved (round 1: a, b; round 2: a, b), so a machine
    that gets busier during the run weighs on every setup alike; progress on stderr."""
    names = [n.strip() for n in names]
    results: list[dict[str, Any]] = []
    for round_ in range(rounds):
        for name in names:
            print(f"round {round_ + 1}: {name} ...", file=sys.stderr, flush=True)
            results.append(run_one(name))
            print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    return results


def medians(results: list[dict[str, Any]], by: str, figures: Iterable[str]) -> list[dict[str, Any]]:
    """One row per value of `by`: the median of each figure over its rounds, the errors
    summed; a setup skipped in every round keeps its skip row."""
    rows: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        rows.setdefault(r[by], []).append(r)
    out = []
    for runs in rows.values():
        done = [r for r in runs if "skipped" not in r]
        if not done:
            out.append(runs[0])
            continue
        row = dict(done[0])
        for key in figures:
            row[key] = statistics.median(r[key] for r in done)
        row["errors"] = sum(r["errors"] for r in done)
        row["rounds"] = len(done)
        out.append(row)
    return out


def publish(text: str, results: list[dict[str, Any]], name: str, report: Path | None) -> None:
    """Print the table, write it to `report` if asked, and keep the raw results."""
    print(text)
    if report:
        report.write_text(text + "\n")
    (ROOT / ".bench").mkdir(exist_ok=True)
    (ROOT / ".bench" / f"{name}-results.json").write_text(json.dumps(results, indent=2))
