"""What spare threads buy a few-row decode step (docs/design.md#spare-threads): the engine on one
thread, as a served worker computes, with and without helpers on the idle core.

    .venv/bin/python -m bench.spare_bench [--model small] [--batches 1 4] [--rounds 2]
        [--processes 1] [--weights bf16 int8] [--prefill]

One engine at a time in this process (``num_threads: 1``), bf16 and int8 weights, ``--batches``
sequences decoding (128-token prompts, greedy); each decode step's ``LLMEngine.step()`` is
timed, the median over ``--steps`` steps. ``--prefill`` times the prompts' step instead (a lone
prompt's first token: TTFT's compute), the median over ``--steps`` fresh batches of prompts. ``spare_threads`` 0 and 1 take turns A B B A per round.
Needs an otherwise idle machine: a helper only ever gets a core nobody else wants.

``--processes N`` measures a busy machine instead: N processes run the same measurement at once
(as N workers on N cores), the figure is their mean; the engines share at every batch size here
(the engine's own limit, ``SPARE_MAX_REQUESTS``, is lifted) to see what sharing costs when no
core is idle. (In one process that limit holds: past it the engine computes alone.)

Prints a table, writes ``bench/results/spare_bench.json`` and ``.png`` (``spare_bench_busy.*``
with ``--processes``).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.machine import abba, cpu_name
from engine import kernels, model_runner
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.sampling_params import SamplingParams
from tandem.demo import ensure_demo_model, ensure_smollm2

RESULTS = Path(__file__).resolve().parent / "results"
WEIGHTS = ("bf16", "int8")


def measure(
    model: Path,
    weights: str,
    spare: int,
    batch: int,
    steps: int,
    ready: Callable[[], object] = lambda: None,
    prefill: bool = False,
) -> float:
    """Median milliseconds of ``steps`` decode steps of ``batch`` sequences (``ready()`` before
    the first timed one); ``prefill``: of the steps that compute ``steps`` batches of prompts."""
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
    params = SamplingParams(max_tokens=1 if prefill else steps + 8, temperature=0, ignore_eos=True)

    def add_prompts(n: int) -> None:  # each batch its own prompts: no prefix hit
        for i in range(batch):
            prompt = [(13 * i + 7 * n + j) % 4000 + 5 for j in range(128)]
            engine.add_request(engine.make_request(prompt, params))

    add_prompts(0)
    engine.step()  # the prompts and the first tokens
    ready()
    times = []
    for n in range(1, steps + 1):
        if prefill:
            add_prompts(n)
        t0 = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _measure_in_child(args: tuple[Path, str, int, int, int], start: Any, out: Any) -> None:
    model_runner.SPARE_MAX_REQUESTS = sys.maxsize  # share at every batch size
    out.put(measure(*args, ready=start.wait))


def measure_busy(model: Path, weights: str, spare: int, batch: int, steps: int, n: int) -> float:
    """Mean over ``n`` processes measuring at once of :func:`measure`."""
    ctx = multiprocessing.get_context("spawn")
    start, out = ctx.Barrier(n), ctx.Queue()
    procs = [
        ctx.Process(
            target=_measure_in_child, args=((model, weights, spare, batch, steps), start, out)
        )
        for _ in range(n)
    ]
    for proc in procs:
        proc.start()
    results = [out.get(timeout=600) for _ in procs]
    for proc in procs:
        proc.join()
    return statistics.mean(results)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    labels, width = [], 0.38
    cases = [(w, b) for w in result["weights"] for b in result["batches"]]
    for i, spare in enumerate((0, 1)):
        med = [statistics.median(result["runs"][f"{w}/b{b}/spare{spare}"]) for w, b in cases]
        ax.bar(
            [x + i * width for x in range(len(cases))], med, width, label=f"spare_threads {spare}"
        )
    labels = [f"{w}, batch {b}" for w, b in cases]
    ax.set_xticks([x + width / 2 for x in range(len(cases))], labels)
    ax.set_ylabel(f"ms per {result['phase']} step (one engine thread)")
    ax.set_title(
        f"{result['model']}, {result['processes']} process(es) ({result['cpu']})", fontsize=9
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="small", help="a demo size, or smollm2")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--processes", type=int, default=1, help="> 1: that many at once (busy)")
    ap.add_argument("--weights", nargs="+", choices=WEIGHTS, default=list(WEIGHTS))
    ap.add_argument("--prefill", action="store_true", help="time the prompts' step instead")
    a = ap.parse_args()
    if a.prefill and a.processes > 1:
        ap.error("--prefill measures one process")
    if kernels.load("spare_threads") is None:
        print("the native kernels do not build here: nothing to measure", file=sys.stderr)
        return 1
    path = ensure_smollm2() if a.model == "smollm2" else ensure_demo_model(a.model)
    runs: dict[str, list[float]] = {}
    for rnd in range(a.rounds):
        for weights in a.weights:
            for batch in a.batches:
                for spare in abba([0, 1], rnd):
                    key = f"{weights}/b{batch}/spare{spare}"
                    case = (path, weights, spare, batch, a.steps)
                    if a.processes > 1:
                        ms = measure_busy(*case, a.processes)
                    else:
                        ms = measure(*case, prefill=a.prefill)
                    runs.setdefault(key, []).append(ms)
                    print(f"[spare] {key}: {ms:.2f} ms", file=sys.stderr, flush=True)
    kernels.set_spare_threads(0)
    result = {
        "cpu": cpu_name(),
        "model": a.model,
        "batches": a.batches,
        "weights": a.weights,
        "processes": a.processes,
        "phase": "prefill" if a.prefill else "decode",
        "runs": runs,
    }
    who = f"{a.processes} processes at once (their mean)" if a.processes > 1 else "one process"
    print(
        f"CPU: {result['cpu']}; {a.model}, one engine thread each, {who}, medians of {a.steps} "
        f"{result['phase']} steps"
    )
    print(f"{'weights':<8}{'batch':>6}{'spare 0 ms':>12}{'spare 1 ms':>12}{'speedup':>9}  runs")
    for weights in a.weights:
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
    stem = "spare_bench_busy" if a.processes > 1 else "spare_bench"
    stem += "_prefill" if a.prefill else ""
    (RESULTS / f"{stem}.json").write_text(json.dumps(result, indent=2))
    plot(result, RESULTS / f"{stem}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
