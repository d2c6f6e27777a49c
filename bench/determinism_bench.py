"""Deterministic serving (issue 16): what the batch-invariant path costs, and what it buys.

    .venv/bin/python -m bench.determinism_bench [--sizes small tiny] [--rounds 2]
        [--distinct-sizes small] [--runs 100] [--out determinism_bench]

Cost: the engine bench's workload (64 requests x 128 prompt tokens -> 128 output tokens, greedy,
bf16) on two engines in one process -- ``deterministic: true`` (the invariant GEMM and every
query through the paged attention kernel) and ``false`` (the fastest path this machine has:
oneDNN's packed bf16 GEMM, or fp32-widened GEMMs plus the skinny kernel, and SDPA prefill) --
run ABBA: output tok/s at batch 64 and at batch 1, prefill tok/s (one 2048-token prompt set),
decode step time at batch 1 / 32 / 64 (median of 32 steps). Benefit: distinct outputs (tokens
and logprobs) of one target request over ``--runs`` runs under random load (1-24 other
requests of random lengths arriving at random steps), greedy and seeded, on each path.
Writes a table, ``bench/results/determinism_bench.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from bench.engine_bench import (
    RESULTS,
    decode_step_time,
    ensure_model,
    log,
    prompts_for,
    tandem_throughput,
)
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.sampling_params import SamplingParams

PATHS = {"invariant": True, "fastest": False}


def engine(model: Path, deterministic: bool, n: int) -> LLMEngine:
    return LLMEngine.from_checkpoint(
        model,
        EngineConfig(
            dtype="bfloat16",
            kv_cache_bytes=1024 * 2**20,
            max_num_seqs=n,
            max_num_batched_tokens=2048,
            enable_prefix_caching=False,  # repeated runs must compute, not hit
            deterministic=deterministic,
        ),
    )


def prefill_rate(eng: LLMEngine, vocab: int, seed: int) -> float:
    """Prompt tokens per second of 64 x 128-token prompts producing one token each."""
    prompts = prompts_for(64, 128, vocab, seed=seed)
    t0 = time.perf_counter()
    eng.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    return 64 * 128 / (time.perf_counter() - t0)


def cost(model: Path, n: int, plen: int, olen: int, rounds: int) -> dict[str, dict[str, Any]]:
    """Every figure of both paths, measured ABBA ``rounds`` times (figures: means of runs)."""
    engines = {name: engine(model, det, n) for name, det in PATHS.items()}
    vocab = engines["invariant"].model_config.vocab_size
    for eng in engines.values():
        tandem_throughput(eng, prompts_for(4, plen, vocab, seed=3), 4)  # warm-up
    runs: dict[str, dict[str, list[float]]] = {name: {} for name in PATHS}
    order = ["invariant", "fastest", "fastest", "invariant"] * rounds
    for rep, name in enumerate(order):
        eng, out = engines[name], runs[name]
        log(f"{model.name}: {name} (pass {rep + 1}/{len(order)})")
        out.setdefault("tok_s_batch", []).append(
            tandem_throughput(eng, prompts_for(n, plen, vocab, seed=10 + rep), olen)
        )
        out.setdefault("tok_s_1", []).append(
            tandem_throughput(eng, prompts_for(1, plen, vocab, seed=20 + rep), olen)
        )
        out.setdefault("prefill_tok_s", []).append(prefill_rate(eng, vocab, seed=30 + rep))
        for b in (1, 32, 64):
            step, _ = decode_step_time(eng, b, plen + olen // 2, vocab, steps=16)
            out.setdefault(f"step_ms_{b}", []).append(step * 1e3)
    return {
        name: {k: statistics.mean(v) for k, v in figures.items()} | {"runs": figures}
        for name, figures in runs.items()
    }


def distinct_outputs(model: Path, deterministic: bool, runs: int) -> dict[str, int]:
    """Distinct (tokens, logprobs) of one target over 1 run alone + ``runs`` under load."""
    eng = engine(model, deterministic, 64)
    target = prompts_for(1, 60, eng.model_config.vocab_size, seed=99)[0]
    result = {}
    for name, params in {
        "greedy": SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=1),
        "seeded": SamplingParams(
            temperature=0.8, top_p=0.95, seed=7, max_tokens=32, ignore_eos=True, logprobs=1
        ),
    }.items():
        rng = random.Random(0)
        [[alone]] = eng.generate([target], params)
        outputs = {_key(alone)}
        for _ in range(runs):
            others = [
                prompts_for(
                    1, rng.randrange(4, 200), eng.model_config.vocab_size, rng.randrange(2**30)
                )[0]
                for _ in range(rng.randrange(1, 25))
            ]
            start_at, step, tid = rng.randrange(0, 6), 0, None
            while others or eng.has_unfinished() or tid is None:
                if step == start_at:
                    tid = eng.add_request(eng.make_request(target, params))
                if others and rng.random() < 0.5:
                    other = SamplingParams(max_tokens=rng.randrange(4, 64), ignore_eos=True)
                    eng.add_request(eng.make_request(others.pop(), other))
                eng.step()
                step += 1
            done = {o.request_id: o for o in eng.finished_outputs()}
            outputs.add(_key(done[tid]))
        result[name] = len(outputs)
    return result


def _key(out) -> tuple:  # type: ignore[no-untyped-def]
    return tuple(out.token_ids), tuple(lp.logprob for lp in out.logprobs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", nargs="*", default=["small", "tiny"], help="cost: these models")
    ap.add_argument("--rounds", type=int, default=2, help="ABBA rounds of the cost figures")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--runs", type=int, default=100, help="runs under load per distinct count")
    ap.add_argument("--distinct-sizes", nargs="*", default=["small"])
    ap.add_argument("--out", default="determinism_bench", help="results file name (no suffix)")
    a = ap.parse_args()
    torch.manual_seed(0)
    result: dict = {"workload": vars(a), "cost": {}, "distinct": {}}
    for size in a.sizes:
        result["cost"][size] = cost(
            ensure_model(size), a.requests, a.prompt_len, a.output_len, a.rounds
        )
    for size in a.distinct_sizes:
        result["distinct"][size] = {}
        for name, det in PATHS.items():
            log(f"{size}: distinct outputs, {name}, {a.runs} runs under load")
            result["distinct"][size][name] = distinct_outputs(ensure_model(size), det, a.runs)
    figures = ["tok_s_batch", "tok_s_1", "prefill_tok_s", "step_ms_1", "step_ms_32", "step_ms_64"]
    print(f"\n{'model':<6} {'figure':<14} {'invariant':>10} {'fastest':>10} {'cost %':>8}")
    for size, paths in result["cost"].items():
        for f in figures:
            inv, fast = paths["invariant"][f], paths["fastest"][f]
            # Cost: how much slower the invariant path is (rates: lower; step times: higher).
            pct = (1 - inv / fast) * 100 if "tok_s" in f else (inv / fast - 1) * 100
            paths.setdefault("cost_pct", {})[f] = pct
            print(f"{size:<6} {f:<14} {inv:>10.2f} {fast:>10.2f} {pct:>8.1f}")
    print(f"\ndistinct outputs of one request over 1 alone + {a.runs} runs under random load")
    for size, paths in result["distinct"].items():
        for name, counts in paths.items():
            print(
                f"{size:<6} {name:<10} greedy {counts['greedy']:>3}  seeded {counts['seeded']:>3}"
            )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{a.out}.json").write_text(json.dumps(result, indent=2))
    plot(result, RESULTS / f"{a.out}.png")
    log(f"wrote {RESULTS / a.out}.json and .png")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(result["cost"])
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    if not sizes:
        axes[0].set_visible(False)
    labels = ["tok_s_batch", "tok_s_1", "prefill_tok_s"]
    width = 0.8 / max(len(sizes), 1)
    for i, size in enumerate(sizes):
        pct = [result["cost"][size]["cost_pct"][f] for f in labels]
        axes[0].bar([x + i * width for x in range(len(labels))], pct, width, label=size)
    axes[0].set_xticks([x + width * (len(sizes) - 1) / 2 for x in range(len(labels))], labels)
    axes[0].axhline(5, color="red", linestyle="--", label="5% target")
    axes[0].set_ylabel("invariant path cost, % of the fastest path")
    axes[0].legend()
    rows = [(s, n, c) for s, paths in result["distinct"].items() for n, c in paths.items()]
    if not rows:
        axes[1].set_visible(False)
    names = [f"{s}/{n}" for s, n, _ in rows]
    axes[1].bar(
        [x - 0.2 for x in range(len(rows))], [c["greedy"] for *_, c in rows], 0.4, label="greedy"
    )
    axes[1].bar(
        [x + 0.2 for x in range(len(rows))], [c["seeded"] for *_, c in rows], 0.4, label="seeded"
    )
    axes[1].set_xticks(range(len(rows)), names)
    axes[1].set_ylabel("distinct outputs of one request")
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
