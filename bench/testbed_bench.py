"""The multi-host test bed (issue 17): KV transfer between hosts, startup, and host faults.

    sudo .venv/bin/python -m bench.testbed_bench [--transfer-mib 64] [--rounds 4]
        [--clients 8] [--out testbed_bench]

1. **Transfer.** On a fresh 3-host bed (tandem/testbed.py), a sender process on host b and a
   receiver on host c (each moved into its host's network namespace) move the same bytes three
   ways, the order rotating each round: raw TCP (one connection, ``sendall`` / ``recv_into``),
   Tandem's gRPC transport and its torch/gloo transport (a KV export of that size, pulled whole
   into a cache; pair groups and channels opened by one unmeasured pull first). GiB/s per run.
2. **Startup.** From no bed: ``tandem testbed up`` -> ``ray up deploy/cluster-testbed.yaml`` ->
   ``tandem serve --address`` on the head answering ``/health`` -> the first completion.
3. **Faults under load.** ``--clients`` closed-loop streaming clients (chaos.load: the ``openai``
   client, 96-token prompts, 64 tokens each), tokens counted per 0.5 s. Kill host c (decode-1),
   then revive it and restart its Ray node; then partition host b (prefill-1, decode-0) for 8 s
   and heal it. For each fault: detection (the fault -> the router's health log marks the
   worker FAILED), recovery (the fault -> the end of the first 2 s window whose throughput is
   back to 90% of the 5 s before the fault), the worst 2 s window, failed requests.

Writes a table, ``bench/results/<out>.json`` and ``.png``. Needs root (the bed).
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import socket
import statistics
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.engine_bench import RESULTS, log
from chaos.load import InThread, Sender, requests_of
from chaos.probe import wait_all_up
from tandem import testbed

TOPOLOGY = testbed.CHECKOUT / "deploy" / "topologies" / "testbed.yaml"
KINDS = ["tcp", "grpc", "torch"]
LAYERS, BLOCK, HEADS, HEAD_DIM = 4, 16, 4, 64
BLOCK_BYTES = LAYERS * 2 * BLOCK * HEADS * HEAD_DIM * 2  # bf16, every layer


# -- 1. transfer ----------------------------------------------------------------------------------


def _sender(host: testbed.Host, mib: int, requests: Any, replies: Any) -> None:
    """On host b: a KV export server and a raw TCP listener, serving what the parent asks."""
    testbed.enter(host)
    import torch

    from engine.kv_layout import KVLayout, extract_layer
    from kv_transfer.exporter import KVExportRegistry
    from kv_transfer.format import TransferHeader, TransferKey
    from kv_transfer.grpc_transport import KVTransferServer

    blocks = mib * 2**20 // BLOCK_BYTES
    shape = (LAYERS, 2, blocks, BLOCK, HEADS, HEAD_DIM)
    cache = torch.randint(-(2**15), 2**15, shape, dtype=torch.int16).view(torch.bfloat16)
    payload = cache.view(torch.uint8).numpy().tobytes()
    ids = list(range(blocks))
    registry = KVExportRegistry()
    server = KVTransferServer(registry, host=host.address)
    server.start()
    listener = socket.create_server((host.address, 0))

    def tcp() -> None:
        while True:
            conn, _ = listener.accept()
            with conn:
                conn.sendall(payload)

    threading.Thread(target=tcp, daemon=True).start()
    replies.put((server.address, listener.getsockname()[1], len(payload)))
    while (key := requests.get()) is not None:
        header = TransferHeader(
            key=TransferKey(key, f"{key}@1"),
            layout=KVLayout.from_cache(cache),
            num_blocks=blocks,
            num_tokens=blocks * BLOCK,
            block_hashes=[],
            cache_salt="",
            model_id="bench",
            deadline=time.time() + 120,
        )
        registry.publish(
            header,
            source=lambda layer: extract_layer(cache, layer, ids),
            lease_s=120,
            on_release=lambda reason: None,
        ).all_ready()
        replies.put(key)
    server.stop(0)


def _receiver(host: testbed.Host, mib: int, requests: Any, replies: Any) -> None:
    """On host c: pulls (or reads the raw bytes) as the parent asks; replies the seconds."""
    testbed.enter(host)
    import torch

    from engine.kv_layout import KVLayout, write_layer
    from kv_transfer.exporter import ReleaseReason
    from kv_transfer.format import TransferKey
    from kv_transfer.transport import make_transport

    blocks = mib * 2**20 // BLOCK_BYTES
    dst = torch.zeros(LAYERS, 2, blocks, BLOCK, HEADS, HEAD_DIM, dtype=torch.bfloat16)
    ids = list(range(blocks))
    transports = {
        k: make_transport(k, puller_id=f"bench-{k}", host=host.address) for k in KINDS[1:]
    }
    buf = bytearray(dst.numel() * 2)
    while (job := requests.get()) is not None:
        kind, address, key = job
        start = time.perf_counter()
        if kind == "tcp":
            with socket.create_connection(tuple(address)) as conn:
                view, got = memoryview(buf), 0
                while got < len(buf):
                    n = conn.recv_into(view[got:])
                    if n == 0:
                        raise ConnectionError("short read")
                    got += n
        else:
            t = transports[kind]
            sink = lambda chunk: write_layer(dst, chunk.layer, ids, chunk.payload)  # noqa: E731
            t.pull(address, TransferKey(key, f"{key}@1"), KVLayout.from_cache(dst), sink, None)
            t.release(address, TransferKey(key, f"{key}@1"), ReleaseReason.ACKED)
        replies.put(time.perf_counter() - start)
    for t in transports.values():
        t.close()


def transfer(bed: testbed.Testbed, mib: int, rounds: int) -> dict[str, list[float]]:
    ctx = mp.get_context("spawn")
    s_req, s_rep, r_req, r_rep = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue()
    sender = ctx.Process(target=_sender, args=(bed.hosts[1], mib, s_req, s_rep), daemon=True)
    receiver = ctx.Process(target=_receiver, args=(bed.hosts[2], mib, r_req, r_rep), daemon=True)
    sender.start()
    receiver.start()
    kv_address, tcp_port, nbytes = s_rep.get(timeout=120)
    tcp_address = (bed.hosts[1].address, tcp_port)
    n = 0

    def once(kind: str) -> float:
        nonlocal n
        n += 1
        if kind != "tcp":
            s_req.put(f"{kind}-{n}")
            s_rep.get(timeout=60)
        r_req.put((kind, tcp_address if kind == "tcp" else kv_address, f"{kind}-{n}"))
        return float(r_rep.get(timeout=300))

    rates: dict[str, list[float]] = {k: [] for k in KINDS}
    for kind in KINDS:
        once(kind)  # warm: connections, pair groups
    for r in range(rounds):
        order = KINDS[r % 3 :] + KINDS[: r % 3]
        for kind in order if r % 2 == 0 else order[::-1]:
            seconds = once(kind)
            rates[kind].append(nbytes / seconds / 2**30)
            log(f"transfer round {r} {kind:>5}: {rates[kind][-1]:.2f} GiB/s")
    s_req.put(None)
    r_req.put(None)
    sender.join(30)
    receiver.join(30)
    return rates


# -- 2. startup -----------------------------------------------------------------------------------


def startup() -> tuple[testbed.Testbed, subprocess.Popen[bytes], dict[str, float]]:
    import openai

    testbed.down()
    t0 = time.perf_counter()
    bed = testbed.up(3, ["a", "b", "c"])
    t1 = time.perf_counter()
    testbed.ray_up(bed.cluster_file)
    t2 = time.perf_counter()
    proc = testbed.serve_on_head(bed, TOPOLOGY)
    t3 = time.perf_counter()
    client = openai.OpenAI(base_url=f"{testbed.url(bed)}/v1", api_key="none", max_retries=0)
    client.completions.create(model=model_name(), prompt="Once upon a time", max_tokens=16)
    t4 = time.perf_counter()
    phases = {
        "testbed_up_s": t1 - t0,
        "ray_up_s": t2 - t1,
        "serve_ready_s": t3 - t2,
        "first_completion_s": t4 - t3,
        "total_s": t4 - t0,
    }
    log("startup: " + ", ".join(f"{k} {v:.1f}" for k, v in phases.items()))
    return bed, proc, phases


def model_name() -> str:
    from tandem.topology import load_topology

    return load_topology(TOPOLOGY).model.name


# -- 3. faults under load -------------------------------------------------------------------------


class Load:
    """Closed-loop streaming clients (chaos.load)."""

    def __init__(self, url: str, clients: int) -> None:
        def bodies() -> Iterator[dict[str, Any]]:
            for i in itertools.count():
                prompt = [(17 * i + 31 * k) % 4000 + 50 for k in range(96)]
                yield {"prompt": prompt, "max_tokens": 64, "temperature": 0, "logprobs": 0,
                       "ignore_eos": True}  # fmt: skip

        sender = Sender(url, model_name(), hang_bound_s=120.0)
        self.load = InThread(sender, requests_of(bodies()), clients)

    def events(self) -> list[tuple[float, int]]:
        """(time, tokens) per chunk received, in time order."""
        return sorted(e for o in self.load.outcomes() for e in o.token_times)

    def rate(self, start: float, end: float) -> float:
        return sum(n for t, n in self.events() if start <= t < end) / (end - start)

    def failures(self) -> list[tuple[float, str]]:
        return [
            (o.finished or 0.0, o.error or "") for o in self.load.outcomes() if o.status == "error"
        ]

    def close(self) -> None:
        self.load.join(150)


def health_events(bed: testbed.Testbed) -> list[dict[str, Any]]:
    return testbed.ask_router(bed, "health_events")  # type: ignore[no-any-return]


def fault_record(
    bed: testbed.Testbed, load: Load, name: str, at: float, workers: list[str], logged: int
) -> dict[str, Any]:
    before = load.rate(at - 5, at)
    events = health_events(bed)[logged:]

    def first(worker: str, event: str) -> float | None:
        return next(
            (e["at"] - at for e in events if e["worker"] == worker and e["event"] == event), None
        )

    detected = {w: first(w, "failed") for w in workers}
    recovered, worst, t = None, float("inf"), at
    while t + 2 <= time.time():
        r = load.rate(t, t + 2)
        worst = min(worst, r)
        if recovered is None and r >= 0.9 * before:
            recovered = t + 2 - at
        t += 0.5
    failed = [f for f in load.failures() if f[0] >= at - 1]
    record = {
        "fault": name,
        "at": at,
        "before_tok_s": before,
        "worst_2s_tok_s": worst,
        "detect_s": detected,
        "recover_s": recovered,
        "failed_requests": len(failed),
    }
    log(
        f"{name}: detected {detected}, recovered in {recovered}, worst {worst:.0f} tok/s "
        f"(before {before:.0f}), {len(failed)} failed requests"
    )
    return record


def rejoin_record(bed: testbed.Testbed, record: dict[str, Any], logged: int) -> None:
    """When each worker's health check answered and its first report was taken again,
    seconds after the fault (the router's health log)."""
    events = health_events(bed)[logged:]
    for worker in record["detect_s"]:
        for event in ("checked", "up"):
            at = [
                e["at"] - record["at"]
                for e in events
                if e["worker"] == worker and e["event"] == event
            ]
            record.setdefault(f"{event}_s", {})[worker] = at[-1] if at else None


def faults(bed: testbed.Testbed, clients: int) -> tuple[list[dict[str, Any]], Load]:
    load = Load(testbed.url(bed), clients)
    records = []
    try:
        time.sleep(8)  # steady
        logged = len(health_events(bed))
        at = time.time()
        testbed.kill_host(bed.hosts[2])
        time.sleep(12)
        records.append(fault_record(bed, load, "kill host c", at, ["decode-1"], logged))
        records[-1]["revived_s"] = time.time() - at
        testbed.revive_host(bed, bed.hosts[2])
        testbed.restart_ray_node(bed, bed.hosts[2])
        wait_all_up(testbed.url(bed))
        rejoin_record(bed, records[-1], logged)
        time.sleep(8)
        logged = len(health_events(bed))
        at = time.time()
        testbed.partition(bed.hosts[1])
        time.sleep(8)
        testbed.heal(bed.hosts[1])
        time.sleep(12)
        victims = ["prefill-1", "decode-0"]
        records.append(fault_record(bed, load, "partition host b (8 s)", at, victims, logged))
        records[-1]["healed_s"] = 8.0
        wait_all_up(testbed.url(bed))
        rejoin_record(bed, records[-1], logged)
    finally:
        load.close()
    return records, load


# -- report ---------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--transfer-mib", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--out", default="testbed_bench")
    a = ap.parse_args()
    testbed.check_possible()
    testbed.down()
    bed = testbed.up(3, ["a", "b", "c"])
    rates = transfer(bed, a.transfer_mib, a.rounds)
    bed, proc, phases = startup()
    try:
        records, load = faults(bed, a.clients)
    finally:
        testbed.stop_serving(bed, proc)
        testbed.ray_down(bed.cluster_file)
        testbed.down()
    result = {
        "transfer_mib": a.transfer_mib,
        "transfer_gib_s": rates,
        "startup": phases,
        "faults": records,
        "clients": a.clients,
        "timeline": [[t, n] for t, n in load.events()],
    }
    print_table(result)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{a.out}.json").write_text(json.dumps(result, indent=2))
    plot(result, RESULTS / f"{a.out}.png")
    log(f"wrote {RESULTS / a.out}.json and .png")


def print_table(result: dict[str, Any]) -> None:
    print(f"\nKV transfer host b -> host c, {result['transfer_mib']} MiB (GiB/s, every run)")
    for kind, runs in result["transfer_gib_s"].items():
        runs_s = " ".join(f"{r:.2f}" for r in runs)
        print(f"  {kind:>5}: median {statistics.median(runs):.2f}   runs {runs_s}")
    print("\nstartup (s): " + ", ".join(f"{k} {v:.1f}" for k, v in result["startup"].items()))
    print(f"\nfaults under {result['clients']} streaming clients")
    for f in result["faults"]:
        detect = ", ".join(
            f"{w} {d:.2f} s" if d is not None else f"{w} -" for w, d in f["detect_s"].items()
        )
        print(
            f"  {f['fault']}: detected {detect}; back to 90% in {f['recover_s']} s; worst 2 s "
            f"{f['worst_2s_tok_s']:.0f} tok/s (before {f['before_tok_s']:.0f}); "
            f"{f['failed_requests']} failed"
        )
        back = "revived_s" if "revived_s" in f else "healed_s"
        print(
            f"    host back at {f[back]:.1f} s; health check answered {fmt(f['checked_s'])}; "
            f"reports taken again {fmt(f['up_s'])} (s after the fault)"
        )


def fmt(times: dict[str, float | None]) -> str:
    return ", ".join(f"{w} {t:.1f}" if t is not None else f"{w} -" for w, t in times.items())


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5), width_ratios=[1, 2.2])
    kinds = list(result["transfer_gib_s"])
    ax1.boxplot([result["transfer_gib_s"][k] for k in kinds], tick_labels=kinds)
    ax1.set_ylabel("GiB/s")
    ax1.set_title(f"{result['transfer_mib']} MiB host b -> host c")
    events = result["timeline"]
    if events:
        t0 = min(t for t, _ in events)
        end = max(t for t, _ in events)
        xs = [x * 0.5 for x in range(int((end - t0) / 0.5) + 1)]
        ys = [sum(n for t, n in events if t0 + x <= t < t0 + x + 0.5) / 0.5 for x in xs]
        ax2.plot(xs, ys, lw=1)
        for f in result["faults"]:
            ax2.axvline(f["at"] - t0, color="red", ls="--")
            ax2.text(f["at"] - t0, max(ys) * 0.95, " " + f["fault"], color="red", fontsize=8)
    ax2.set_xlabel("s")
    ax2.set_ylabel("tokens/s (0.5 s windows)")
    ax2.set_title(f"{result['clients']} streaming clients, host faults")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
