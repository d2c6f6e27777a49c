"""HTTP endpoint benchmark (issue: the OpenAI API on Ray Serve): cold start, and what the HTTP
path adds to the coordinator it wraps.

    .venv/bin/python -m bench.serve_bench [--size tiny] [--rates 0.5,1,2] [--requests 16]
        [--prompt-len 128] [--output-len 32] [--seed 0]

Cold start: the real ``tandem serve --model <demo dir> --port P`` as a subprocess with its own
Ray (a short ``RAY_TMPDIR``: Ray's socket paths must fit 107 bytes); spawn to the first
``POST /v1/completions`` answered 200, then SIGINT to exit, and whether any process of its Ray
was left behind.

Steady state: ``tandem.serve.deploy`` in this process (``local.yaml`` with the demo checkpoint of
``--size``). Per rate, two rounds, each two passes over one open-loop Poisson schedule and one
set of fresh prompts: HTTP then direct, then (new prompts) direct then HTTP. A shared machine
drifts (measured here: the same request's TTFT fell ~30% over the first minute of a
deployment), so a fixed order would charge the drift to whichever path runs first; the ABBA
order cancels a linear drift, and the two rounds' samples are pooled per path:

* http: streaming ``POST /v1/completions`` (token-id prompt) over aiohttp to the ingress
  replica (direct ingress, as ``tandem serve`` runs it), SSE parsed here;
* direct: ``Coordinator.generate`` in this process over the same router and workers.

Metrics are ``engine.metrics`` (docs/design.md#metrics) with arrival = the request's *scheduled*
send time (coordinated-omission safe; the dispatch delay is printed) and an emit = when this client
received the SSE chunk / delta carrying the token. Requests ask for ``logprobs: 0`` on both paths
(the same engine work) because it is how an SSE chunk says which tokens it carries: a chunk may
hold several tokens, or tokens whose text is still held back. The direct pass uses its own
prefix-cache salt, so it never reuses the KV the HTTP pass left for the same prompts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem.bootstrap import LOOPBACK_ENV, loopback_env  # noqa: I001

loopback_env()  # before ray is imported

import aiohttp  # noqa: E402
import ray  # noqa: E402
import yaml  # noqa: E402
from ray import serve  # noqa: E402

from api import protocol, translate  # noqa: E402
from cluster.coordinator import Coordinator  # noqa: E402
from contracts.actors import RouterClient, WorkerClient  # noqa: E402
from contracts.messages import WorkerInfo  # noqa: E402
from contracts.roles import NAMESPACE, ROUTER_NAME  # noqa: E402
from engine import metrics  # noqa: E402
from engine.request import EngineRequest, RequestTimes  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from tandem.demo import ensure_demo_model  # noqa: E402
from tandem.deployment import DEFAULT_TOPOLOGY  # noqa: E402
from tandem.serve import deploy, free_port, wait_until_ready  # noqa: E402
from tandem.topology import Topology, load_topology  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
TANDEM = Path(sys.executable).with_name("tandem")
COLD_START_TIMEOUT_S = 600.0
SHUTDOWN_TIMEOUT_S = 120.0
LEFTOVER_GRACE_S = 10.0  # Ray's own processes may outlive the driver by a moment
POLL_INTERVAL_S = 0.25
START_DELAY_S = 0.2  # the first scheduled send of a pass, after the tasks are created
FELL_BEHIND_S = 0.010  # a send this late (vs its schedule) means the client could not keep up
WARMUP_REQUESTS = 4  # per path and warm-up round: every worker has run a request
WARMUP_ROUNDS = 3
TOKEN_RANGE = (16, 8000)  # prompt token ids: clear of the demo vocabulary's special tokens
DIRECT_SALT = "serve-bench-direct"  # the HTTP pass runs as tenant "default"
OVERHEAD_TARGET = 0.10  # the issue: HTTP adds under 10% to TTFT and ITL at the lowest rate


class BenchError(RuntimeError):
    """The benchmark could not measure what it set out to (the message says which request)."""


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def short_tmpdir() -> Path:
    """A Ray temp dir of its own, short enough for Ray's socket paths (107 bytes)."""
    return Path(tempfile.mkdtemp(prefix="tsb-", dir="/tmp"))


# -- cold start ------------------------------------------------------------------------------


