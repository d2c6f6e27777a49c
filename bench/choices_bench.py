"""What ``n`` choices sharing one prefill saves (issue 27: router.share_prompts).

    .venv/bin/python -m bench.choices_bench [--size tiny] [--n 1,2,4,8] [--prompt-len 1024]
        [--output-len 128] [--rounds 2] [--seed 0]

One deployment of ``local.yaml`` (the demo checkpoint of ``--size``; 2 prefill + 2 decode
workers) and two coordinators in this process over its router and workers, built as the
ingress builds its own: **shared** (the first choice prefills on a prefill worker, the others on
its decode worker over the cached prompt: cluster/prompt_share.py) and **separate** (each choice
its own prefill, KV shipped to a decode worker each). Per ``n``, ``--rounds`` rounds of one
request of n sampled choices per path, in ABBA order, each with a fresh random prompt (no cache
hit from another request).

Per path and n: the prompt tokens computed over the cluster (the engines' prefix-cache lookups
minus hits; an imported prompt is no lookup), the decode workers' KV blocks in use at the request's peak (polled every 5 ms:
a lower bound of the true peak) and per choice, TTFT p50 over the choices and the request's
latency. Prints a table, writes ``bench/results/choices_bench.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from tandem.bootstrap import loopback_env  # noqa: I001

loopback_env()  # before ray is imported

import ray  # noqa: E402

from api.translate import choice_params  # noqa: E402
from bench.machine import cpu_name  # noqa: E402
from bench.serve_bench import RESULTS, direct_coordinator, log, on_local_deployment  # noqa: E402
from cluster.coordinator import Coordinator  # noqa: E402
from cluster.prompt_share import prompt_shares  # noqa: E402
from contracts.roles import NAMESPACE  # noqa: E402
from engine.kv_cache_manager import KVStats  # noqa: E402
from engine.request import EngineRequest  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from tandem.demo import ensure_demo_model  # noqa: E402
from tandem.topology import Topology  # noqa: E402

PATHS = ("shared", "separate")
POLL_S = 0.005


async def all_stats(topology: Topology, role: str = "") -> dict[str, KVStats]:
    """Each worker's KV pools (of ``role``'s workers only: live, as of their last tick)."""
    names = [s.name for s in topology.workers() if s.name.startswith(role)]
    actors = [ray.get_actor(n, namespace=NAMESPACE) for n in names]
    live = bool(role)
    stats: list[KVStats] = await asyncio.gather(*(a.kv_stats.remote(not live) for a in actors))
    return dict(zip(names, stats, strict=True))


async def one_request(
    coordinator: Coordinator, prompt: list[int], n: int, params: SamplingParams, rid: str
) -> tuple[list[float], float]:
    """The n choices through the coordinator as the ingress runs them: each choice's TTFT, and
    the request's latency."""
    start = time.perf_counter()
    shares = prompt_shares([tuple(prompt)] * n)

    async def choice(j: int) -> float:
        spec = EngineRequest(
            request_id=rid,
            choice=j,
            prompt_token_ids=tuple(prompt),
            params=choice_params(params, j),
            cache_salt="choices-bench",
            arrival_time=time.time(),
        )
        first = None
        async for _ in coordinator.generate(spec, shares[j]):
            first = first or time.perf_counter() - start
        assert first is not None, f"{rid}/{j} made no token"
        return first

    ttfts = await asyncio.gather(*(choice(j) for j in range(n)))
    return list(ttfts), time.perf_counter() - start


async def measured(
    coordinator: Coordinator, topology: Topology, prompt: list[int], n: int, rid: str, args: Any
) -> dict[str, Any]:
    before = await all_stats(topology)
    peak = 0
    params = SamplingParams(
        temperature=0.8, seed=args.seed, max_tokens=args.output_len, ignore_eos=True
    )
    run = asyncio.ensure_future(one_request(coordinator, prompt, n, params, rid))
    while not run.done():
        stats = await all_stats(topology, "decode")
        peak = max(peak, sum(s.in_use_blocks for s in stats.values()))
        await asyncio.sleep(POLL_S)
    ttfts, latency = run.result()
    after = await all_stats(topology)
    computed = sum(
        (after[w].prefix_query_tokens - after[w].prefix_hit_tokens)
        - (before[w].prefix_query_tokens - before[w].prefix_hit_tokens)
        for w in after
    )
    return {
        "prompt_tokens_computed": computed,
        "peak_decode_blocks": peak,
        "ttft_p50_s": statistics.median(ttfts),
        "latency_s": latency,
    }


