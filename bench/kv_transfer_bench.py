"""KV transfer benchmark: each transport against a raw loopback TCP socket moving the same bytes.

The sender is another process (the real case): it holds a KV cache, publishes transfers and
serves them (``KVTransferServer``), and also runs a plain TCP server that ``sendall``s the same
number of bytes from a preallocated buffer. The receiver (this process) pulls each transfer the
way a decode worker does -- every layer verified and written into its own cache blocks -- and,
for raw TCP, ``recv_into``s a preallocated buffer. Runs are interleaved; best of N each.

Two more columns say where the gap to raw TCP comes from: ``grpc_carrier`` streams the same
bytes, prebuilt, over a bare gRPC stream in ``CHUNK_BYTES`` messages (what Python gRPC itself
carries here: the gRPC transport's ceiling), and ``local_work`` is the KV format's own per-byte
work (gather, checksums on both sides, scatter) done serially in one process.

    .venv/bin/python -m bench.kv_transfer_bench [--reps 5] [--big-mib 256]

Workloads: a 1k-token request of the ``small`` demo model's KV layout (12 layers, 4 KV heads,
head_dim 64, block 16, bf16: 12 MiB) and a big one (~256 MiB). Prints a table, writes
``bench/results/kv_transfer_bench.json`` and ``.png``. Goal: each transport >= 50% of raw.
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing as mp
import socket
import sys
import time
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import torch

from engine.kv_layout import KVLayout, extract_layer, write_layer
from kv_transfer.exporter import KVExportRegistry, ReleaseReason
from kv_transfer.format import TransferHeader, TransferKey, block_checksums
from kv_transfer.grpc_transport import KVTransferServer
from kv_transfer.transport import make_transport
from kv_transfer.wire import CHANNEL_OPTIONS, CHUNK_BYTES

RESULTS = Path(__file__).resolve().parent / "results"
# The `small` demo model's KV geometry (engine/demo_model.py).
LAYERS, BLOCK, KV_HEADS, HEAD_DIM, DTYPE = 12, 16, 4, 64, torch.bfloat16
TRANSPORTS = ["grpc", "torch"]


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def layout() -> KVLayout:
    return KVLayout(LAYERS, BLOCK, KV_HEADS, HEAD_DIM, "bfloat16")


def cache(num_blocks: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    shape = (LAYERS, 2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    return torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=g).view(DTYPE)


def sender(num_blocks: int, threads: int, commands: Any, replies: Any) -> None:
    """The prefill side: publish on request, serve pulls, and serve raw TCP byte runs."""
    torch.set_num_threads(threads)
    kv = cache(num_blocks)
    registry = KVExportRegistry()
    server = KVTransferServer(registry)
    server.start()
    carrier = grpc_carrier(layout().layer_nbytes(num_blocks) * LAYERS)
    listener = socket.create_server(("127.0.0.1", 0))
    replies.put((server.address, listener.getsockname()[1], carrier[1]))
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    raw = bytearray(layout().layer_nbytes(num_blocks) * LAYERS)
    while True:
        cmd = commands.get()
        if cmd[0] == "stop":
            break
        if cmd[0] == "publish":
            _, key, n = cmd
            blocks = list(range(n))
            header = TransferHeader(key, layout(), n, n * BLOCK, [], "", "small", time.time() + 600)
            export = registry.publish(
                header,
                source=functools.partial(extract_layer, kv, block_ids=blocks),
                lease_s=600,
                on_release=lambda reason: None,
            )
            export.all_ready()
            replies.put("ok")
        elif cmd[0] == "raw":
            nbytes = cmd[1]
            replies.put("ok")
            conn.sendall(memoryview(raw)[:nbytes])
    conn.close()
    server.stop(0)
    carrier[0].stop(0)


def grpc_carrier(nbytes: int) -> tuple[grpc.Server, int]:
    """A gRPC server streaming ``nbytes`` of prebuilt bytes in CHUNK_BYTES messages: what gRPC
    itself carries here, with no KV work (the gRPC transport's ceiling)."""
    parts = [bytes(min(CHUNK_BYTES, nbytes - o)) for o in range(0, nbytes, CHUNK_BYTES)]
    server = grpc.server(futures.ThreadPoolExecutor(2), options=CHANNEL_OPTIONS)
    handler = grpc.unary_stream_rpc_method_handler(lambda request, context: iter(parts))
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler("bench", {"Bytes": handler})]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def run_workload(
    name: str, num_blocks: int, reps: int, ctx: Any, commands: Any, replies: Any, addr: Any
) -> dict[str, Any]:
    address, raw_port, carrier_port = addr
    nbytes = layout().layer_nbytes(num_blocks) * LAYERS
    dst = torch.zeros(LAYERS, 2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, dtype=DTYPE)
    dst_blocks = list(range(num_blocks))[::-1]
    clients = {kind: make_transport(kind, puller_id=f"bench-{kind}") for kind in TRANSPORTS}
    raw_sock = socket.create_connection(("127.0.0.1", raw_port))
    raw_buf = bytearray(nbytes)
    channel = grpc.insecure_channel(f"127.0.0.1:{carrier_port}", options=CHANNEL_OPTIONS)
    carrier = channel.unary_stream("/bench/Bytes")
    times: dict[str, list[float]] = {
        "raw_tcp": [],
        "grpc_carrier": [],
        **{k: [] for k in TRANSPORTS},
    }

    def sink(chunk: Any) -> None:
        write_layer(dst, chunk.layer, dst_blocks, chunk.payload)

    for rep in range(reps + 1):  # rep 0 warms up (channels, pair groups, allocations)
        commands.put(("raw", nbytes))
        replies.get()
        view, got = memoryview(raw_buf), 0
        t0 = time.perf_counter()
        while got < nbytes:
            got += raw_sock.recv_into(view[got:], nbytes - got)
        raw_s = time.perf_counter() - t0
        if rep:
            times["raw_tcp"].append(raw_s)
        t0 = time.perf_counter()
        got = sum(len(m) for m in carrier(b""))
        if rep:
            times["grpc_carrier"].append(time.perf_counter() - t0)
        assert got == nbytes, (got, nbytes)
        for kind, client in clients.items():
            key = TransferKey(f"{name}-{kind}", str(rep))
            commands.put(("publish", key, num_blocks))
            replies.get()
            t0 = time.perf_counter()
            client.pull(address, key, layout(), sink, time.time() + 300)
            took = time.perf_counter() - t0
            client.release(address, key, ReleaseReason.ACKED)
            if rep:
                times[kind].append(took)
    raw_sock.close()
    channel.close()
    for client in clients.values():
        client.close()
    best = {k: min(v) for k, v in times.items()}
    best["local_work"] = local_work(num_blocks, reps)
    gib = nbytes / 2**30
    row: dict[str, Any] = {
        "workload": name,
        "bytes": nbytes,
        "tokens": num_blocks * BLOCK,
        "best_s": best,
        "gib_s": {k: gib / s for k, s in best.items()},
        "pct_of_raw": {k: 100 * best["raw_tcp"] / best[k] for k in [*TRANSPORTS, "grpc_carrier"]},
        "all_s": times,
    }
    log(f"{name}: " + ", ".join(f"{k} {v:.2f} GiB/s" for k, v in row["gib_s"].items()))
    return row


