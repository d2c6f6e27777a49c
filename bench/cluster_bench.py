"""Cluster benchmark (issue: disaggregated cluster): disaggregated vs colocated, one workload.

    .venv/bin/python -m bench.cluster_bench [--size small] [--requests 8] [--prompt-len 1024]
        [--rounds 2]

Both configurations run the same requests (fresh prompts, greedy, ``ignore_eos``) on a local Ray
cluster: ``disaggregated`` = 1 prefill + 1 decode worker (KV over the chosen transport),
``colocated`` = 1 worker doing both. They take turns in ABBA order over ``--rounds`` rounds
(colocated then disaggregated, then the other way round, each round with new prompts, each turn a
fresh cluster): a shared machine drifts, and a fixed order would charge the drift to whichever
runs second. Samples are pooled per configuration. Two phases per turn:

* latency: one request at a time (closed loop, concurrency 1; no queueing), so TTFT and ITL are
  the serving path's own. TTFT and ITL follow docs/design.md#metrics with arrival = when the client
  sends (the coordinator call); a delta carrying k tokens stamps all k at its arrival.
* throughput: all requests at once (closed loop, labelled as such), output tokens/s.

Transfer: bytes and time of each pull (decode worker records) and the part of it the client
waits for: how long after the first token the KV was in place (``exposed``); the first token
itself is sent by the prefill worker, so the transfer is not in TTFT but in the first ITL.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.bootstrap import init_ray, loopback_env  # noqa: I001

loopback_env()  # before ray is imported

import ray  # noqa: E402

from engine import metrics  # noqa: E402
from engine.request import EngineRequest  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from tandem.demo import ensure_demo_model  # noqa: E402
from tandem.launch import Cluster, start_cluster  # noqa: E402
from tandem.topology import Topology  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
ENGINE = "{kv_cache_bytes: 268435456, max_num_seqs: 16, max_num_batched_tokens: 2048}"
TOPOLOGIES = {
    "disaggregated": """
model: {{path: {path}, name: bench}}
domains: [a, b]
pools:
  prefill: {{replicas: 1, num_cpus: 1, engine: {engine}}}
  decode: {{replicas: 1, num_cpus: 1, engine: {engine}}}
transport: {transport}
router: {{local_prefill_max_tokens: 0}}
""",
    "colocated": """
model: {{path: {path}, name: bench}}
pools:
  prefill: {{replicas: 0}}
  decode: {{replicas: 0}}
  colocated: {{replicas: 1, num_cpus: 1, engine: {engine}}}
""",
}


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(16, 8000, (length,), generator=g).tolist() for _ in range(n)]


async def one(c: Cluster, rid: str, tokens: list[int], params: SamplingParams) -> dict[str, Any]:
    sent = time.time()
    stamps: list[float] = []
    async for delta in c.coordinator.generate(
        EngineRequest(rid, tuple(tokens), params, arrival_time=sent)
    ):
        now = time.time()
        stamps.extend([now] * len(delta.token_ids))
    return {"sent": sent, "stamps": stamps}


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ttfts = [r["stamps"][0] - r["sent"] for r in runs]
    itls = [b - a for r in runs for a, b in zip(r["stamps"], r["stamps"][1:], strict=False)]
    first_itls = [r["stamps"][1] - r["stamps"][0] for r in runs]

    def pct(xs: list[float], q: float) -> float:
        return metrics.percentile(xs, q)

    return {
        "ttft_p50_s": pct(ttfts, 50),
        "ttft_p99_s": pct(ttfts, 99),
        "itl_p50_s": pct(itls, 50),
        "itl_p99_s": pct(itls, 99),
        "first_itl_p50_s": pct(first_itls, 50),
        "n_ttft": len(ttfts),
        "n_itl": len(itls),
    }


@dataclass
class Turn:
    """One configuration's turn: its latency runs, throughput, and (disaggregated) pulls."""

    config: str
    latency: list[dict[str, Any]]
    throughput_tok_s: float
    pulls: list[Any]


