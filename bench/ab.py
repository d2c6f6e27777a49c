"""Run one benchmark on two source trees in ABBA order and compare chosen figures side by side.

    .venv/bin/python -m bench.ab --a /path/to/old-checkout --b . --rounds 2 \\
        --metric models.0.tandem_tok_s_batch -- bench.engine_bench --sizes small --no-cold-start

Each run is ``python -m <bench> <args>`` with the tree as working directory and first on
``PYTHONPATH`` (so Ray workers the benchmark starts import that tree too); the figures are read
from the JSON the benchmark writes under ``<tree>/bench/results/``. A shared machine drifts, so
runs alternate A B B A (per round); every run is printed, then each metric's per-side median
and B / A. Writes ``bench/results/ab.json`` and ``ab.png`` in this tree.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def pick(doc: Any, path: str) -> float:
    """``doc``'s value at a dotted path (list indices are numbers)."""
    for part in path.split("."):
        doc = doc[int(part)] if isinstance(doc, list) else doc[part]
    return float(doc)


def run_once(tree: Path, bench: str, args: list[str]) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    started = time.time()
    subprocess.run([sys.executable, "-m", bench, *args], cwd=tree, env=env, check=True)
    name = bench.rpartition(".")[2]
    out = tree / "bench" / "results" / f"{name}.json"
    if out.stat().st_mtime < started:
        raise RuntimeError(f"{bench} in {tree} did not write {out}")
    return json.loads(out.read_text())  # type: ignore[no-any-return]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--a", type=Path, required=True, help="source tree A (e.g. the old main)")
    ap.add_argument("--b", type=Path, required=True, help="source tree B (e.g. the change)")
    ap.add_argument("--rounds", type=int, default=2, help="ABBA rounds (each side twice each)")
    ap.add_argument("--metric", action="append", required=True, help="dotted path in the JSON")
    ap.add_argument("bench", nargs=argparse.REMAINDER, help="-- module [its args]")
    a = ap.parse_args()
    command = a.bench[1:] if a.bench and a.bench[0] == "--" else a.bench
    if not command:
        ap.error("give the benchmark after --, e.g. -- bench.engine_bench --sizes small")
    bench, args = command[0], command[1:]
    trees = {"A": a.a.resolve(), "B": a.b.resolve()}
    runs: list[dict[str, Any]] = []
    for rnd in range(a.rounds):
        for side in "ABBA":
            print(f"[ab] round {rnd + 1}: {side} = {trees[side]}", file=sys.stderr, flush=True)
            doc = run_once(trees[side], bench, args)
            runs.append({"side": side, "round": rnd + 1, **{m: pick(doc, m) for m in a.metric}})
    print(f"\n{'run':>4} {'side':>4}  " + "  ".join(f"{m:>28}" for m in a.metric))
    for i, r in enumerate(runs, 1):
        print(f"{i:>4} {r['side']:>4}  " + "  ".join(f"{r[m]:>28.4g}" for m in a.metric))
    summary = {}
    for m in a.metric:
        med = {s: statistics.median(r[m] for r in runs if r["side"] == s) for s in "AB"}
        summary[m] = {"median_a": med["A"], "median_b": med["B"], "b_over_a": med["B"] / med["A"]}
        print(f"{m}: median A {med['A']:.4g}, B {med['B']:.4g}, B/A {med['B'] / med['A']:.3f}")
    RESULTS.mkdir(exist_ok=True)
    doc = {"trees": {k: str(v) for k, v in trees.items()}, "command": command, "runs": runs}
    (RESULTS / "ab.json").write_text(json.dumps({**doc, "summary": summary}, indent=2))
    plot(runs, a.metric, RESULTS / "ab.png")


def plot(runs: list[dict[str, Any]], metrics: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(metrics), figsize=(4 * len(metrics), 3.5), squeeze=False)
    for ax, m in zip(axes[0], metrics, strict=True):
        for side, colour in (("A", "tab:blue"), ("B", "tab:orange")):
            xs = [i for i, r in enumerate(runs, 1) if r["side"] == side]
            ax.scatter(xs, [runs[i - 1][m] for i in xs], c=colour, label=side)
        ax.set_title(m, fontsize=8)
        ax.set_xlabel("run (ABBA order)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    main()
