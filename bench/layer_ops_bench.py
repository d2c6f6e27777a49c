"""What the layer_ops kernel buys (engine/csrc/layer_ops.cpp: RMSNorm after the residual add,
SiLU * up, RoPE and the K/V write in one pass each) against the same ops in PyTorch.

    .venv/bin/python -m bench.layer_ops_bench [--model small] [--batches 1 64] [--threads 1 2]
        [--weights bf16 int8] [--rounds 2] [--steps 40]

One engine at a time in this process, ``--batches`` sequences decoding (128-token prompts,
greedy); each decode step's ``LLMEngine.step()`` timed, the median over ``--steps`` steps. The
kernel on and off (``engine.kernels.layer_ops`` answering None: engine/model.py's PyTorch path)
take turns A B B A per round. ``--threads 1`` is how a served worker computes, 2 the offline
engine on both cores. Prints a table of every run, writes ``bench/results/layer_ops_bench.json``
and ``.png``.
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
SIDES = ("torch", "kernel")


def measure(model: Path, weights: str, batch: int, threads: int, steps: int) -> float:
    """Median milliseconds of ``steps`` decode steps of ``batch`` sequences."""
    config = EngineConfig(
        quantization="int8" if weights == "int8" else "none",
        num_threads=threads,
        spare_threads=0,
        kv_cache_bytes=2**28,
        max_num_seqs=batch,
    )
    torch.set_num_threads(threads)
    engine = LLMEngine.from_checkpoint(model, config)
    warmup = -(-batch * 128 // config.max_num_batched_tokens) + 2  # the prompts, first tokens
    params = SamplingParams(max_tokens=warmup + steps + 8, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(
            engine.make_request([(13 * i + j) % 4000 + 5 for j in range(128)], params)
        )
    for _ in range(warmup):
        engine.step()
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

    fig, ax = plt.subplots(figsize=(8, 4))
    cases = list(result["cases"])
    width = 0.38
    for i, side in enumerate(SIDES):
        med = [statistics.median(result["runs"][f"{c}/{side}"]) for c in cases]
        ax.bar([x + i * width for x in range(len(cases))], med, width, label=side)
    ax.set_xticks([x + width / 2 for x in range(len(cases))], cases, fontsize=7, rotation=20)
    ax.set_ylabel("ms per decode step")
    ax.set_title(
        f"{result['model']}: layer ops in PyTorch vs the kernel ({result['cpu']})", fontsize=9
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="small", help="a demo size, or smollm2")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--weights", nargs="+", choices=("bf16", "int8"), default=["bf16", "int8"])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    if kernels.load("layer_ops") is None:
        print("the native kernels do not build here: nothing to measure", file=sys.stderr)
        return 1
    path = ensure_smollm2() if a.model == "smollm2" else ensure_demo_model(a.model)
    served = kernels.layer_ops
    cases = [f"{w}/b{b}/t{t}" for w in a.weights for b in a.batches for t in a.threads]
    runs: dict[str, list[float]] = {}
    for rnd in range(a.rounds):
        for w in a.weights:
            for b in a.batches:
                for t in a.threads:
                    for side in abba(SIDES, rnd):
                        kernels.layer_ops = served if side == "kernel" else lambda x: None  # type: ignore[assignment]
                        ms = measure(path, w, b, t, a.steps)
                        runs.setdefault(f"{w}/b{b}/t{t}/{side}", []).append(ms)
                        print(
                            f"[layer_ops] {w}/b{b}/t{t}/{side}: {ms:.2f} ms",
                            file=sys.stderr,
                            flush=True,
                        )
    kernels.layer_ops = served  # type: ignore[assignment]
    result = {"cpu": cpu_name(), "model": a.model, "cases": cases, "runs": runs}
    print(f"CPU: {result['cpu']}; {a.model}, decode step medians of {a.steps} steps")
    print(f"{'weights/batch/threads':<22}{'torch ms':>10}{'kernel ms':>11}{'speedup':>9}  runs")
    for c in cases:
        off, on = runs[f"{c}/torch"], runs[f"{c}/kernel"]
        print(
            f"{c:<22}{statistics.median(off):>10.2f}{statistics.median(on):>11.2f}"
            f"{statistics.median(off) / statistics.median(on):>8.2f}x  "
            + " ".join(f"{x:.2f}" for x in off)
            + " | "
            + " ".join(f"{x:.2f}" for x in on)
        )
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "layer_ops_bench.json").write_text(json.dumps(result, indent=2))
    plot(result, RESULTS / "layer_ops_bench.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