async def bench_config(name: str, rnd: int, args: argparse.Namespace, model: Path) -> Turn:
    text = TOPOLOGIES[name].format(path=model, engine=ENGINE, transport=args.transport)
    log(f"round {rnd + 1}, {name}: starting the cluster")
    c = await start_cluster(Topology.from_yaml_text(text), model)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    tag = f"{name}-{rnd}"
    try:
        await one(c, f"{tag}-warm", prompts(1, args.prompt_len, 99)[0], params)
        log(f"round {rnd + 1}, {name}: latency, {args.requests} requests one at a time")
        lat = [
            await one(c, f"{tag}-lat-{i}", p, params)
            for i, p in enumerate(prompts(args.requests, args.prompt_len, 1 + 2 * rnd))
        ]
        log(f"round {rnd + 1}, {name}: throughput, {args.requests} requests at once")
        t0 = time.time()
        await asyncio.gather(
            *(
                one(c, f"{tag}-tput-{i}", p, params)
                for i, p in enumerate(prompts(args.requests, args.prompt_len, 2 + 2 * rnd))
            )
        )
        tput = args.requests * args.output_len / (time.time() - t0)
        pulls = []
        if name == "disaggregated":
            records = await c.workers["decode-0"].transfer_records()
            by_id = {r.attempt_id: r for r in records}
            pulls = [by_id[f"{tag}-lat-{i}@1"] for i in range(len(lat))]
        return Turn(name, lat, tput, pulls)
    finally:
        await c.shutdown()


def pooled(name: str, turns: list[Turn]) -> dict[str, Any]:
    mine = [t for t in turns if t.config == name]
    lat = [run for t in mine for run in t.latency]
    result = {
        "config": name,
        **summary(lat),
        "throughput_tok_s": sum(t.throughput_tok_s for t in mine) / len(mine),
    }
    pulls = [p for t in mine for p in t.pulls]
    if pulls:
        # How long after the first token the KV was in place: the part of the pull the client
        # waits for (the first token itself comes from the prefill worker).
        firsts = [run["stamps"][0] for t in mine for run in t.latency]
        exposed = [max(0.0, p.finished - f) for p, f in zip(pulls, firsts, strict=True)]
        result |= {
            "kv_bytes_per_request": pulls[0].num_bytes,
            "transfer_p50_s": metrics.percentile([p.finished - p.started for p in pulls], 50),
            "transfer_exposed_p50_s": metrics.percentile(exposed, 50),
        }
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="small")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--transport", default="grpc", choices=["grpc", "torch"])
    ap.add_argument("--rounds", type=int, default=2, help="ABBA rounds (each config once each)")
    args = ap.parse_args()
    model = ensure_demo_model(args.size)
    init_ray()
    turns = []
    for rnd in range(args.rounds):
        order = ("colocated", "disaggregated")[:: 1 if rnd % 2 == 0 else -1]
        turns += [asyncio.run(bench_config(n, rnd, args, model)) for n in order]
    ray.shutdown()
    rows = [pooled(n, turns) for n in ("colocated", "disaggregated")]
    colo, dis = rows
    added = dis["ttft_p50_s"] / colo["ttft_p50_s"] - 1
    print(f"\n{'config':<14} {'TTFT p50':>9} {'p99':>7} {'ITL p50':>8} {'p99':>7} {'tok/s':>7}")
    for r in rows:
        print(
            f"{r['config']:<14} {r['ttft_p50_s'] * 1e3:>8.0f}m {r['ttft_p99_s'] * 1e3:>6.0f}m "
            f"{r['itl_p50_s'] * 1e3:>7.1f}m {r['itl_p99_s'] * 1e3:>6.1f}m {r['throughput_tok_s']:>7.1f}"
        )
    print(
        f"\nKV per request {dis['kv_bytes_per_request'] / 2**20:.1f} MiB, pull p50 "
        f"{dis['transfer_p50_s'] * 1e3:.0f} ms (overlapping the prefill), exposed after the "
        f"first token p50 {dis['transfer_exposed_p50_s'] * 1e3:.0f} ms; TTFT added by "
        f"disaggregation {added * 100:+.1f}% (n={dis['n_ttft']} per config, ms = milliseconds)"
    )
    per_turn = [{"config": t.config, "ttft_p50_s": summary(t.latency)["ttft_p50_s"]} for t in turns]
    RESULTS.mkdir(exist_ok=True)
    out = {"args": vars(args), "configs": rows, "turns": per_turn, "ttft_added": added}
    (RESULTS / "cluster_bench.json").write_text(json.dumps(out, indent=2))
    plot(rows, RESULTS / "cluster_bench.png")
    log(f"wrote {RESULTS / 'cluster_bench.json'} and cluster_bench.png")


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ["ttft_p50_s", "ttft_p99_s", "first_itl_p50_s", "itl_p50_s", "itl_p99_s"]
    fig, ax = plt.subplots(figsize=(8, 4))
    for i, r in enumerate(rows):
        ax.bar(
            [k + i * 0.4 for k in range(len(keys))],
            [r[k] * 1e3 for k in keys],
            0.4,
            label=r["config"],
        )
    ax.set_xticks([k + 0.2 for k in range(len(keys))], [k.removesuffix("_s") for k in keys])
    ax.set_ylabel("ms")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    main()