def local_work(num_blocks: int, reps: int) -> float:
    """Best time of the per-byte work every transfer does whatever carries it, in one process
    with no network: extract each layer, checksum it (sender), checksum it again (receiver's
    verify) and write it into other blocks -- the part of the gap to raw TCP that is the KV
    format's, not the transport's."""
    src = cache(num_blocks)
    dst = torch.zeros_like(src)
    blocks, dst_blocks = list(range(num_blocks)), list(range(num_blocks))[::-1]
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for layer in range(LAYERS):
            payload = extract_layer(src, layer, blocks)
            block_checksums(payload)
            block_checksums(payload)
            write_layer(dst, layer, dst_blocks, payload)
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--big-mib", type=int, default=256)
    # Intra-op threads in both processes. The transfer's copies are memory-bound, and on a small
    # shared machine an OpenMP team waiting on a descheduled thread turns a 0.2 ms copy into
    # several ms (measured: 1 MiB write_layer 0.5 ms at 1 thread, 6-8 ms at 2 under load).
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    block_bytes = layout().layer_nbytes(1) * LAYERS  # one block, all layers, K and V
    workloads = [("1k_tokens", 1024 // BLOCK), ("big", (a.big_mib << 20) // block_bytes)]
    ctx = mp.get_context("spawn")
    rows = []
    for name, num_blocks in workloads:
        commands, replies = ctx.Queue(), ctx.Queue()
        proc = ctx.Process(
            target=sender, args=(num_blocks, a.threads, commands, replies), daemon=True
        )
        proc.start()
        addr = replies.get(timeout=120)
        rows.append(run_workload(name, num_blocks, a.reps, ctx, commands, replies, addr))
        commands.put(("stop",))
        proc.join(60)
    cols = [*TRANSPORTS, "grpc_carrier"]
    head = " ".join(f"{k + ' GiB/s':>18} {'% raw':>6}" for k in cols)
    print(f"\n{'workload':<10} {'MiB':>7} {'raw GiB/s':>10} {head} {'local work GiB/s':>17}")
    for r in rows:
        cells = " ".join(f"{r['gib_s'][k]:>18.2f} {r['pct_of_raw'][k]:>6.0f}" for k in cols)
        print(
            f"{r['workload']:<10} {r['bytes'] / 2**20:>7.1f} {r['gib_s']['raw_tcp']:>10.2f} "
            f"{cells} {r['gib_s']['local_work']:>17.2f}"
        )
    RESULTS.mkdir(exist_ok=True)
    result = {"layout": vars(layout()), "workload": vars(a), "rows": rows}
    (RESULTS / "kv_transfer_bench.json").write_text(json.dumps(result, indent=2))
    plot(rows, RESULTS / "kv_transfer_bench.png")
    log(f"wrote {RESULTS / 'kv_transfer_bench.json'} and kv_transfer_bench.png")


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    kinds = ["raw_tcp", "grpc_carrier", *TRANSPORTS, "local_work"]
    width = 0.8 / len(kinds)
    for i, kind in enumerate(kinds):
        xs = [x + (i - (len(kinds) - 1) / 2) * width for x in range(len(rows))]
        ax.bar(xs, [r["gib_s"][kind] for r in rows], width, label=kind)
    ax.set_xticks(range(len(rows)), [f"{r['workload']} ({r['bytes'] >> 20} MiB)" for r in rows])
    ax.set_ylabel("GiB/s (best of N, cross-process, loopback)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    main()
