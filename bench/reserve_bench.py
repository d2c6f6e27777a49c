"""What reserving the decode side before the prefill costs (issue 26: router.reserve_decode_first).

    .venv/bin/python -m bench.reserve_bench [--size tiny] [--rates 2,inf] [--requests 32]
        [--prompt-len 512] [--output-len 32] [--rounds 2] [--seed 0]

One deployment of ``local.yaml`` (the demo checkpoint of ``--size``; 2 prefill + 2 decode
workers) and two coordinators in this process over its router and workers, built as the
ingress builds its own: **reserved** (the decode worker's batch slot and KV blocks held before
the prefill starts, the shipped order) and **unreserved** (the prefill first; the decode side
parks the import until it has room). Per rate, ``--rounds`` rounds of two passes over one
open-loop Poisson schedule of fresh prompts, in ABBA order (reserved, unreserved, then
unreserved, reserved: a shared machine drifts), each path with its own prefix-cache tenant.
``inf`` sends every request at once (saturation).

Per path and rate: TTFT and ITL p50/p99 (from each request's scheduled send), output tokens/s,
and the waits counted by the decode workers during its passes: imports parked (KV computed
and leased on a prefill worker while the decode side had no room) and reservations that
waited (no KV computed yet). Prints a table, writes ``bench/results/reserve_bench.json`` and
``.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from pathlib import Path
from typing import Any

from tandem.bootstrap import loopback_env  # noqa: I001

loopback_env()  # before ray is imported

import aiohttp  # noqa: E402
import ray  # noqa: E402

from api import protocol, translate  # noqa: E402
from bench.machine import cpu_name  # noqa: E402
from bench.serve_bench import (  # noqa: E402
    RESULTS,
    WARMUP_REQUESTS,
    Paths,
    Sample,
    Workload,
    direct_coordinator,
    log,
    on_local_deployment,
    summary,
    workload,
)
from contracts.actors import RouterClient  # noqa: E402
from contracts.roles import NAMESPACE, ROUTER_NAME  # noqa: E402
from tandem.demo import ensure_demo_model  # noqa: E402
from tandem.topology import Topology  # noqa: E402

PATHS = ("reserved", "unreserved")
TTFT_TARGET = 0.03  # the issue: the reservation adds at most 3% to TTFT p50 at rate 2


async def waits(router: RouterClient) -> tuple[int, int]:
    """(imports parked, reservations waited), summed over the decode workers' latest reports."""
    states = await router.worker_states()
    return (
        sum(s.report.imports_parked for s in states),
        sum(s.report.reservations_waited for s in states),
    )


async def measure(args: argparse.Namespace, topology: Topology, model_dir: Path) -> list[Any]:
    router = RouterClient(ray.get_actor(ROUTER_NAME, namespace=NAMESPACE))
    coordinators = {
        path: (await direct_coordinator(topology, model_dir, reserve_decode=path == "reserved"))
        for path in PATHS
    }
    vocab_size = coordinators["reserved"][1]
    body = {"model": topology.model.name, "prompt": [16], "max_tokens": args.output_len}
    body |= {"temperature": 0.0, "ignore_eos": True}
    params = translate.sampling_params(
        protocol.parse_completion(json.dumps(body).encode()),
        vocab_size=vocab_size,
        default_max_tokens=args.output_len,
    )
    rows = []
    async with aiohttp.ClientSession() as session:
        paths = {
            p: Paths("", session, c, topology.model.name, params, None, salt=f"reserve-bench-{p}")
            for p, (c, _) in coordinators.items()
        }
        log(f"warm-up: {WARMUP_REQUESTS} requests per path, twice")
        for r in range(2):
            warm = workload(1.0, WARMUP_REQUESTS, args.prompt_len, args.seed + 1000 + r)
            for p in PATHS:
                await paths[p].run_pass("direct", _at_once(warm), f"warm{r}")
        for i, rate in enumerate(args.rates):
            rounds: dict[str, list[list[Sample]]] = {p: [] for p in PATHS}
            counted = {p: [0, 0] for p in PATHS}
            for rnd in range(args.rounds):
                order = PATHS if rnd % 2 == 0 else PATHS[::-1]
                w = workload(
                    min(rate, 1e6), args.requests, args.prompt_len, args.seed + 10 * i + rnd
                )
                if math.isinf(rate):
                    w = _at_once(w)
                for p in order:
                    log(f"rate {rate:g}/s, round {rnd + 1}: {p} pass, {args.requests} requests")
                    before = await waits(router)
                    rounds[p].append(await paths[p].run_pass("direct", w, f"r{i}.{rnd}.{p}"))
                    await asyncio.sleep(1.0)  # the workers' next reports carry the pass's waits
                    after = await waits(router)
                    counted[p][0] += after[0] - before[0]
                    counted[p][1] += after[1] - before[1]
            for p in PATHS:
                row = summary(p, rate, rounds[p])
                row |= {"imports_parked": counted[p][0], "reservations_waited": counted[p][1]}
                rows.append(row)
    return rows


