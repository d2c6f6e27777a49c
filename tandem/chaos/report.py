"""A chaos run's report: ``report.json`` (everything), ``report.md`` (a verdict per check, a
table per fault), ``timeline.png`` (throughput, TTFT p50/p99 and errors per second, the faults
marked) and ``requests.jsonl`` (each request: what it came to, where it ran, what touched it)."""

from __future__ import annotations

import json
from pathlib import Path

from tandem.chaos.verdict import Summary


def write_report(summary: Summary, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    files = [out / "report.json", out / "report.md", out / "timeline.png", out / "requests.jsonl"]
    files[0].write_text(json.dumps(summary.as_dict(), indent=1, default=str))
    files[1].write_text(markdown(summary))
    plot(summary, files[2])
    files[3].write_text("".join(json.dumps(r, default=str) + "\n" for r in summary.requests))
    return files


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


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
        "steady TTFT p99 (s) | requests touched | of them ok |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {f.at_s:.1f} | {f.kind} | {' '.join(f.workers) or 'all'} | {f.detail} | "
        f"{_s(f.detect_s)} | {_s(f.recovery_s)} | {f.steady_tokens_per_s:.0f} | "
        f"{_s(f.steady_ttft_p99)} | {f.touched} | {f.touched_ok} |"
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
    if s.failures:
        lines += ["", "## First failures", ""]
        lines += [f"- `{json.dumps(f, default=str)}`" for f in s.failures[:20]]
    return "\n".join(lines) + "\n"


def plot(s: Summary, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [b.t for b in s.timeline]
    fig, (a, b, c) = plt.subplots(3, 1, figsize=(10, 7), sharex=True)
    a.plot(t, [b_.tokens_per_s for b_ in s.timeline], color="tab:blue")
    a.set_ylabel("tokens/s")
    b.plot(t, [b_.ttft_p50 for b_ in s.timeline], ".", label="p50", color="tab:green")
    b.plot(t, [b_.ttft_p99 for b_ in s.timeline], ".", label="p99", color="tab:red")
    b.set_ylabel("TTFT (s)")
    b.legend(loc="upper right")
    c.bar(t, [b_.errors for b_ in s.timeline], width=0.9, color="tab:red")
    c.set_ylabel("errors/s")
    c.set_xlabel("seconds from the first request")
    for f in s.faults:
        for ax in (a, b, c):
            ax.axvline(f.at_s, color="black", linestyle="--", linewidth=0.8)
        a.annotate(f.kind, (f.at_s, 0), rotation=90, fontsize=7, va="bottom")
    fig.suptitle(f"chaos run {s.plan}: {'PASS' if s.verdict else 'FAIL'}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
