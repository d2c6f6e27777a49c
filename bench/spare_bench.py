"""What spare threads buy a few-row decode step (docs/design.md#spare-threads): the engine on one
thread, as a served worker computes, with and without helpers on the idle core.

    .venv/bin/python -m bench.spare_bench [--model small] [--batches 1 4] [--rounds 2]

One engine at a time in this process (``num_threads: 1``), bf16 and int8 weights, ``--batches``
sequences decoding (128-token prompts, greedy); each decode step's ``LLMEngine.step()`` is
timed, the median over ``--steps`` steps. ``spare_threads`` 0 and 1 take turns A B B A per round.
Needs an otherwise idle machine: a helper only ever gets a core nobody else wants. Prints a
table, writes ``bench/results/spare_bench.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.machine import abba, cpu_name
from engine import kernels
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.sampling_params import SamplingParams
from tandem.demo import ensure_demo_model, ensure_smollm2

RESULTS = Path(__file__).resolve().parent / "results"
WEIGHTS = ("bf16", "int8")


def measure(model: Path, weights: str, spare: int, batch: int, steps: int) -> float:
    """Median milliseconds of ``steps`` decode steps of ``batch`` sequences."""
    config = EngineConfig(
        dtype="bfloat16",
        quantization="int8" if weights == "int8" else "none",
        spare_threads=spare,
        num_threads=1,
        kv_cache_bytes=2**28,
        max_num_seqs=batch,
    )
    torch.set_num_threads(1)  # as a served worker's engine thread (AsyncLLMEngine) computes
    engine = LLMEngine.from_checkpoint(model, config)
    params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(
            engine.make_request([(13 * i + j) % 4000 + 5 for j in range(128)], params)
        )
    engine.step()  # the prompts and the first tokens
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    labels, width = [], 0.38
    cases = [(w, b) for w in WEIGHTS for b in result["batches"]]
    for i, spare in enumerate((0, 1)):
        med = [statistics.median(result["runs"][f"{w}/b{b}/spare{spare}"]) for w, b in cases]
        ax.bar(
            [x + i * width for x in range(len(cases))], med, width, label=f"spare_threads {spare}"
        )
    labels = [f"{w}, batch {b}" for w, b in cases]
    ax.set_xticks([x + width / 2 for x in range(len(cases))], labels)
    ax.set_ylabel("ms per decode step (one engine thread)")
    ax.set_title(f"{result['model']} ({result['cpu']})", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="small", help="a demo size, or smollm2")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    if kernels.load("spare_threads") is None:
        print("the native kernels do not build here: nothing to measure", file=sys.stderr)
        return 1
    path = ensure_smollm2() if a.model == "smollm2" else ensure_demo_model(a.model)
    runs: dict[str, list[float]] = {}
    for rnd in range(a.rounds):
        for weights in WEIGHTS:
            for batch in a.batches:
                for spare in abba([0, 1], rnd):
                    key = f"{weights}/b{batch}/spare{spare}"
                    runs.setdefault(key, []).append(measure(path, weights, spare, batch, a.steps))
                    print(f"[spare] {key}: {runs[key][-1]:.2f} ms", file=sys.stderr, flush=True)
    kernels.set_spare_threads(0)
    result = {"cpu": cpu_name(), "model": a.model, "batches": a.batches, "runs": runs}
    print(f"CPU: {result['cpu']}; {a.model}, one engine thread, medians of {a.steps} steps")
    print(f"{'weights':<8}{'batch':>6}{'spare 0 ms':>12}{'spare 1 ms':>12}{'speedup':>9}  runs")
    for weights in WEIGHTS:
        for batch in a.batches:
            off, on = (runs[f"{weights}/b{batch}/spare{s}"] for s in (0, 1))
            print(
                f"{weights:<8}{batch:>6}{statistics.median(off):>12.2f}"
                f"{statistics.median(on):>12.2f}"
                f"{statistics.median(off) / statistics.median(on):>8.2f}x  "
                + " ".join(f"{x:.2f}" for x in off)
                + " | "
                + " ".join(f"{x:.2f}" for x in on)
            )
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "spare_bench.json").write_text(json.dumps(result, indent=2))
    plot(result, RESULTS / "spare_bench.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
