"""int8 weights (W8A8, ``quantization: int8``) against bf16 in one engine: quality and speed
(issue 28 point 1).

    .venv/bin/python -m bench.int8_bench [--models smollm2 small] [--rounds 2] [--requests 64]

**Quality** (SmolLM2-135M-Instruct, the real model ``tandem serve`` serves): the held-out text
``bench/data/heldout.txt`` scored teacher-forced in one prefill (prompt logprobs), by a bf16 and
an int8 engine: top-1 agreement (the share of positions where both engines' most likely next
token is the same) and the text's perplexity. The gate: agreement >= 98%, perplexity within
+1.5% of bf16's. Printed beside it: an fp32 engine's agreement with the same bf16 one (how much
of the disagreement any change of numerics gives this model).

**Speed**, per model: the median decode step at batch 1, 8 and 64, and output tokens/s of
``--requests`` x 128 prompt -> 128 output tokens (greedy, ignore_eos, continuous batching);
bf16 and int8 interleaved A B B A per round.

**The GEMM alone** (``--gemm-rows``): ``kernels.int8_linear`` on every path this CPU runs against
the bf16 invariant GEMM, on one layer's shapes of ``small`` (768 -> 1280, 768 -> 768, 768 ->
4096, 2048 -> 768), summed; the median of repeated calls on one and on two threads (the weights
warm in cache: a decode step streams them from memory, so the step figures above are the ones
that count at few rows). Prints the tables, writes ``bench/results/int8_bench.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
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
from engine.quantization import quantize_rows
from engine.sampling_params import SamplingParams
from tandem.demo import ensure_demo_model, ensure_smollm2

RESULTS = Path(__file__).resolve().parent / "results"
HELDOUT = Path(__file__).resolve().parent / "data" / "heldout.txt"
KINDS = ("none", "int8")
AGREEMENT_GATE = 0.98
PERPLEXITY_GATE = 0.015


def log(msg: str) -> None:
    print(f"[int8 {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def engine(model: Path, quantization: str, dtype: str = "bfloat16") -> LLMEngine:
    config = EngineConfig(
        dtype=dtype,  # type: ignore[arg-type]
        quantization=quantization,  # type: ignore[arg-type]
        kv_cache_bytes=2**29,
        max_num_seqs=64,
        max_num_batched_tokens=2048,
    )
    return LLMEngine.from_checkpoint(model, config)


def scored(
    model: Path, quantization: str, dtype: str = "bfloat16"
) -> tuple[list[int], list[float]]:
    """Each held-out position's most likely token and the actual token's logprob."""
    e = engine(model, quantization, dtype)
    tokens = e.tokenizer.encode(HELDOUT.read_text())
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    [[out]] = e.generate([tokens], params)
    assert out.prompt_logprobs is not None
    entries = [lp for lp in out.prompt_logprobs if lp is not None]
    return [lp.top[0][0] for lp in entries], [lp.logprob for lp in entries]


def quality(model: Path) -> dict[str, Any]:
    (top_b, lp_b), (top_q, lp_q) = scored(model, "none"), scored(model, "int8")
    top_f, _ = scored(model, "none", "float32")  # the floor: bf16 itself against fp32
    agree = sum(a == b for a, b in zip(top_b, top_q, strict=True)) / len(top_b)
    floor = sum(a == b for a, b in zip(top_b, top_f, strict=True)) / len(top_b)
    ppl_b, ppl_q = (math.exp(-statistics.fmean(lp)) for lp in (lp_b, lp_q))
    return {
        "positions": len(top_b),
        "top1_agreement": agree,
        "top1_agreement_fp32_vs_bf16": floor,
        "perplexity_bf16": ppl_b,
        "perplexity_int8": ppl_q,
        "perplexity_change": ppl_q / ppl_b - 1,
        "passed": agree >= AGREEMENT_GATE and ppl_q / ppl_b - 1 <= PERPLEXITY_GATE,
        "nll_bf16": [-x for x in lp_b],
        "nll_int8": [-x for x in lp_q],
    }


def decode_step_ms(e: LLMEngine, batch: int, steps: int = 12) -> float:
    """The median decode step with ``batch`` sequences running (their prompts prefilled)."""
    params = SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True)
    for i in range(batch):
        e.add_request(e.make_request([(7 * i + j) % 400 + 5 for j in range(32)], params))
    e.step()  # every prompt (64 x 32 tokens fit one step's budget) and the first tokens
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        e.step()
        times.append((time.perf_counter() - t0) * 1e3)
    while e.has_unfinished():
        e.step()
    e.finished_outputs()
    return statistics.median(times)


def throughput(e: LLMEngine, requests: int) -> float:
    """Output tokens/s of ``requests`` x 128 -> 128 (greedy, ignore_eos)."""
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    prompts = [[(13 * i + j) % 400 + 5 for j in range(128)] for i in range(requests)]
    t0 = time.perf_counter()
    outs = e.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    return sum(len(o[0].token_ids) for o in outs) / elapsed


def speed(model: Path, rounds: int, requests: int) -> dict[str, dict[str, list[float]]]:
    runs: dict[str, dict[str, list[float]]] = {
        q: {"step_1": [], "step_8": [], "step_64": [], "tok_s": []} for q in KINDS
    }
    for r in range(rounds):
        for q in abba(KINDS, r):
            e = engine(model, q)
            for batch in (1, 8, 64):
                runs[q][f"step_{batch}"].append(decode_step_ms(e, batch))
            runs[q]["tok_s"].append(throughput(e, requests))
            log(
                f"{model.name} round {r} {q}: "
                + ", ".join(f"{k} {v[-1]:.1f}" for k, v in runs[q].items())
            )
    return runs


GEMM_SHAPES = ((768, 1280), (768, 768), (768, 4096), (2048, 768))  # (K, N): small's layer


def gemm(rows: list[int]) -> dict[str, dict[str, list[float]]]:
    """ms per layer's GEMMs by path ("bf16": the invariant GEMM) -> threads -> one per row count."""
    layout = kernels.invariant_layouts()[0]
    paths = kernels.int8_paths()
    out: dict[str, dict[str, list[float]]] = {p: {} for p in [*paths, "bf16"]}
    torch.manual_seed(0)
    weights = []
    for k, n in GEMM_SHAPES:
        w = torch.randn(n, k)
        q_w, s_w = quantize_rows(w)
        weights.append(
            (k, n, *kernels.pack_int8(q_w), s_w, kernels.pack_linear(w.bfloat16(), layout))
        )
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for path in out:
                times = []
                for m in rows:
                    total = 0.0
                    for k, n, packed, sums, s_w, pb in weights:
                        x = torch.randn(m, k).bfloat16()
                        if path == "bf16":
                            call = functools.partial(
                                kernels.invariant_linear, x, pb, n, None, layout
                            )
                        else:
                            call = functools.partial(
                                kernels.int8_linear, x, packed, sums, s_w, n, None, path
                            )
                        total += timed(call, 30 if m <= 8 else 10)
                    times.append(total)
                out[path][str(threads)] = times
                log(f"gemm {path} threads {threads}: " + ", ".join(f"{t:.3f}" for t in times))
    finally:
        torch.set_num_threads(before)
    return out


