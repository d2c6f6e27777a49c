"""n-gram speculative decoding against none, in one engine (issue 28 point 3).

    .venv/bin/python -m bench.spec_bench [--rounds 2] [--requests 8] [--k 4]

SmolLM2-135M-Instruct (bf16, the model ``tandem serve`` serves), three tasks of ``--requests``
prompts each, every request to its own end (EOS or 256 tokens):

- ``code_edit``: a Python function and "rename this variable and show the result" -- the answer
  copies most of the prompt (greedy);
- ``quote``: a paragraph of ``bench/data/heldout.txt`` and "repeat it word for word" (greedy);
- ``random``: random token ids as the prompt, sampled at temperature 1 (seeded): nothing to copy,
  what speculation costs when its drafts are wrong. (Greedy, this model loops on such a prompt,
  and a loop is what n-gram drafts predict best.)

Each task runs at batch 1 (one request at a time) and batch 8 (all at once), speculation off and
on interleaved A B B A per round, one fresh engine per run. Speculation is exact, so both sides
generate the same tokens; the figure is output tokens / wall seconds. Prints every run, the
medians, the ratio and the acceptance (rate, mean acceptance length); writes
``bench/results/spec_bench.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench.machine import abba, cpu_name
from engine.config import EngineConfig, SpeculativeConfig
from engine.engine import LLMEngine
from engine.sampling_params import SamplingParams
from tandem.demo import ensure_smollm2

RESULTS = Path(__file__).resolve().parent / "results"
HELDOUT = Path(__file__).resolve().parent / "data" / "heldout.txt"
TASKS = ("code_edit", "quote", "random")
BATCHES = (1, 8)
SIDES = ("off", "on")

FUNCTIONS = [
    ("total", "amount", "def price(items, tax):\n    total = 0\n    for item in items:\n"
     "        total += item.price * item.count\n    return total * (1 + tax)\n"),
    ("result", "out", "def merge(a, b):\n    result = []\n    i = j = 0\n"
     "    while i < len(a) and j < len(b):\n        if a[i] <= b[j]:\n"
     "            result.append(a[i])\n            i += 1\n        else:\n"
     "            result.append(b[j])\n            j += 1\n    return result + a[i:] + b[j:]\n"),
    ("count", "n", "def words(text):\n    count = {}\n    for word in text.split():\n"
     "        count[word] = count.get(word, 0) + 1\n    return count\n"),
    ("value", "x", "def clamp(value, low, high):\n    if value < low:\n        return low\n"
     "    if value > high:\n        return high\n    return value\n"),
    ("line", "row", "def read_rows(path):\n    rows = []\n    with open(path) as f:\n"
     "        for line in f:\n            line = line.strip()\n            if line:\n"
     "                rows.append(line.split(','))\n    return rows\n"),
    ("node", "item", "def depth(node):\n    if node is None:\n        return 0\n"
     "    return 1 + max(depth(node.left), depth(node.right))\n"),
    ("key", "name", "def invert(mapping):\n    out = {}\n    for key, value in mapping.items():\n"
     "        out.setdefault(value, []).append(key)\n    return out\n"),
    ("step", "delta", "def ramp(start, stop, step):\n    values = []\n    while start < stop:\n"
     "        values.append(start)\n        start += step\n    return values\n"),
]  # fmt: skip


def log(msg: str) -> None:
    print(f"[spec {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def engine(model: Path, side: str, a: argparse.Namespace) -> LLMEngine:
    spec = SpeculativeConfig(k=a.k, min_n=a.min_n, max_n=a.max_n) if side == "on" else None
    config = EngineConfig(dtype="bfloat16", kv_cache_bytes=2**28, max_num_seqs=8, speculative=spec)
    return LLMEngine.from_checkpoint(model, config)


def prompts(e: LLMEngine, task: str, count: int) -> list[list[int]]:
    def chat(text: str) -> list[int]:
        return e.tokenizer.encode_chat([{"role": "user", "content": text}])

    if task == "code_edit":
        return [
            chat(
                f"Rename the variable `{old}` to `{new}` in this code and show the result:\n\n{code}"
            )
            for old, new, code in (FUNCTIONS * count)[:count]
        ]
    if task == "quote":
        paragraphs = [p.strip() for p in HELDOUT.read_text().split("\n\n") if len(p) > 200]
        return [
            chat(f"Repeat this text word for word:\n\n{p[:600]}")
            for p in (paragraphs * count)[:count]
        ]
    rng = random.Random(0)
    return [[rng.randrange(100, 40_000) for _ in range(200)] for _ in range(count)]


def run(
    e: LLMEngine, batch: list[list[int]], concurrency: int, task: str
) -> tuple[float, float, list[list[int]]]:
    """Output tokens/s of ``batch``, ``concurrency`` requests at a time (prefills included);
    the requests' median time per output token after the first (decoding alone); the ids."""
    greedy = task != "random"
    params = SamplingParams(temperature=0.0 if greedy else 1.0, seed=7, max_tokens=256)
    tokens: list[list[int]] = []
    tpots: list[float] = []
    t0 = time.perf_counter()
    for i in range(0, len(batch), concurrency):
        outs = [o for [o] in e.generate(batch[i : i + concurrency], params)]
        tokens += [o.token_ids for o in outs]
        tpots += [o.timing["tpot_s"] for o in outs if o.timing["tpot_s"] is not None]
    return sum(map(len, tokens)) / (time.perf_counter() - t0), statistics.median(tpots), tokens


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--k", type=int, default=SpeculativeConfig().k)
    ap.add_argument("--min-n", type=int, default=SpeculativeConfig().min_n)
    ap.add_argument("--max-n", type=int, default=SpeculativeConfig().max_n)
    a = ap.parse_args()
    model = ensure_smollm2()
    runs: dict[str, dict[str, list[float]]] = {}
    tpot_ms: dict[str, dict[str, list[float]]] = {}
    acceptance: dict[str, dict[str, float]] = {}
    for task in TASKS:
        for batch in BATCHES:
            cell = f"{task}/b{batch}"
            runs[cell] = {side: [] for side in SIDES}
            tpot_ms[cell] = {side: [] for side in SIDES}
            reference: list[list[int]] | None = None
            for r in range(a.rounds):
                for side in abba(SIDES, r):
                    e = engine(model, side, a)
                    tok_s, tpot, tokens = run(e, prompts(e, task, a.requests), batch, task)
                    if reference is None:
                        reference = tokens
                    assert tokens == reference, f"{cell} {side}: not the same tokens"
                    runs[cell][side].append(tok_s)
                    tpot_ms[cell][side].append(tpot * 1e3)
                    if side == "on":
                        s = e.speculation
                        acceptance[cell] = {
                            "drafted": s.num_drafted,
                            "accepted": s.num_accepted,
                            "acceptance_rate": s.acceptance_rate,
                            "mean_acceptance_length": s.mean_acceptance_length,
                        }
                    log(f"{cell} round {r} {side}: {tok_s:.1f} tok/s, TPOT {tpot * 1e3:.1f} ms")
    result: dict[str, Any] = {"cpu": cpu_name(), "k": a.k, "min_n": a.min_n, "max_n": a.max_n}
    result |= {"requests": a.requests, "runs": runs, "tpot_ms": tpot_ms, "acceptance": acceptance}
    report(result)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "spec_bench.json").write_text(json.dumps(result, indent=2))
    plot(result, RESULTS / "spec_bench.png")
    log(f"wrote {RESULTS / 'spec_bench.json'} and .png")
    return 0


