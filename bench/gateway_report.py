"""The report of bench/gateway.py: medians over rounds, ratios to direct, the targets, markdown."""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import statistics
import subprocess
from typing import Any

WORKLOADS = ("c1", "c32", "stream")
WORKLOAD_TITLES = {
    "c1": "Non-streaming chat completions, concurrency 1 (wrk -t1 -c1)",
    "c32": "Non-streaming chat completions, concurrency 32 (wrk -t1 -c32)",
    "stream": "Streaming chat completions, concurrency 32 (bench/gateway_stream.py)",
}
NOISY_PCT = 25.0  # a run during which other processes used more of a core than this is noisy
SUMMARY_KEYS = (
    "requests_per_s",
    "p50_ms",
    "p99_ms",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "tokens_per_s",
    "gateway_cpu_us_per_req",
    "gateway_sys_us_per_req",
    "worker_cpu_us_per_req",
    "gateway_cpu_pct",
    "client_cpu_pct",
    "foreign_cpu_pct",
)


def median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def ratio(value: float | None, base: float | None) -> float | None:
    return value / base if value is not None and base else None


def summarize(runs: list[dict[str, Any]], targets: list[str]) -> dict[str, dict[str, Any]]:
    """Per workload and target: medians over rounds, and ratios to direct."""
    summary: dict[str, dict[str, Any]] = {}
    for workload in WORKLOADS:
        per: dict[str, Any] = {}
        for name in targets:
            mine = [r for r in runs if r["workload"] == workload and r["target"] == name]
            if not mine:
                continue
            row: dict[str, Any] = {k: median([r.get(k) for r in mine]) for k in SUMMARY_KEYS}
            rates = [r["requests_per_s"] for r in mine]
            row["spread_pct"] = ratio((max(rates) - min(rates)) * 100, row["requests_per_s"])
            row["errors"] = sum(r.get("errors", 0) for r in mine)
            row["requests"] = sum(r["requests"] for r in mine)
            row["rounds"] = len(mine)
            per[name] = row
        direct = per.get("direct", {})
        latency = "ttft_p50_ms" if workload == "stream" else "p50_ms"
        for row in per.values():
            row["ratio"] = ratio(row["requests_per_s"], direct.get("requests_per_s"))
            row["tokens_ratio"] = ratio(row["tokens_per_s"], direct.get("tokens_per_s"))
            base = direct.get(latency)
            row["added_p50_ms"] = (
                None if base is None or row[latency] is None else row[latency] - base
            )
        if per:
            summary[workload] = per
    return summary