def post_completion(url: str, model: str) -> bool:
    """One small non-streaming completion; True iff it answered 200."""
    body = json.dumps({"model": model, "prompt": [16, 17, 18], "max_tokens": 1}).encode()
    request = urllib.request.Request(
        f"{url}/v1/completions", body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=5) as reply:
            return bool(reply.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def processes_under(path: Path) -> list[int]:
    """Pids whose command line names ``path``: the Ray processes of that temp dir."""
    needle = str(path).encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle in (entry / "cmdline").read_bytes():
                pids.append(int(entry.name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return pids


def cold_start(model_dir: Path) -> dict[str, Any]:
    """Spawn ``tandem serve``, time it to the first completion, SIGINT it, time the exit."""
    tmp = short_tmpdir()
    port = free_port("127.0.0.1")
    url = f"http://127.0.0.1:{port}"
    model = model_dir.name  # `tandem serve --model DIR` serves it under its dir's name
    env = os.environ | {
        **LOOPBACK_ENV,
        "RAY_TMPDIR": str(tmp),
    }
    cmd = [str(TANDEM), "serve", "--model", str(model_dir), "--port", str(port)]
    log(f"cold start: {' '.join(cmd)} (RAY_TMPDIR={tmp})")
    output = tmp / "serve.log"
    try:
        with output.open("wb") as sink:
            spawned = time.time()
            proc = subprocess.Popen(
                cmd, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                while not post_completion(url, model):
                    if proc.poll() is not None:
                        raise BenchError(
                            f"tandem serve exited with {proc.returncode} before serving; its "
                            f"output ends:\n{output.read_text(errors='replace')[-2000:]}"
                        )
                    if time.time() - spawned > COLD_START_TIMEOUT_S:
                        raise BenchError(
                            f"tandem serve did not answer within {COLD_START_TIMEOUT_S:.0f} s"
                        )
                    time.sleep(POLL_INTERVAL_S)
                ready_s = time.time() - spawned
                log(f"cold start: first completion after {ready_s:.1f} s; sending SIGINT")
                stopping = time.time()
                proc.send_signal(signal.SIGINT)
                code = proc.wait(timeout=SHUTDOWN_TIMEOUT_S)
                shutdown_s = time.time() - stopping
                if code != 0:
                    tail = output.read_text(errors="replace")[-2000:]
                    log(f"cold start: tandem serve exited with {code}; its output ends:\n{tail}")
                deadline = time.time() + LEFTOVER_GRACE_S
                while (left := processes_under(tmp)) and time.time() < deadline:
                    time.sleep(POLL_INTERVAL_S)
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)  # its own session: what it started
                    proc.wait()
    finally:
        for pid in processes_under(tmp):  # left behind by a shutdown that was not clean
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(tmp, ignore_errors=True)
    return {
        "spawn_to_first_completion_s": ready_s,
        "shutdown_s": shutdown_s,
        "exit_code": code,
        "processes_left": len(left),
        "clean": code == 0 and not left,
    }


# -- steady state ----------------------------------------------------------------------------


@dataclass
class Sample:
    """One request as this client saw it: when it was due, when it went, each token's arrival."""

    scheduled: float
    sent: float = 0.0
    stamps: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class Workload:
    """One rate's requests: send offsets (a Poisson process) and fresh prompts."""

    rate: float
    offsets: list[float]
    prompts: list[list[int]]


def workload(rate: float, n: int, prompt_len: int, seed: int) -> Workload:
    rng = random.Random(seed)
    offsets, t = [], 0.0
    for _ in range(n):
        offsets.append(t)
        t += rng.expovariate(rate)
    prompts = [[rng.randrange(*TOKEN_RANGE) for _ in range(prompt_len)] for _ in range(n)]
    return Workload(rate, offsets, prompts)


def request_body(model: str, prompt: list[int], output_len: int) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "logprobs": 0,
        "stream": True,
    }


class Paths:
    """The two ways in: HTTP through Serve, and a coordinator in this process."""

    def __init__(
        self,
        url: str,
        session: aiohttp.ClientSession,
        coordinator: Coordinator,
        model: str,
        params: SamplingParams,
        deadline_s: float | None,
        salt: str = DIRECT_SALT,
    ) -> None:
        self.url = url
        self.salt = salt  # the direct path's tenant: its prompts never hit another's KV
        self.session = session
        self.coordinator = coordinator
        self.model = model
        self.params = params
        self.deadline_s = deadline_s

    async def http(self, rid: str, prompt: list[int], sample: Sample) -> None:
        body = request_body(self.model, prompt, self.params.max_tokens)
        sample.sent = time.time()
        async with self.session.post(f"{self.url}/v1/completions", json=body) as reply:
            if reply.status != 200:
                text = (await reply.text())[:300]
                raise BenchError(f"{rid}: POST /v1/completions answered {reply.status}: {text}")
            async for line in reply.content:
                now = time.time()
                if not line.startswith(b"data: "):
                    continue
                data = line[len(b"data: ") :].strip()
                if data == b"[DONE]":
                    return
                chunk = json.loads(data)
                if "error" in chunk:
                    raise BenchError(f"{rid}: the stream carried an error: {chunk['error']}")
                for choice in chunk["choices"]:
                    carried = choice["logprobs"]  # None on the closing finish_reason chunk
                    sample.stamps.extend([now] * (len(carried["tokens"]) if carried else 0))
        raise BenchError(f"{rid}: the stream ended without [DONE]")

    async def direct(self, rid: str, prompt: list[int], sample: Sample) -> None:
        sample.sent = time.time()
        spec = EngineRequest(
            rid,
            tuple(prompt),
            self.params,
            cache_salt=self.salt,
            deadline=None if self.deadline_s is None else sample.sent + self.deadline_s,
            arrival_time=sample.sent,
        )
        async for delta in self.coordinator.generate(spec):
            now = time.time()
            sample.stamps.extend([now] * len(delta.token_ids))

    async def run(self, path: str, rid: str, prompt: list[int], sample: Sample) -> Sample:
        await asyncio.sleep(max(0.0, sample.scheduled - time.time()))
        await (self.http if path == "http" else self.direct)(rid, prompt, sample)
        if len(sample.stamps) != self.params.max_tokens:
            raise BenchError(
                f"{rid} ({path}): got {len(sample.stamps)} tokens, asked for "
                f"{self.params.max_tokens} with ignore_eos"
            )
        return sample

    async def run_pass(self, path: str, w: Workload, tag: str) -> list[Sample]:
        t0 = time.time() + START_DELAY_S
        return await asyncio.gather(
            *(
                self.run(path, f"{tag}-{path}-{i}", p, Sample(t0 + off))
                for i, (off, p) in enumerate(zip(w.offsets, w.prompts, strict=True))
            )
        )


def summary(path: str, rate: float, rounds: list[list[Sample]]) -> dict[str, Any]:
    """One path's figures at one rate, pooled over its passes (throughput: over their walls)."""
    samples = [s for r in rounds for s in r]
    times = [RequestTimes(arrival=s.scheduled, emits=s.stamps) for s in samples]
    ttfts = [x for t in times if (x := metrics.ttft(t)) is not None]
    itls = [x for t in times for x in metrics.itls(t)]
    tpots = [x for t in times if (x := metrics.tpot(t)) is not None]
    delays = [s.sent - s.scheduled for s in samples]
    wall = sum(max(s.stamps[-1] for s in r) - min(s.scheduled for s in r) for r in rounds)
    out: dict[str, Any] = {"path": path, "rate": rate}
    for name, xs in (("ttft", ttfts), ("itl", itls), ("tpot", tpots)):
        out |= {
            f"{name}_p50_s": metrics.percentile(xs, 50),
            f"{name}_p99_s": metrics.percentile(xs, 99),
            f"n_{name}": len(xs),
        }
    return out | {
        "output_tok_s": sum(len(s.stamps) for s in samples) / wall,
        "max_dispatch_delay_s": max(delays),
        "fell_behind": max(delays) > FELL_BEHIND_S,
    }


async def direct_coordinator(
    topology: Topology,
    model_dir: Path,
    reserve_decode: bool | None = None,
    share_prompts: bool | None = None,
) -> tuple[Coordinator, int]:
    """A coordinator over the deployment's own router and workers (looked up by name), built
    as ``tandem.launch.start_cluster`` builds the ingress's (``reserve_decode``,
    ``share_prompts``: instead of the topology's router.reserve_decode_first and
    router.share_prompts); and the model's vocabulary size."""
    router = RouterClient(ray.get_actor(ROUTER_NAME, namespace=NAMESPACE))
    workers = {
        s.name: WorkerClient(ray.get_actor(s.name, namespace=NAMESPACE)) for s in topology.workers()
    }
    infos: list[WorkerInfo] = await asyncio.gather(*(w.ready() for w in workers.values()))
    coordinator = Coordinator(
        router,
        workers,
        {i.name: i for i in infos},
        topology.model.name,
        topology.retry,
        topology.router.admission.unavailable_wait_s,
        topology.router.reserve_decode_first if reserve_decode is None else reserve_decode,
        topology.router.share_prompts if share_prompts is None else share_prompts,
    )
    return coordinator, infos[0].vocab_size


async def steady_state(
    args: argparse.Namespace, url: str, topology: Topology, model_dir: Path
) -> list[dict[str, Any]]:
    coordinator, vocab_size = await direct_coordinator(topology, model_dir)
    # The direct pass runs the very parameters the ingress derives from the HTTP body.
    body = request_body(topology.model.name, [TOKEN_RANGE[0]], args.output_len)
    params = translate.sampling_params(
        protocol.parse_completion(json.dumps(body).encode()),
        vocab_size=vocab_size,
        default_max_tokens=args.output_len,
    )
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        paths = Paths(
            url, session, coordinator, topology.model.name, params, topology.retry.deadline_s
        )
        log(f"warm-up: {WARMUP_ROUNDS} x {WARMUP_REQUESTS} requests per path")
        for r in range(WARMUP_ROUNDS):
            warm = workload(1.0, WARMUP_REQUESTS, args.prompt_len, args.seed + 1000 + r)
            warm = Workload(warm.rate, [0.0] * WARMUP_REQUESTS, warm.prompts)  # all at once
            for path in ("http", "direct"):
                await paths.run_pass(path, warm, f"warm{r}")
        rows = []
        for i, rate in enumerate(args.rates):
            rounds: dict[str, list[list[Sample]]] = {"http": [], "direct": []}
            for rnd, order in enumerate((("http", "direct"), ("direct", "http"))):
                n = args.requests // 2 + (args.requests % 2 if rnd == 0 else 0)
                w = workload(rate, n, args.prompt_len, args.seed + 2 * i + rnd)
                for path in order:
                    log(f"rate {rate:g}/s, round {rnd + 1}: {path} pass, {n} requests")
                    rounds[path].append(await paths.run_pass(path, w, f"r{i}.{rnd}"))
            rows += [summary(path, rate, rounds[path]) for path in ("http", "direct")]
    return rows


def overheads(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per rate: HTTP minus direct, TTFT p50 and ITL p50 (seconds and fraction of direct)."""
    by = {(r["rate"], r["path"]): r for r in rows}
    out = []
    for rate in dict.fromkeys(r["rate"] for r in rows):
        http, direct = by[(rate, "http")], by[(rate, "direct")]
        entry: dict[str, Any] = {"rate": rate}
        for name in ("ttft", "itl"):
            added = http[f"{name}_p50_s"] - direct[f"{name}_p50_s"]
            base = direct[f"{name}_p50_s"]
            entry |= {f"{name}_added_s": added, f"{name}_added": added / base if base else None}
        out.append(entry)
    return out


def target_met(lowest: dict[str, Any]) -> bool:
    return all(
        lowest[f"{name}_added"] is not None and lowest[f"{name}_added"] < OVERHEAD_TARGET
        for name in ("ttft", "itl")
    )


# -- report ----------------------------------------------------------------------------------


def print_report(
    cold: dict[str, Any] | None, rows: list[dict[str, Any]], over: list[dict[str, Any]]
) -> None:
    if cold is not None:
        print(
            f"\ncold start (tandem serve): spawn -> first completion "
            f"{cold['spawn_to_first_completion_s']:.1f} s; SIGINT -> exit "
            f"{cold['shutdown_s']:.1f} s (exit code {cold['exit_code']}, "
            f"{cold['processes_left']} processes left: "
            f"{'clean' if cold['clean'] else 'NOT clean'})"
        )
    ms = 1e3
    print(
        f"\n{'rate/s':>6} {'path':<6} {'TTFT p50':>9} {'p99':>7} {'n':>4} {'ITL p50':>8} "
        f"{'p99':>7} {'n':>5} {'TPOT p50':>9} {'p99':>7} {'tok/s':>7} {'dispatch':>9}"
    )
    for r in rows:
        behind = "  BEHIND" if r["fell_behind"] else ""
        print(
            f"{r['rate']:>6g} {r['path']:<6} {r['ttft_p50_s'] * ms:>8.1f}m "
            f"{r['ttft_p99_s'] * ms:>6.1f}m {r['n_ttft']:>4} {r['itl_p50_s'] * ms:>7.2f}m "
            f"{r['itl_p99_s'] * ms:>6.1f}m {r['n_itl']:>5} {r['tpot_p50_s'] * ms:>8.2f}m "
            f"{r['tpot_p99_s'] * ms:>6.2f}m {r['output_tok_s']:>7.1f} "
            f"{r['max_dispatch_delay_s'] * ms:>8.1f}m{behind}"
        )
    print("\nHTTP overhead (HTTP p50 - direct p50):")
    for o in over:
        parts = []
        for name in ("ttft", "itl"):
            frac = o[f"{name}_added"]
            pct = "n/a" if frac is None else f"{frac * 100:+.1f}%"
            parts.append(f"{name.upper()} {o[f'{name}_added_s'] * ms:+.2f} ms ({pct})")
        print(f"  rate {o['rate']:g}/s: " + ", ".join(parts))
    lowest = over[0]
    verdict = "met" if target_met(lowest) else "NOT met"
    print(
        f"target (HTTP adds < {OVERHEAD_TARGET:.0%} to TTFT and ITL p50 at the lowest rate, "
        f"{lowest['rate']:g}/s): {verdict}"
    )
    print(
        "(m = ms; latencies from each request's scheduled send time; n = samples; dispatch = the "
        f"latest send vs its schedule, BEHIND when over {FELL_BEHIND_S * ms:.0f} ms)"
    )


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.8))
    for ax, name in zip(axes, ("ttft", "itl"), strict=True):
        for p in ("http", "direct"):
            mine = [r for r in rows if r["path"] == p]
            ax.plot(
                [r["rate"] for r in mine],
                [r[f"{name}_p50_s"] * 1e3 for r in mine],
                marker="o",
                label=p,
            )
        ax.set_title(f"{name.upper()} p50")
        ax.set_xlabel("arrival rate (requests/s)")
        ax.set_ylabel("ms")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def write_topology(model_dir: Path, into: Path) -> Path:
    """``local.yaml`` with ``model.path`` = ``model_dir`` (a demo checkpoint)."""
    data = yaml.safe_load(DEFAULT_TOPOLOGY.read_text(encoding="utf-8"))
    data["model"] = {k: v for k, v in data["model"].items() if k not in ("demo_size", "builtin")}
    data["model"]["path"] = str(model_dir)  # named after the dir: demo-<size>-llama
    out = into / "topology.yaml"
    out.write_text(yaml.safe_dump(data), encoding="utf-8")
    return out


def on_local_deployment(
    model_dir: Path,
    measure: Callable[[str, Topology], Coroutine[Any, Any, list[dict[str, Any]]]],
) -> list[dict[str, Any]]:
    """``measure(url, topology)`` against ``local.yaml`` with ``model_dir``, deployed on a
    local Ray of this process's own (torn down after)."""
    tmp = short_tmpdir()
    os.environ["RAY_TMPDIR"] = str(tmp)  # this process's Ray, apart from anyone else's
    try:
        topology_path = write_topology(model_dir, tmp)
        topology = load_topology(topology_path)
        log(f"deploying {topology_path} on a local Ray")
        url = deploy(topology_path, None, "127.0.0.1", free_port("127.0.0.1"), None)
        wait_until_ready(url)
        return asyncio.run(measure(url, topology))
    finally:
        if ray.is_initialized():
            serve.shutdown()
            ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="tiny")
    ap.add_argument(
        "--rates", type=lambda s: [float(x) for x in s.split(",")], default=[0.5, 1.0, 2.0]
    )
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--no-cold-start", action="store_true", help="steady state only (a quicker rerun)"
    )
    args = ap.parse_args()
    if args.output_len < 2:
        ap.error(f"--output-len must be >= 2 for ITL and TPOT, got {args.output_len}")
    args.rates = sorted(args.rates)
    model_dir = ensure_demo_model(args.size)
    cold = None if args.no_cold_start else cold_start(model_dir)

    rows = on_local_deployment(
        model_dir, lambda url, topology: steady_state(args, url, topology, model_dir)
    )

    over = overheads(rows)
    print_report(cold, rows, over)
    RESULTS.mkdir(exist_ok=True)
    out = {
        "args": vars(args),
        "cold_start": cold,
        "passes": rows,
        "overhead": over,
        "target": {"max_added": OVERHEAD_TARGET, "rate": over[0]["rate"]},
        "target_met": target_met(over[0]),
    }
    (RESULTS / "serve_bench.json").write_text(json.dumps(out, indent=2))
    plot(rows, RESULTS / "serve_bench.png")
    log(f"wrote {RESULTS / 'serve_bench.json'} and serve_bench.png")


if __name__ == "__main__":
    main()
