"""A chaos run's report: ``report.json`` (everything), ``report.md`` (a verdict per check, a
table per fault), ``timeline.png`` (throughput, TTFT p50/p99 and errors per second, the faults
marked) and ``requests.jsonl`` (each request: what it came to, where it ran, what touched it)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from chaos.verdict import Summary


def write_report(summary: Summary, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    files = [out / "report.json", out / "report.md", out / "timeline.png", out / "requests.jsonl"]
    files[0].write_text(json.dumps(_json_safe(summary.as_dict()), indent=1, default=str))
    files[1].write_text(markdown(summary))
    plot(summary, files[2])
    files[3].write_text("".join(json.dumps(r, default=str) + "\n" for r in summary.requests))
    return files


def _json_safe(value: Any) -> Any:
    """``value`` with each NaN (a percentile of no samples) as None: JSON has no NaN."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


def _s(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.2f}"


def markdown(s: Summary) -> str:
    lines = [
        f"# Chaos run `{s.plan}`: {'PASS' if s.verdict else 'FAIL'}",
        "",
        "| check | verdict | measured | threshold |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {c.name} | {'pass' if c.passed else '**FAIL**'} | {c.measured} | {c.threshold} |"
        for c in s.checks
    ]
    lines += [
        "",
        "## Faults",
        "",
        "| t (s) | fault | workers | detail | detected (s) | recovered (s) | steady tok/s | "
        "steady TTFT p99 (s) | requests touched | of them ok | lasted (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {f.at_s:.1f} | {f.kind} | {' '.join(f.workers) or 'all'} | {f.detail} | "
        f"{_s(f.detect_s)} | {_s(f.recovery_s)} | {f.steady_tokens_per_s:.0f} | "
        f"{_s(f.steady_ttft_p99)} | {f.touched} | {f.touched_ok} | {_s(f.lasted_s)} |"
        for f in s.faults
    ]
    counts = ", ".join(f"{k} {v}" for k, v in sorted(s.counts.items()))
    lines += [
        "",
        "## Requests",
        "",
        counts,
        "",
        f"Stranded KV: {s.stranded['attempts']:.0f} attempts, "
        f"{s.stranded['block_seconds']:.1f} block-seconds, "
        f"{s.stranded['per_block_s']:.2f} s per block, worst {s.stranded['worst_s']:.2f} s.",
        f"Largest client dispatch delay: {s.max_dispatch_delay_s * 1000:.0f} ms "
        "(latencies are taken from each request's scheduled send).",
        "",
        "![timeline](timeline.png)",
    ]
    if s.sabotage:
        lines += [
            "",
            "## Self-test: the sabotage planted",
            "",
            "| kind | worker | attempt | caught | how |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| {p['kind']} | {p['worker']} | {p['attempt']} | "
            f"{'yes' if p['caught'] else '**MISSED**'} | {p['how']} |"
            for p in s.sabotage
        ]
    if s.failures:
        lines += ["", "## First failures", ""]
        lines += [f"- `{json.dumps(f, default=str)}`" for f in s.failures[:20]]
    return "\n".join(lines) + "\n"


def plot(s: Summary, path: Path) -> None:
    """Tokens/s (each second and a 5 s mean), TTFT p50/p99 and errors per second; each fault a
    dashed line labelled with its detection and recovery times."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [b.t for b in s.timeline]
    rate = [b.tokens_per_s for b in s.timeline]
    mean = [
        sum(rate[max(0, i - 4) : i + 1]) / len(rate[max(0, i - 4) : i + 1])
        for i in range(len(rate))
    ]
    fig, (a, b, c) = plt.subplots(3, 1, figsize=(11, 7.5), sharex=True)
    a.plot(t, rate, color="tab:blue", alpha=0.35, label="each second")
    a.plot(t, mean, color="tab:blue", label="5 s mean")
    a.set_ylabel("tokens/s")
    a.legend(loc="upper right", fontsize=8)
    b.plot(t, [x.ttft_p50 for x in s.timeline], ".", label="p50", color="tab:green")
    b.plot(t, [x.ttft_p99 for x in s.timeline], ".", label="p99", color="tab:red")
    b.set_ylabel("TTFT (s)")
    b.legend(loc="upper right", fontsize=8)
    c.bar(t, [x.errors for x in s.timeline], width=0.9, color="tab:red")
    c.set_ylim(0, max(1, *(x.errors for x in s.timeline)))
    c.set_ylabel("errors/s")
    c.set_xlabel("seconds from the first request")
    top = max(rate, default=1.0) or 1.0
    for f in s.faults:
        for ax in (a, b, c):
            ax.axvline(f.at_s, color="black", linestyle="--", linewidth=0.8)
        label = f"{f.kind} {' '.join(f.workers)}\ndetected {_s(f.detect_s)} s, back {_s(f.recovery_s)} s"
        a.annotate(label, (f.at_s, top), rotation=90, fontsize=7, va="top", ha="right")
    fig.suptitle(f"chaos run {s.plan}: {'PASS' if s.verdict else 'FAIL'}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
