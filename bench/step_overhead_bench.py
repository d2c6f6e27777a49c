"""The engine step's own cost beside its forward (issue 28 point 5): scheduling, sampling, stop
checks and output building for a batch of decoding sequences.

    .venv/bin/python -m bench.step_overhead_bench [--model tiny] [--batch 64] [--steps 40]

One engine in this process, ``--batch`` sequences (32-token prompts) decoding; each step's
``LLMEngine.step()`` is timed, and the model's forward timed apart: the difference is the step's
own cost -- input building, scheduling, sampling, stop checks, outputs. Three kinds of
request: greedy; sampled (temperature 0.8, top_p 0.95, seeded); sampled with 5 logprobs. Medians
over ``--steps`` steps, each kind run twice (A B C C B A). Prints a table, writes
``bench/results/step_overhead_bench.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench.machine import abba, cpu_name
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.sampling_params import SamplingParams
from tandem.demo import ensure_demo_model, ensure_smollm2

RESULTS = Path(__file__).resolve().parent / "results"
KINDS: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0},
    "top_p": {"temperature": 0.8, "top_p": 0.95, "seed": 1},
    "top_p+logprobs": {"temperature": 0.8, "top_p": 0.95, "seed": 1, "logprobs": 5},
}


def measure(model: Path, kind: str, batch: int, steps: int) -> dict[str, float]:
    """Median step, forward and outside-the-forward milliseconds of ``steps`` decode steps."""
    config = EngineConfig(kv_cache_bytes=2**28, max_num_seqs=batch, max_num_batched_tokens=4096)
    e = LLMEngine.from_checkpoint(model, config)
    forward: list[float] = []
    decoder = e.runner.model
    run = decoder.forward

    def timed(*args: Any) -> Any:
        t0 = time.perf_counter()
        logits = run(*args)
        forward.append(time.perf_counter() - t0)
        return logits

    decoder.forward = timed  # type: ignore[method-assign,assignment]
    params = SamplingParams(max_tokens=steps + 8, ignore_eos=True, **KINDS[kind])
    for i in range(batch):
        e.add_request(e.make_request([(7 * i + j) % 400 + 5 for j in range(32)], params))
    e.step()  # the prompts and the first tokens
    step_ms, forward_ms = [], []
    for _ in range(steps):
        forward.clear()
        t0 = time.perf_counter()
        e.step()
        step_ms.append((time.perf_counter() - t0) * 1e3)
        forward_ms.append(sum(forward) * 1e3)
    return {
        "step_ms": statistics.median(step_ms),
        "forward_ms": statistics.median(forward_ms),
        "outside_ms": statistics.median(s - f for s, f in zip(step_ms, forward_ms, strict=True)),
    }


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    names = list(result["runs"])
    forward = [statistics.median(r["forward_ms"] for r in result["runs"][k]) for k in names]
    outside = [statistics.median(r["outside_ms"] for r in result["runs"][k]) for k in names]
    ax.bar(names, forward, label="the model's forward")
    ax.bar(names, outside, bottom=forward, label="outside the forward")
    ax.set_ylabel("ms per decode step")
    ax.set_title(
        f"{result['model']}, {result['batch']} sequences decoding ({result['cpu']})", fontsize=9
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="tiny", help="a demo size, or smollm2")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--kinds", nargs="+", choices=list(KINDS), default=list(KINDS))
    a = ap.parse_args()
    path = ensure_smollm2() if a.model == "smollm2" else ensure_demo_model(a.model)
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in a.kinds}
    for kind in abba(a.kinds, 0):
        runs[kind].append(measure(path, kind, a.batch, a.steps))
        print(f"[step-overhead] {kind}: {runs[kind][-1]}", file=sys.stderr, flush=True)
    result = {"cpu": cpu_name(), "model": a.model, "batch": a.batch, "runs": runs}
    print(f"CPU: {result['cpu']}; {a.model}, {a.batch} sequences decoding, medians of {a.steps}")
    print(f"{'kind':<16}{'step ms':>9}{'forward ms':>12}{'outside ms':>12}  runs (outside)")
    for kind, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        print(
            f"{kind:<16}{med['step_ms']:>9.2f}{med['forward_ms']:>12.2f}{med['outside_ms']:>12.2f}"
            "  " + " ".join(f"{r['outside_ms']:.2f}" for r in rs)
        )
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "step_overhead_bench.json").write_text(json.dumps(result, indent=2))
    plot(result, RESULTS / "step_overhead_bench.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
