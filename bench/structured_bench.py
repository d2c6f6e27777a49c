"""What structured outputs cost (issue 27): the engine's decode step with constrained rows, on the
real model (SmolLM2-135M-Instruct, bf16, its 49,152-token vocabulary).

    .venv/bin/python -m bench.structured_bench [--batches 1,64] [--steps 16] [--rounds 2]

Per batch size, one engine, four workloads of the same chat prompt, every row decoding:
**free** (no grammar), **json** (a 20-field JSON schema), **regex** (``[a-z]{256}``) and
**mixed** (half free, half json). Each round runs them in ABBA order (free, json, regex, mixed,
then reversed: a shared machine drifts); the figure is the median decode step time over
``--steps`` steps of every round, once the whole batch decodes. Also the grammar's compile time,
cold and cached, and one mask's time. Prints a table, writes
``bench/results/structured_bench.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from bench.machine import cpu_name
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.sampling_params import Constraint, SamplingParams
from engine.structured import compile_grammar, token_bitmask
from tandem.demo import ensure_smollm2

RESULTS = Path(__file__).resolve().parent / "results"
SCHEMA = {
    "type": "object",
    "properties": {
        f"field_{i}": [
            {"type": "string", "maxLength": 24},
            {"type": "integer"},
            {"enum": ["red", "green", "blue"]},
            {"type": "boolean"},
        ][i % 4]
        for i in range(20)
    },
    "required": [f"field_{i}" for i in range(20)],
    "additionalProperties": False,
}
JSON = Constraint("json_schema", json.dumps(SCHEMA))
REGEX = Constraint("regex", "[a-z]{256}")
WORKLOADS = ("free", "json", "regex", "mixed")


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def params_for(workload: str, n: int, tokens: int) -> list[SamplingParams]:
    """One row's parameters each: greedy, long enough that no row ends while timed."""
    free = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    bound = {"json": JSON, "regex": REGEX}
    if workload == "mixed":
        return [
            free if i % 2 else SamplingParams(temperature=0.0, max_tokens=tokens, constraint=JSON)
            for i in range(n)
        ]
    if workload == "free":
        return [free] * n
    return [SamplingParams(temperature=0.0, max_tokens=tokens, constraint=bound[workload])] * n


def step_times(
    engine: LLMEngine, prompt: list[int], params: list[SamplingParams], steps: int
) -> list[float]:
    """Decode step times (s) once every row decodes (its first token out: the prefills run
    first, untimed); then every row aborted."""
    rids = [engine.add_request(engine.make_request(prompt, p)) for p in params]
    started: set[str] = set()
    while len(started) < len(rids):
        started |= {d.request_id for d in engine.step()}
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    for rid in rids:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    return times


def compile_times() -> dict[str, float]:
    """The 20-field schema's compile, cold (no cache) and cached (an engine's LRU), and one
    mask of a fresh matcher (ms)."""
    t0 = time.perf_counter()
    compile_grammar(JSON)
    cold = time.perf_counter() - t0
    return {"compile_cold_ms": cold * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 64])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    model = ensure_smollm2()
    out: dict[str, Any] = {"args": vars(args), "cpu": cpu_name(), "rows": []}
    out |= compile_times()
    for n in args.batches:
        engine = LLMEngine.from_checkpoint(
            model, EngineConfig(kv_cache_bytes=2**28, max_num_seqs=max(n, 1))
        )
        prompt = engine.tokenizer.encode_chat(
            [{"role": "user", "content": "Describe a thing as JSON."}]
        )
        t0 = time.perf_counter()
        state = engine.grammars.state(JSON)
        out.setdefault("compile_cached_ms", None)
        t1 = time.perf_counter()
        engine.grammars.compile(JSON)
        out["compile_cached_ms"] = (time.perf_counter() - t1) * 1e3
        out["matcher_ms"] = (t1 - t0) * 1e3
        t0 = time.perf_counter()
        token_bitmask([state], engine.model_config.vocab_size)
        out["first_mask_ms"] = (time.perf_counter() - t0) * 1e3
        step_times(engine, prompt, params_for("free", n, 64), 2)  # warm-up
        by: dict[str, list[float]] = {w: [] for w in WORKLOADS}
        for r in range(args.rounds):
            order = WORKLOADS if r % 2 == 0 else WORKLOADS[::-1]
            for w in order:
                log(f"batch {n}, round {r + 1}: {w}")
                by[w] += step_times(engine, prompt, params_for(w, n, 4 * args.steps), args.steps)
        free = statistics.median(by["free"])
        for w in WORKLOADS:
            med = statistics.median(by[w])
            out["rows"].append(
                {
                    "batch": n,
                    "workload": w,
                    "step_ms": med * 1e3,
                    "added": med / free - 1.0,
                    "runs": [t * 1e3 for t in by[w]],
                }
            )
    print(f"\nCPU: {out['cpu']}; SmolLM2-135M-Instruct bf16; llguidance")
    print(
        f"compile of the 20-field schema: cold {out['compile_cold_ms']:.2f} ms, cached {out['compile_cached_ms']:.4f} ms; matcher {out['matcher_ms']:.2f} ms; first mask {out['first_mask_ms']:.2f} ms"
    )
    print(f"{'batch':>5} {'workload':<8} {'step ms':>8} {'vs free':>8}")
    for row in out["rows"]:
        print(
            f"{row['batch']:>5} {row['workload']:<8} {row['step_ms']:>8.2f} {row['added'] * 100:>+7.1f}%"
        )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "structured_bench.json").write_text(json.dumps(out, indent=2))
    plot(out["rows"], RESULTS / "structured_bench.png")


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(4.5 * len(batches), 3.6), squeeze=False)
    for ax, n in zip(axes[0], batches, strict=True):
        mine = [r for r in rows if r["batch"] == n]
        ax.bar([r["workload"] for r in mine], [r["step_ms"] for r in mine])
        ax.set_title(f"decode step, batch {n} (ms)")
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    main()
