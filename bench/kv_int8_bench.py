"""The int8 KV cache (``kv_cache_dtype: int8``) against the model's dtype: capacity, quality and
speed (issue 28 point 2).

    .venv/bin/python -m bench.kv_int8_bench [--models smollm2 small] [--rounds 2]

**Capacity**, per model: the tokens a 256 MiB cache holds (the runner's blocks), and, measured,
the most sequences of 1024 prompt + 64 output tokens that run at once when 64 arrive together.

**Quality** (SmolLM2-135M-Instruct): the held-out text ``bench/data/heldout.txt`` scored
teacher-forced in one prefill (every query reads the cache, so every position sees int8 keys and
values), bf16 weights with an int8 cache and int8 weights with an int8 cache, each against bf16
with a bf16 cache: top-1 agreement and perplexity.

**Speed**, per model: the median decode step at batch 1, 8 and 32 with 1024 tokens of context
(a 1 GiB cache, room for all of them in either dtype); and output tokens/s of 64 x (256 -> 256)
requests (greedy, ignore_eos) in a 64 MiB cache, where the batch is what the cache holds; the
model's dtype and int8 interleaved A B B A per round. Prints a table, writes ``bench/results/kv_int8_bench.json``
and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import math
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
HELDOUT = Path(__file__).resolve().parent / "data" / "heldout.txt"
KINDS = ("auto", "int8")
CACHE_BYTES = 2**28  # the capacity and quality runs
STEP_CACHE_BYTES = 2**30  # the decode-step runs: every sequence fits in either dtype
TIGHT_CACHE_BYTES = 2**26  # the throughput run: the cache bounds the batch
CONTEXT = 1024


def log(msg: str) -> None:
    print(f"[kv-int8 {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def engine(model: Path, kv: str, **kw: Any) -> LLMEngine:
    base: dict[str, Any] = {
        "dtype": "bfloat16",
        "kv_cache_bytes": CACHE_BYTES,
        "max_num_seqs": 64,
        "max_num_batched_tokens": 2048,
    }
    return LLMEngine.from_checkpoint(model, EngineConfig(**{**base, **kw, "kv_cache_dtype": kv}))


def prompts(n: int, length: int) -> list[list[int]]:
    return [[(13 * i + 7 * j) % 400 + 5 for j in range(length)] for i in range(n)]


def capacity(model: Path, kv: str) -> dict[str, int]:
    """Tokens the cache holds, and the most requests of 1024 + 64 tokens running at once."""
    e = engine(model, kv, max_num_batched_tokens=8192)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    for p in prompts(64, CONTEXT):
        e.add_request(e.make_request(p, params))
    most = 0
    while e.has_unfinished():
        e.step()
        most = max(most, e.scheduler.num_running)
    e.finished_outputs()
    runner = e.runner
    return {
        "cache_bytes": runner.kv_cache.nbytes,
        "tokens": runner.num_blocks * runner.block_size,
        "bytes_per_token": runner.kv_layout.bytes_per_token,
        "most_running": most,
    }


def scored(model: Path, kv: str, quantization: str = "none") -> tuple[list[int], list[float]]:
    """Each held-out position's most likely token and the actual token's logprob."""
    e = engine(model, kv, quantization=quantization)
    tokens = e.tokenizer.encode(HELDOUT.read_text())
    [[out]] = e.generate([tokens], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1))
    assert out.prompt_logprobs is not None
    entries = [lp for lp in out.prompt_logprobs if lp is not None]
    return [lp.top[0][0] for lp in entries], [lp.logprob for lp in entries]


def quality(model: Path) -> dict[str, Any]:
    top_b, lp_b = scored(model, "auto")
    ppl_b = math.exp(-statistics.fmean(lp_b))
    out: dict[str, Any] = {"positions": len(top_b), "perplexity_bf16": ppl_b}
    for name, quantization in (("kv_int8", "none"), ("weights_and_kv_int8", "int8")):
        top, lp = scored(model, "int8", quantization)
        ppl = math.exp(-statistics.fmean(lp))
        out[name] = {
            "top1_agreement": sum(a == b for a, b in zip(top_b, top, strict=True)) / len(top_b),
            "perplexity": ppl,
            "perplexity_change": ppl / ppl_b - 1,
        }
    return out


def decode_step_ms(e: LLMEngine, batch: int, steps: int = 10) -> float:
    """The median decode step with ``batch`` sequences of CONTEXT tokens running."""
    params = SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True)
    for p in prompts(batch, CONTEXT):
        e.add_request(e.make_request(p, params))
    started: set[str] = set()
    while len(started) < batch:  # every prompt prefilled: each has its first token
        started |= {d.request_id for d in e.step() if d.token_ids}
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        e.step()
        times.append((time.perf_counter() - t0) * 1e3)
    while e.has_unfinished():
        e.step()
    e.finished_outputs()
    return statistics.median(times)


def throughput(e: LLMEngine) -> float:
    """Output tokens/s of 64 x (256 -> 256), greedy, ignore_eos."""
    params = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True)
    t0 = time.perf_counter()
    outs = e.generate(prompts(64, 256), params)
    return sum(len(o[0].token_ids) for o in outs) / (time.perf_counter() - t0)


def speed(model: Path, rounds: int) -> dict[str, dict[str, list[float]]]:
    runs: dict[str, dict[str, list[float]]] = {
        k: {"step_1": [], "step_8": [], "step_32": [], "tok_s": []} for k in KINDS
    }
    for r in range(rounds):
        for kv in abba(KINDS, r):
            e = engine(model, kv, kv_cache_bytes=STEP_CACHE_BYTES)
            for batch in (1, 8, 32):
                runs[kv][f"step_{batch}"].append(decode_step_ms(e, batch))
            tight = engine(model, kv, kv_cache_bytes=TIGHT_CACHE_BYTES)
            runs[kv]["tok_s"].append(throughput(tight))
            log(
                f"{model.name} round {r} {kv}: "
                + ", ".join(f"{k} {v[-1]:.1f}" for k, v in runs[kv].items())
            )
    return runs


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["speed"])
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, key, label in (
        (axes[0], "step_32", "decode step, batch 32, 1024 ctx (ms)"),
        (axes[1], "tok_s", "output tok/s, 64 x (256 -> 256), 64 MiB cache"),
    ):
        for i, kv in enumerate(KINDS):
            values = [statistics.median(result["speed"][m][kv][key]) for m in names]
            ax.bar(
                [x + 0.4 * i for x in range(len(names))],
                values,
                width=0.4,
                label="bf16 cache" if kv == "auto" else "int8 cache",
            )
        ax.set_xticks([x + 0.2 for x in range(len(names))], names)
        ax.set_title(f"{label} ({result['cpu']})", fontsize=9)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["smollm2", "small"])
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    paths = {m: ensure_smollm2() if m == "smollm2" else ensure_demo_model(m) for m in a.models}
    result: dict[str, Any] = {"cpu": cpu_name(), "capacity": {}, "speed": {}}
    for name, path in paths.items():
        result["capacity"][name] = {kv: capacity(path, kv) for kv in KINDS}
        log(f"{name} capacity: {result['capacity'][name]}")
    result["quality"] = quality(ensure_smollm2())
    for name, path in paths.items():
        result["speed"][name] = speed(path, a.rounds)
    print(f"CPU: {result['cpu']}")
    q = result["quality"]
    for name in ("kv_int8", "weights_and_kv_int8"):
        print(
            f"quality (SmolLM2, {q['positions']} held-out positions) {name}: top-1 agreement with "
            f"bf16 {q[name]['top1_agreement']:.2%}, perplexity {q['perplexity_bf16']:.3f} -> "
            f"{q[name]['perplexity']:.3f} ({q[name]['perplexity_change']:+.2%})"
        )
    print(f"{'model':<9}{'cache':<6}{'B/token':>8}{'tokens in 256 MiB':>19}{'most running':>14}")
    for name, caps in result["capacity"].items():
        for kv, c in caps.items():
            print(
                f"{name:<9}{'bf16' if kv == 'auto' else kv:<6}{c['bytes_per_token']:>8}"
                f"{c['tokens']:>19}{c['most_running']:>14}"
            )
    print(
        f"{'model':<9}{'cache':<6}{'b1 ms':>7}{'b8 ms':>7}{'b32 ms':>8}{'tok/s':>8}  runs (tok/s)"
    )
    for name, runs in result["speed"].items():
        for kv in KINDS:
            med = {k: statistics.median(v) for k, v in runs[kv].items()}
            print(
                f"{name:<9}{'bf16' if kv == 'auto' else kv:<6}{med['step_1']:>7.1f}"
                f"{med['step_8']:>7.1f}{med['step_32']:>8.1f}{med['tok_s']:>8.1f}  "
                + " ".join(f"{v:.0f}" for v in runs[kv]["tok_s"])
            )
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "kv_int8_bench.json").write_text(json.dumps(result, indent=2))
    plot(result, RESULTS / "kv_int8_bench.png")
    log(f"wrote {RESULTS / 'kv_int8_bench.json'} and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