def timed(call: Any, reps: int) -> float:
    """Median ms of ``reps`` calls after one warm-up."""
    call()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        call()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    q = result["quality"]
    left.plot(q["nll_bf16"], lw=0.8, label="bf16")
    left.plot(q["nll_int8"], lw=0.8, label="int8", alpha=0.8)
    left.set_title(
        f"SmolLM2 held-out NLL per token: top-1 agree {q['top1_agreement']:.1%}, "
        f"ppl {q['perplexity_change']:+.2%}",
        fontsize=9,
    )
    left.set_xlabel("position")
    left.legend()
    names = list(result["speed"])
    for i, q_kind in enumerate(KINDS):
        values = [statistics.median(result["speed"][m][q_kind]["tok_s"]) for m in names]
        label = "bf16" if q_kind == "none" else q_kind
        right.bar([x + 0.4 * i for x in range(len(names))], values, width=0.4, label=label)
    right.set_xticks([x + 0.2 for x in range(len(names))], names)
    right.set_ylabel("output tok/s")
    right.set_title(f"throughput, median of ABBA runs ({result['cpu']})", fontsize=9)
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def print_gemm(g: dict[str, Any]) -> None:
    if not g["ms"]:
        return
    print("GEMM alone, one layer of small, ms (warm weights):")
    print(f"{'path':<9}{'threads':>8}" + "".join(f"{f'{m} rows':>10}" for m in g["rows"]))
    for path, by_threads in g["ms"].items():
        for threads, times in by_threads.items():
            print(f"{path:<9}{threads:>8}" + "".join(f"{t:>10.3f}" for t in times))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["smollm2", "small"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--gemm-rows", type=int, nargs="*", default=[1, 8, 64])
    a = ap.parse_args()
    paths = {m: ensure_smollm2() if m == "smollm2" else ensure_demo_model(m) for m in a.models}
    result: dict[str, Any] = {"cpu": cpu_name(), "quality": quality(ensure_smollm2()), "speed": {}}
    for name, path in paths.items():
        result["speed"][name] = speed(path, a.rounds, a.requests)
    result["gemm"] = {"rows": a.gemm_rows, "ms": gemm(a.gemm_rows) if a.gemm_rows else {}}
    q = result["quality"]
    print(f"CPU: {result['cpu']}")
    print(
        f"quality (SmolLM2, {q['positions']} held-out positions): top-1 agreement "
        f"{q['top1_agreement']:.2%} (gate {AGREEMENT_GATE:.0%}; fp32 against the same bf16: "
        f"{q['top1_agreement_fp32_vs_bf16']:.2%}), perplexity bf16 "
        f"{q['perplexity_bf16']:.3f} int8 {q['perplexity_int8']:.3f} ({q['perplexity_change']:+.2%}, "
        f"gate +{PERPLEXITY_GATE:.1%}): {'PASS' if q['passed'] else 'FAIL'}"
    )
    print(
        f"{'model':<9}{'weights':<8}{'step b1 ms':>11}{'b8 ms':>8}{'b64 ms':>8}{'tok/s':>8}  runs"
    )
    for name, runs in result["speed"].items():
        for kind in KINDS:
            r = runs[kind]
            med = {k: statistics.median(v) for k, v in r.items()}
            print(
                f"{name:<9}{'bf16' if kind == 'none' else kind:<8}{med['step_1']:>11.1f}"
                f"{med['step_8']:>8.1f}{med['step_64']:>8.1f}{med['tok_s']:>8.1f}  "
                + " ".join(f"{v:.0f}" for v in r["tok_s"])
            )
    print_gemm(result["gemm"])
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "int8_bench.json").write_text(json.dumps(result, indent=2))
    plot(result, RESULTS / "int8_bench.png")
    log(f"wrote {RESULTS / 'int8_bench.json'} and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
