"""The chaos report a person reads: the verdict, a row per check and per fault, the plot, and
one JSON line per request."""

from __future__ import annotations

import json
import math
from pathlib import Path

from chaos.report import write_report
from chaos.verdict import Bin, Check, FaultRow, Summary


def summary(verdict: bool) -> Summary:
    return Summary(
        plan="demo",
        verdict=verdict,
        checks=[
            Check("no request hung", True, "0 hung", "<= 0"),
            Check("outputs equal the reference", verdict, "1 mismatched", "<= 0"),
        ],
        faults=[
            FaultRow(
                "kill_worker", 10.0, ["decode-0"], "mid_decode", 0.04, 2.5, 120.0, 0.3, 4, 4, 3.25
            ),
            FaultRow("kill_router", 20.0, [], "", None, None, 110.0, math.nan, 9, 9),
        ],
        counts={"ok": 9, "requests": 10},
        stranded={"attempts": 1, "block_seconds": 0.5, "per_block_s": 0.05, "worst_s": 0.05},
        max_dispatch_delay_s=0.002,
        timeline=[
            Bin(float(i), 100.0 + i, 2, i % 3, 0.1, 0.2 if i % 2 else math.nan) for i in range(30)
        ],
        failures=[{"index": 3, "status": "error"}],
        requests=[{"index": i, "status": "ok"} for i in range(10)],
        health=[{"worker": "decode-0", "event": "failed", "why": "x", "at": 1.0, "t": 10.04}],
    )


def test_the_report_files_say_the_verdict_and_each_row(tmp_path: Path) -> None:
    files = write_report(summary(False), tmp_path / "out")
    assert [f.name for f in files] == ["report.json", "report.md", "timeline.png", "requests.jsonl"]
    doc = json.loads(files[0].read_text())
    assert doc["verdict"] is False and "requests" not in doc  # those are in requests.jsonl
    assert doc["faults"][0]["detect_s"] == 0.04 and doc["health"][0]["t"] == 10.04
    # A percentile of no samples (NaN) is null: the file stays JSON.
    assert doc["faults"][1]["steady_ttft_p99"] is None and doc["timeline"][0]["ttft_p99"] is None
    md = files[1].read_text()
    assert md.startswith("# Chaos run `demo`: FAIL\n")
    assert "| outputs equal the reference | **FAIL** | 1 mismatched | <= 0 |" in md
    assert "| no request hung | pass | 0 hung | <= 0 |" in md
    assert (
        "| 10.0 | kill_worker | decode-0 | mid_decode | 0.04 | 2.50 | 120 | 0.30 | 4 | 4 | 3.25 |"
        in md
    )
    assert "| 20.0 | kill_router | all |  | - | - | 110 | - | 9 | 9 | - |" in md
    assert "0.05 s per block" in md and '- `{"index": 3, "status": "error"}`' in md
    assert files[2].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = [json.loads(line) for line in files[3].read_text().splitlines()]
    assert rows == [{"index": i, "status": "ok"} for i in range(10)]
    assert (
        write_report(summary(True), tmp_path / "pass")[1]
        .read_text()
        .startswith("# Chaos run `demo`: PASS\n")
    )