def report(result: dict[str, Any]) -> None:
    """The table: per cell, the medians, on / off (throughput; TPOT: the decode alone), the
    acceptance, and every run."""
    print(
        f"CPU: {result['cpu']}; SmolLM2-135M bf16; k={result['k']}, "
        f"n={result['min_n']}..{result['max_n']}; {result['requests']} requests per cell"
    )
    print(
        f"{'cell':<14}{'tok/s off':>10}{'on':>7}{'on/off':>8}{'TPOT off':>10}{'on':>7}"
        f"{'off/on':>8}{'accept':>8}{'mean len':>9}  tok/s runs (off / on)"
    )
    for cell, sides in result["runs"].items():
        off, on = (statistics.median(sides[s]) for s in SIDES)
        t_off, t_on = (statistics.median(result["tpot_ms"][cell][s]) for s in SIDES)
        acc = result["acceptance"][cell]
        result.setdefault("ratio", {})[cell] = on / off
        result.setdefault("decode_ratio", {})[cell] = t_off / t_on
        print(
            f"{cell:<14}{off:>10.1f}{on:>7.1f}{on / off:>7.2f}x{t_off:>8.1f}ms{t_on:>5.1f}ms"
            f"{t_off / t_on:>7.2f}x{acc['acceptance_rate']:>8.0%}{acc['mean_acceptance_length']:>9.2f}  "
            + " ".join(f"{v:.0f}" for v in sides["off"])
            + " / "
            + " ".join(f"{v:.0f}" for v in sides["on"])
        )


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = list(result["runs"])
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for i, side in enumerate(SIDES):
        values = [statistics.median(result["runs"][c][side]) for c in cells]
        ax.bar(
            [x + 0.4 * i for x in range(len(cells))], values, width=0.4, label=f"speculation {side}"
        )
    ax.set_xticks([x + 0.2 for x in range(len(cells))], cells)
    ax.set_ylabel("output tok/s")
    ax.set_title(
        f"n-gram speculation (k={result['k']}), SmolLM2-135M bf16, medians of ABBA runs "
        f"({result['cpu']})",
        fontsize=9,
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
