"""Engine benchmark (issue: engine core): Tandem vs transformers ``generate`` side by side.

Workload per model (bf16): N requests x P prompt tokens -> O output tokens, greedy, ignore_eos.
Prints a table, writes JSON and a PNG plot under ``bench/results/``.

    .venv/bin/python -m bench.engine_bench [--sizes small tiny] [--requests 64]

Figures: output tokens/s of Tandem (continuous batching over all N requests) vs transformers
at batch N (left padded) and at batch 1 (median of 3 interleaved runs each), with the bf16
checkpoint as is and upcast to fp32 (the fair baseline where this CPU has no native bf16 GEMM);
decode step time at batch 1/32/64 against this machine's roofline (weight bytes / measured copy
bandwidth, FLOPs / measured matmul rate of the GEMM dtype the engine runs: bf16 where native,
else fp32 -- see engine/model.py ``Linear``); cold start of ``tandem generate`` (process start
to first token).
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

import torch

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.model import default_linear_mode
from engine.sampling_params import SamplingParams

RESULTS = Path(__file__).resolve().parent / "results"
SINGLE_REPS = 3  # batch-1 runs per side (medians compared)


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def ensure_model(size: str) -> Path:
    from tandem.demo import ensure_demo_model

    return ensure_demo_model(size)


def prompts_for(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # Ids from the middle of the vocabulary: no special tokens at the front.
    return [torch.randint(16, vocab, (length,), generator=g).tolist() for _ in range(n)]


def tandem_throughput(engine: LLMEngine, prompts: list[list[int]], out_len: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    t0 = time.perf_counter()
    results = engine.generate(prompts, params)
    dt = time.perf_counter() - t0
    n = sum(len(c.token_ids) for r in results for c in r)
    assert n == len(prompts) * out_len, n
    return n / dt


def hf_throughput(model, prompts: list[list[int]], out_len: int, pad_id: int) -> float:
    batch = len(prompts)
    length = max(len(p) for p in prompts)
    ids = torch.full((batch, length), pad_id, dtype=torch.long)
    mask = torch.zeros((batch, length), dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding
        ids[i, length - len(p) :] = torch.tensor(p)
        mask[i, length - len(p) :] = 1
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=out_len,
            min_new_tokens=out_len,
            do_sample=False,
            pad_token_id=pad_id,
        )
    dt = time.perf_counter() - t0
    return (out.shape[1] - length) * batch / dt


def decode_step_time(
    engine: LLMEngine, batch: int, ctx: int, vocab: int, steps: int = 32
) -> tuple[float, float]:
    """Median and best wall time of a pure-decode step with `batch` sequences at context ~ctx
    (the best shows the step without this shared machine's interference; the median is judged)."""
    prompts = prompts_for(batch, ctx, vocab, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True)
    for p in prompts:
        engine.add_request(engine.make_request(p, params))
    # Run until every sequence is decoding (all prefills done), then time decode steps.
    while any(
        s.request.num_computed_tokens < s.request.num_prompt_tokens for s in engine._seqs.values()
    ):
        engine.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    while engine.has_unfinished():
        engine.step()
    engine.finished_outputs()
    return sorted(times)[len(times) // 2], min(times)


def _matmul_rate(dtype: torch.dtype) -> float:
    a = torch.randn(2048, 2048, dtype=dtype)
    b = torch.randn(2048, 2048, dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * 2048**3 / best


def machine_rates() -> dict[str, float]:
    """Measured copy bandwidth (bytes/s) and bf16 / fp32 matmul rates (FLOP/s) of this machine."""
    x = torch.empty(256 * 2**20, dtype=torch.uint8)
    x.fill_(1)
    y = torch.empty_like(x)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        y.copy_(x)
        best = min(best, time.perf_counter() - t0)
    return {
        "copy_bytes_per_s": 2 * x.numel() / best,  # read + write
        "bf16_flops_per_s": _matmul_rate(torch.bfloat16) if native_bf16_gemm() else 0.0,
        "fp32_flops_per_s": _matmul_rate(torch.float32),
    }


def native_bf16_gemm() -> bool:
    """Whether bf16 GEMMs run natively here (else emulated ~10x slower than fp32, and Tandem
    runs its bf16 GEMMs in fp32: engine/model.py ``Linear``). An emulated 2048^3 bf16 matmul
    takes minutes, so it is only timed where native."""
    return default_linear_mode(torch.zeros(1, dtype=torch.bfloat16)) == "packed"


def gemm_path(engine: LLMEngine) -> str:
    """The Linear mode the engine runs (engine/model.py), with the invariant kernel's layout."""
    head = engine.runner.model.lm_head
    if head.mode != "invariant":
        return head.mode
    return f"invariant ({head.layout})"


def roofline_step(engine: LLMEngine, batch: int, ctx: int, rates: dict[str, float]) -> float:
    """Lower bound of a decode step: max(bytes moved / bandwidth, FLOPs / matmul rate), for the
    GEMM path the engine takes here (bf16 weights natively, or fp32 weights where bf16 GEMMs
    would be emulated). A few-row step on the emulated path is bandwidth-bound (bf16 bytes)."""
    mc = engine.model_config
    h, q, kv = (
        mc.hidden_size,
        mc.num_attention_heads * mc.head_dim,
        mc.num_key_value_heads * mc.head_dim,
    )
    # Weights a decode step reads: every layer's projections and MLP, plus the LM head.
    params = mc.num_hidden_layers * (h * (q + 2 * kv) + q * h + 3 * h * mc.intermediate_size)
    params += mc.vocab_size * h
    # Rows up to few_rows read the bf16 weight (the native skinny kernel, or torch's emulation).
    few_rows = engine.runner.model.lm_head.few_rows
    widened = mc.dtype == torch.bfloat16 and not native_bf16_gemm() and batch > few_rows
    weight_bytes = params * (4 if widened else torch.tensor([], dtype=mc.dtype).element_size())
    key = "fp32_flops_per_s" if widened or mc.dtype == torch.float32 else "bf16_flops_per_s"
    rate = rates[key] or rates["fp32_flops_per_s"]  # emulated bf16 (untimed): bandwidth-bound
    kv_bytes = batch * ctx * mc.kv_bytes_per_token()
    flops = (
        2 * params * batch
        + 4 * batch * ctx * mc.num_hidden_layers * mc.num_attention_heads * mc.head_dim
    )
    return max((weight_bytes + kv_bytes) / rates["copy_bytes_per_s"], flops / rate)


def cold_start(model: Path) -> float:
    """Seconds from launching `tandem generate` to its first token (from its --json output)."""
    exe = Path(sys.executable).with_name("tandem")
    t0 = time.time()
    out = subprocess.run(
        [
            str(exe),
            "generate",
            "--model",
            str(model),
            "--prompt",
            "Hello there",
            "--max-tokens",
            "4",
            "--json",
        ],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "TANDEM_T0": repr(t0)},
    )
    data = json.loads(out.stdout)
    return float(data["first_token_at"]) - t0


def bench_size(size: str, n: int, plen: int, olen: int, rates: dict[str, float]) -> dict:
    from transformers import AutoModelForCausalLM

    model_dir = ensure_model(size)
    log(f"{size}: loading Tandem engine")
    engine = LLMEngine.from_checkpoint(
        model_dir,
        EngineConfig(
            dtype="bfloat16",
            kv_cache_bytes=1024 * 2**20,
            max_num_seqs=n,
            max_num_batched_tokens=4096,
        ),
    )
    vocab = engine.model_config.vocab_size
    # Distinct prompt sets, so no run gets prefix-cache hits from an earlier one.
    prompts = prompts_for(n, plen, vocab)
    # Single-stream runs are short and this machine is noisy: several, each a fresh prompt
    # (no cache hit), Tandem and transformers interleaved, medians compared.
    singles = [prompts_for(1, plen, vocab, seed=20 + r) for r in range(SINGLE_REPS)]
    tandem_throughput(engine, prompts_for(4, plen, vocab, seed=3), 4)  # warm-up
    log(f"{size}: Tandem batch {n}")
    t_batch = tandem_throughput(engine, prompts, olen)
    log(f"{size}: transformers")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    pad = min(engine.tokenizer.eos_token_ids, default=0)
    hf_throughput(hf, prompts[:2], 4, pad)  # warm-up
    h_batch = hf_throughput(hf, prompts, olen, pad)
    log(f"{size}: batch 1, Tandem and transformers interleaved, {SINGLE_REPS} runs each")
    t_ones, h_ones = [], []
    for single in singles:
        t_ones.append(tandem_throughput(engine, single, olen))
        h_ones.append(hf_throughput(hf, single, olen, pad))
    t_one, h_one = statistics.median(t_ones), statistics.median(h_ones)
    log(f"{size}: transformers, fp32 weights")
    hf = hf.float()
    hf_throughput(hf, prompts[:2], 4, pad)
    h32_batch = hf_throughput(hf, prompts, olen, pad)
    h32_one = statistics.median(hf_throughput(hf, single, olen, pad) for single in singles)
    del hf
    steps = {}
    for b in (1, 32, 64):
        log(f"{size}: decode step at batch {b}")
        measured, best = decode_step_time(engine, b, plen + olen // 2, vocab)
        bound = roofline_step(engine, b, plen + olen // 2, rates)
        steps[b] = {
            "step_s": measured,
            "best_step_s": best,
            "roofline_s": bound,
            "ratio": measured / bound,
            "best_ratio": best / bound,
        }
    return {
        "size": size,
        "tandem_tok_s_batch": t_batch,
        "hf_tok_s_batch": h_batch,
        "speedup_batch": t_batch / h_batch,
        "tandem_tok_s_1": t_one,
        "hf_tok_s_1": h_one,
        "speedup_1": t_one / h_one,
        "tandem_tok_s_1_runs": t_ones,
        "hf_tok_s_1_runs": h_ones,
        "hf_fp32_tok_s_batch": h32_batch,
        "hf_fp32_tok_s_1": h32_one,
        "speedup_batch_vs_fp32": t_batch / h32_batch,
        "speedup_1_vs_fp32": t_one / h32_one,
        "gemm_path": gemm_path(engine),
        "skinny_kernel": engine.runner.model.lm_head.skinny,
        "decode_steps": steps,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", nargs="+", default=["small", "tiny"])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--no-cold-start", action="store_true")
    a = ap.parse_args()
    rates = machine_rates()
    log(
        f"copy {rates['copy_bytes_per_s'] / 1e9:.1f} GB/s, matmul bf16 "
        f"{rates['bf16_flops_per_s'] / 1e9:.0f} GFLOP/s (0 = emulated, not timed), "
        f"fp32 {rates['fp32_flops_per_s'] / 1e9:.0f} GFLOP/s"
    )
    rows = [bench_size(s, a.requests, a.prompt_len, a.output_len, rates) for s in a.sizes]
    result: dict = {"machine": rates, "workload": vars(a), "models": rows}
    if not a.no_cold_start and "small" in a.sizes:
        log("cold start of `tandem generate` on small")
        result["cold_start_small_s"] = cold_start(ensure_model("small"))
    print(f"\nGEMM path for bf16 here: {rows[0]['gemm_path']} (engine/model.py Linear)")
    print(
        f"\n{'model':<6} {'tandem tok/s':>13} {'hf bf16':>8} {'x':>6} {'hf fp32':>8} {'x':>6} | "
        f"{'tandem b1':>9} {'hf bf16':>8} {'x':>6} {'hf fp32':>8} {'x':>6}"
    )
    for r in rows:
        print(
            f"{r['size']:<6} {r['tandem_tok_s_batch']:>13.1f} {r['hf_tok_s_batch']:>8.1f} "
            f"{r['speedup_batch']:>6.2f} {r['hf_fp32_tok_s_batch']:>8.1f} "
            f"{r['speedup_batch_vs_fp32']:>6.2f} | {r['tandem_tok_s_1']:>9.1f} "
            f"{r['hf_tok_s_1']:>8.1f} {r['speedup_1']:>6.2f} {r['hf_fp32_tok_s_1']:>8.1f} "
            f"{r['speedup_1_vs_fp32']:>6.2f}"
        )
    print(
        f"\n{'model':<6} {'batch':>5} {'step ms':>8} {'best ms':>8} {'roofline ms':>12} "
        f"{'ratio':>6} {'best':>6}  (step: median of 32)"
    )
    for r in rows:
        for b, s in r["decode_steps"].items():
            print(
                f"{r['size']:<6} {b:>5} {s['step_s'] * 1e3:>8.2f} {s['best_step_s'] * 1e3:>8.2f} "
                f"{s['roofline_s'] * 1e3:>12.2f} {s['ratio']:>6.2f} {s['best_ratio']:>6.2f}"
            )
    if "cold_start_small_s" in result:
        print(f"\ncold start (tandem generate, small): {result['cold_start_small_s']:.2f} s")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "engine_bench.json").write_text(json.dumps(result, indent=2))
    plot(rows, RESULTS / "engine_bench.png")
    log(f"wrote {RESULTS / 'engine_bench.json'} and engine_bench.png")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    labels = [r["size"] for r in rows]
    xs = range(len(rows))
    bars = [("tandem_tok_s_batch", "Tandem"), ("hf_tok_s_batch", "transformers bf16")]
    bars.append(("hf_fp32_tok_s_batch", "transformers fp32"))
    for i, (key, label) in enumerate(bars):
        ax[0].bar([x + (i - 1) * 0.27 for x in xs], [r[key] for r in rows], 0.27, label=label)
    ax[0].set_xticks(list(xs), labels)
    ax[0].set_ylabel("output tokens/s (batch)")
    ax[0].legend()
    for r in rows:
        bs = list(r["decode_steps"])
        ax[1].plot(bs, [r["decode_steps"][b]["ratio"] for b in bs], marker="o", label=r["size"])
    ax[1].axhline(2.0, ls="--", c="grey")
    ax[1].set_xlabel("decode batch")
    ax[1].set_ylabel("step time / roofline")
    ax[1].legend()
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    main()