async def measure(args: argparse.Namespace, topology: Topology) -> list[dict[str, Any]]:
    coordinators = {
        p: (await direct_coordinator(topology, Path(), share_prompts=p == "shared"))[0]
        for p in PATHS
    }
    block_size = next(iter(coordinators["shared"].infos.values())).block_size
    rng = random.Random(args.seed)
    vocab = 256  # well inside every demo vocabulary

    def fresh() -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(args.prompt_len)]

    log("warm-up: one n=2 request per path")
    for p in PATHS:
        await one_request(coordinators[p], fresh(), 2, SamplingParams(max_tokens=4), f"warm-{p}")
    rows = []
    for n in args.n:
        runs: dict[str, list[dict[str, Any]]] = {p: [] for p in PATHS}
        for rnd in range(args.rounds):
            for p in PATHS if rnd % 2 == 0 else PATHS[::-1]:
                log(f"n={n}, round {rnd + 1}: {p}")
                rid = f"choices-{n}-{rnd}-{p}"
                runs[p].append(await measured(coordinators[p], topology, fresh(), n, rid, args))
                await asyncio.sleep(0.5)
        for p in PATHS:
            row: dict[str, Any] = {"n": n, "path": p, "block_size": block_size, "runs": runs[p]}
            for key in runs[p][0]:
                row[key] = statistics.median(r[key] for r in runs[p])
            row["peak_blocks_per_choice"] = row["peak_decode_blocks"] / n
            rows.append(row)
    return rows


def report(rows: list[dict[str, Any]], block_size: int) -> None:
    print(
        f"\n{'n':>3} {'path':<9} {'prompt tok computed':>19} {'peak KV blocks':>14} "
        f"{'per choice':>10} {'TTFT p50':>9} {'latency':>8}"
    )
    for r in rows:
        print(
            f"{r['n']:>3} {r['path']:<9} {r['prompt_tokens_computed']:>19.0f} "
            f"{r['peak_decode_blocks']:>14.0f} {r['peak_blocks_per_choice']:>10.1f} "
            f"{r['ttft_p50_s'] * 1e3:>8.0f}m {r['latency_s']:>7.2f}s"
        )
    print(
        f"(medians over the rounds; m = ms; KV blocks of {block_size} tokens on the decode "
        "workers, polled: a lower bound of the peak)"
    )


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = list(dict.fromkeys(r["n"] for r in rows))
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.8))
    keys = (
        ("prompt_tokens_computed", "prompt tokens computed"),
        ("peak_blocks_per_choice", "peak decode KV blocks per choice"),
        ("ttft_p50_s", "TTFT p50 (s)"),
    )
    for ax, (key, title) in zip(axes, keys, strict=True):
        for p in PATHS:
            ax.plot(ns, [next(r[key] for r in rows if r["n"] == n and r["path"] == p) for n in ns])
        ax.legend(PATHS)
        ax.set_xlabel("n")
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="tiny")
    ap.add_argument("--n", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8])
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    model_dir = ensure_demo_model(args.size)
    rows = on_local_deployment(model_dir, lambda _, topology: measure(args, topology))
    block_size = rows[0]["block_size"]
    report(rows, block_size)
    RESULTS.mkdir(exist_ok=True)
    out = {"args": vars(args), "cpu": cpu_name(), "block_size": block_size, "rows": rows}
    (RESULTS / "choices_bench.json").write_text(json.dumps(out, indent=2))
    plot(rows, RESULTS / "choices_bench.png")
    log(f"wrote {RESULTS / 'choices_bench.json'} and choices_bench.png")
    sys.exit(0)


if __name__ == "__main__":
    main()