def _at_once(w: Workload) -> Workload:
    return Workload(w.rate, [0.0] * len(w.offsets), w.prompts)


def report(rows: list[dict[str, Any]]) -> dict[str, Any]:
    ms = 1e3
    print(
        f"\n{'rate/s':>6} {'path':<10} {'TTFT p50':>9} {'p99':>8} {'ITL p50':>8} {'p99':>7} "
        f"{'tok/s':>7} {'parked':>7} {'waited':>7}"
    )
    for r in rows:
        print(
            f"{r['rate']:>6g} {r['path']:<10} {r['ttft_p50_s'] * ms:>8.1f}m "
            f"{r['ttft_p99_s'] * ms:>7.1f}m {r['itl_p50_s'] * ms:>7.2f}m "
            f"{r['itl_p99_s'] * ms:>6.1f}m {r['output_tok_s']:>7.1f} "
            f"{r['imports_parked']:>7} {r['reservations_waited']:>7}"
        )
    by = {(r["rate"], r["path"]): r for r in rows}
    added = {}
    for rate in dict.fromkeys(r["rate"] for r in rows):
        a, b = by[(rate, "reserved")], by[(rate, "unreserved")]
        added[str(rate)] = a["ttft_p50_s"] / b["ttft_p50_s"] - 1.0
        print(f"  rate {rate:g}/s: the reservation adds {added[str(rate)] * 100:+.1f}% TTFT p50")
    print(
        "(m = ms; latencies from each request's scheduled send; parked = imports that waited "
        "for room with their KV leased; waited = reservations that waited before any prefill)"
    )
    return added


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = list(dict.fromkeys(r["rate"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.8))
    for ax, (key, title) in zip(
        axes, (("ttft_p50_s", "TTFT p50 (ms)"), ("imports_parked", "imports parked")), strict=True
    ):
        for k, p in enumerate(PATHS):
            values = [
                next(r[key] for r in rows if r["rate"] == x and r["path"] == p) for x in rates
            ]
            values = [v * 1e3 for v in values] if key.endswith("_s") else values
            ax.bar([j + 0.4 * k for j in range(len(rates))], values, width=0.4, label=p)
        ax.set_xticks([j + 0.2 for j in range(len(rates))], [f"{x:g}/s" for x in rates])
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="tiny")
    ap.add_argument(
        "--rates", type=lambda s: [float(x) for x in s.split(",")], default=[2.0, math.inf]
    )
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    model_dir = ensure_demo_model(args.size)
    rows = on_local_deployment(model_dir, lambda _, topology: measure(args, topology, model_dir))
    added = report(rows)
    RESULTS.mkdir(exist_ok=True)
    out: dict[str, Any] = {"args": vars(args) | {"rates": [str(r) for r in args.rates]}}
    out["cpu"] = cpu_name()
    out |= {"passes": rows, "ttft_added": added, "ttft_target": TTFT_TARGET}
    (RESULTS / "reserve_bench.json").write_text(json.dumps(out, indent=2, default=str))
    plot(rows, RESULTS / "reserve_bench.png")
    log(f"wrote {RESULTS / 'reserve_bench.json'} and reserve_bench.png")
    sys.exit(0)


if __name__ == "__main__":
    main()