def fmt(value: float | None, spec: str = ",.0f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def table(workload: str, per: dict[str, Any]) -> list[str]:
    cpu = "gateway CPU/req (of which system) | worker CPU/req | errors"
    if workload == "stream":
        head = f"| target | req/s | tokens/s | ÷ direct | TTFT p50 | TTFT p99 | {cpu} |"
    else:
        head = f"| target | req/s (spread) | ÷ direct | p50 | p99 | added p50 | {cpu} |"
    lines = [head, "|" + " --- |" * 9]
    for name, r in per.items():
        if workload == "stream":
            figures = [
                fmt(r["requests_per_s"]),
                fmt(r["tokens_per_s"]),
                fmt(r["tokens_ratio"], ".2f"),
                fmt(r["ttft_p50_ms"], ".2f", " ms"),
                fmt(r["ttft_p99_ms"], ".2f", " ms"),
            ]
        else:
            figures = [
                f"{fmt(r['requests_per_s'])} ({fmt(r['spread_pct'], '.0f', '%')})",
                fmt(r["ratio"], ".2f"),
                fmt(r["p50_ms"], ".2f", " ms"),
                fmt(r["p99_ms"], ".2f", " ms"),
                fmt(r["added_p50_ms"], "+.2f", " ms"),
            ]
        figures += [
            fmt(r["gateway_cpu_us_per_req"], ",.0f", " µs")
            + (
                f" ({fmt(r['gateway_sys_us_per_req'], ',.0f')})"
                if r["gateway_sys_us_per_req"]
                else ""
            ),
            fmt(r["worker_cpu_us_per_req"], ",.0f", " µs"),
            str(r["errors"]),
        ]
        lines.append(f"| {name} | " + " | ".join(figures) + " |")
    return lines


def targets_check(summary: dict[str, dict[str, Any]]) -> list[tuple[str, bool | None, str]]:
    """The issue's targets for shoal: (what, passed or None when not measured, the figures)."""

    def get(workload: str, name: str, key: str) -> float | None:
        value: float | None = summary.get(workload, {}).get(name, {}).get(key)
        return value

    def check(what: str, passed: bool | None, figures: str) -> tuple[str, bool | None, str]:
        return what, passed, figures

    checks = []
    s, v = get("c32", "shoal", "ratio"), get("c32", "vllm-router", "ratio")
    checks.append(
        check(
            "non-streaming c32: shoal ÷ direct ≥ vllm-router ÷ direct",
            None if s is None or v is None else s >= v,
            f"{fmt(s, '.2f')} vs {fmt(v, '.2f')}",
        )
    )
    s, v = (
        get("c32", "shoal", "gateway_cpu_us_per_req"),
        get("c32", "vllm-router", "gateway_cpu_us_per_req"),
    )
    limit = None if v is None else 0.75 * v
    checks.append(
        check(
            "non-streaming c32: shoal CPU/req ≤ 0.75 x vllm-router's",
            None if s is None or limit is None else s <= limit,
            f"{fmt(s, ',.0f', ' µs')} vs 0.75 x {fmt(v, ',.0f', ' µs')} = {fmt(limit, ',.0f', ' µs')}",
        )
    )
    s, v = get("stream", "shoal", "tokens_ratio"), get("stream", "vllm-router", "tokens_ratio")
    checks.append(
        check(
            "streaming: shoal tokens/s ÷ direct ≥ vllm-router's",
            None if s is None or v is None else s >= v,
            f"{fmt(s, '.2f')} vs {fmt(v, '.2f')}",
        )
    )
    s = get("c1", "shoal", "added_p50_ms")
    checks.append(
        check(
            "non-streaming c1: added p50 (shoal - direct) < 1 ms",
            None if s is None else s < 1.0,
            fmt(s, "+.3f", " ms"),
        )
    )
    s, v = get("c32", "shoal", "requests_per_s"), get("c32", "litellm", "requests_per_s")
    limit = None if v is None else 50 * v
    checks.append(
        check(
            "non-streaming c32: shoal ≥ 50 x LiteLLM req/s",
            None if s is None or limit is None else s >= limit,
            f"{fmt(s)} vs 50 x {fmt(v)} = {fmt(limit)} ({fmt(ratio(s, v), '.0f')}x)",
        )
    )
    # Keys and limits on the request path, over the plain frontend (both measured in the run).
    base_cpu, base_p50 = get("c1", "shoal", "gateway_cpu_us_per_req"), get("c1", "shoal", "p50_ms")
    for name in ("shoal-keys", "shoal-limits", "shoal-keys@base", "shoal-limits@base"):
        if name not in summary.get("c1", {}) and name not in summary.get("c32", {}):
            continue
        cpu, p50 = get("c1", name, "gateway_cpu_us_per_req"), get("c1", name, "p50_ms")
        d_cpu = None if cpu is None or base_cpu is None else cpu - base_cpu
        d_p50 = None if p50 is None or base_p50 is None else p50 - base_p50
        c32, base32 = (
            get("c32", name, "gateway_cpu_us_per_req"),
            get("c32", "shoal", "gateway_cpu_us_per_req"),
        )
        d32 = None if c32 is None or base32 is None else c32 - base32
        checks.append(
            check(
                f"non-streaming c1: {name} - shoal: CPU/req ≤ +15 µs and p50 ≤ +0.3 ms",
                None if d_cpu is None or d_p50 is None else d_cpu <= 15 and d_p50 <= 0.3,
                f"{fmt(d_cpu, '+,.1f', ' µs')}, {fmt(d_p50, '+.3f', ' ms')} "
                f"(CPU/req at c32: {fmt(d32, '+,.1f', ' µs')})",
            )
        )
    return checks


def machine_info() -> dict[str, Any]:
    cpu_model = "?"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    wrk = "missing"
    if shutil.which("wrk"):
        out = subprocess.run(["wrk", "-v"], capture_output=True, text=True)
        wrk = (out.stdout + out.stderr).split(" Copyright")[0].strip()
    return {
        "nproc": os.cpu_count(),
        "cpu_model": cpu_model,
        "python": platform.python_version(),
        "kernel": platform.release(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30),
        "wrk": wrk,
    }


def report(data: dict[str, Any]) -> str:
    """The markdown report: how it was run, on what, the tables, the targets, the profile."""
    m = data["machine"]
    litellm = (
        f"; LiteLLM's runs are x{data['litellm_scale']:g} as long (at least 1 s)"
        if "litellm" in data["targets"]
        else ""
    )
    out = [
        f"Command: `{data['command']}`",
        "",
        f"Date: {data['date']}. Machine: {m['nproc']} cores ({m['cpu_model']}), "
        f"{m['memory_gib']} GiB, Linux {m['kernel']}, Python {m['python']}, {m['wrk']}.",
        "",
        f"Pinning: {data['pinning']}.",
        "",
        f"Runs: {data['rounds']} rounds, interleaved: each round runs each workload against "
        f"every target in turn ({', '.join(data['targets'])}); non-streaming runs "
        f"{data['durations']['wrk']:g} s, streaming {data['durations']['stream']:g} s{litellm}. "
        "Figures are medians over rounds; spread is (max - min) ÷ median of req/s. "
        "CPU/req is user+system CPU time of the process tree over the requests served.",
        "",
    ]
    if data["versions"]:
        out += ["Versions: " + ", ".join(f"{k} {v}" for k, v in data["versions"].items()) + ".", ""]
    runs = data["runs"]
    if runs:
        idle = [r["idle_gateways_cpu_pct"] for r in runs]
        foreign = [r["foreign_cpu_pct"] for r in runs]
        busy = [r["machine_busy_pct"] for r in runs]
        if data["quiet_wait_s"]:
            waits = [r["quiet_wait_s"] for r in runs]
            out += [
                f"Before each run the benchmark waited up to {data['quiet_wait_s']:g} s for the "
                f"rest of the machine to use under 20% of a core (waited {sum(waits):.0f} s in all), "
                f"and ran again (at most twice) when other processes took more than {NOISY_PCT:g}% of a core "
                f"during the run, keeping the quietest attempt "
                f"({sum(r['attempts'] > 1 for r in runs)} runs were repeated).",
                "",
            ]
        out += [
            "Background during runs (% of one core, mean / max): gateways not under test "
            f"{statistics.mean(idle):.1f} / {max(idle):.1f}; processes outside the benchmark "
            f"{statistics.mean(foreign):.1f} / {max(foreign):.1f}. All cores were "
            f"{statistics.mean(busy):.0f}% busy on average during runs. Load average at start: "
            f"{data['loadavg_at_start']}.",
            "",
        ]
        if max(foreign) > NOISY_PCT:
            out += [
                "Warning: other processes used the CPU during some runs; their figures are "
                "noisy (`foreign_cpu_pct` per run in the JSON).",
                "",
            ]
    for note in data["notes"]:
        out += [f"Note: {note}", ""]
    for workload, per in data["summary"].items():
        out += [f"**{WORKLOAD_TITLES[workload]}**", "", *table(workload, per), ""]
    out += ["**Targets for shoal**", "", "| target | result | figures |", "| --- | --- | --- |"]
    for what, passed, figures in data["targets_check"]:
        verdict = "n/a" if passed is None else ("PASS" if passed else "FAIL")
        out.append(f"| {what} | {verdict} | {figures} |")
    out.append("")
    if profile := data.get("profile"):
        out += [profile_section(profile), ""]
    return "\n".join(out)


def profile_section(profile: dict[str, Any]) -> str:
    if "error" in profile:
        return f"Profile of the shoal frontend failed: {profile['error']}"
    lines = [
        f"**Profile of the {profile.get('target', 'shoal')} frontend under wrk -c32** (py-spy --native, {profile['seconds']} s: "
        f"{profile['samples']} samples of working threads, {profile['idle_samples']} of waiting "
        f"ones left out; stacks: {profile['raw']}; flame graph of Python frames: {profile['svg']})",
        "",
        "| own time | function |",
        "| --- | --- |",
    ]
    lines += [f"| {pct:.1f}% | `{frame}` |" for frame, pct in profile["top_own"]]
    lines += ["", "| total time | shoal function |", "| --- | --- |"]
    lines += [f"| {pct:.1f}% | `{frame}` |" for frame, pct in profile["top_inclusive"]]
    return "\n".join(lines)
