"""Control-plane fault benchmark (issue 15): what each fault costs a served endpoint.

    .venv/bin/python -m bench.fault_bench --model /path/to/checkpoint \\
        [--faults router ingress decode both-decodes] [--clients 8] [--repo DIR --label NAME]

``tandem serve`` (the default topology, or ``--topology``) is started from ``--repo`` (a
checkout of some version of Tandem, default this one, run with this venv), and for each fault
in turn: ``--clients`` clients stream completions back to back (128 tokens, greedy,
``ignore_eos``) while pollers send a 1-token completion (through the router), ``GET /health``
and ``GET /v1/models`` every 100 ms each (chaos.probe.Poller); after ``--warmup-s`` the fault
is injected with SIGKILL (Ray restarts what it runs):

- ``router``: the router actor's process;
- ``ingress``: the Serve ingress replica's process (Serve starts another);
- ``decode``: one decode worker's process;
- ``both-decodes``: both decode workers' processes, at once.

The run goes on for ``--min-window-s`` after the fault (late effects: a health check failing
on a restarting dependency gets the ingress replaced seconds later), then until the poller has
seen ``--settle-s`` of answers in a row and every request started by then has ended (at most
``--max-window-s``). Per fault:

- **outage s**: time a 1-token completion sent then failed, or was not answered within 1 s
  (the completion poller's, poll to poll: it sees a router outage); **health** and **models**
  the same for ``GET /health`` (503 while nothing can serve) and ``GET /v1/models`` (the
  ingress alone answers it: it sees only the port);
- **failed**: requests that did not get all their tokens: as an HTTP error status before any
  token (with or without Retry-After), as a 200 cut by an error event, or as a connection
  broken after it was made; out of the requests of the window that reached the server;
- **refused**: connection attempts the port refused (each client tries again 100 ms later);
- **routing back**: fault to the first token of the first request sent after it.

Prints a table, writes ``bench/results/fault_bench[-LABEL].json`` and a PNG of outage and
failed requests per fault. Run it once per version (``--repo`` of an older checkout,
``--label before``) to compare.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import requests

from bench.served_bench import stop, wait_healthy
from chaos.inject import ray_processes
from chaos.load import InThread, Outcome, Sender, requests_of, send_one
from chaos.probe import Poller
from tandem.serve import wait_port_free

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
PORT = 8330
FAULTS = ("router", "ingress", "decode", "both-decodes")
# The processes each fault kills, by Ray's process title (the actor's class).
TITLES = {
    "router": ("ray::RouterActor", 1),
    "ingress": ("ServeReplica:tandem:tandem-ingress", 1),
    "decode": ("ray::DecodeWorker", 1),
    "both-decodes": ("ray::DecodeWorker", 2),
}


def log(msg: str) -> None:
    print(f"[fault_bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def body(prompt: str, max_tokens: int) -> dict[str, Any]:
    """A greedy streamed completion of exactly ``max_tokens`` tokens (``logprobs: 0`` counts
    them: chaos.load)."""
    return {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "logprobs": 0,
    }


def complete(o: Outcome, max_tokens: int) -> bool:
    """Whether ``o`` got every token it asked for, with no error."""
    return o.status == "ok" and o.num_tokens >= max_tokens


def inject(fault: str, server_pid: int) -> list[int]:
    title, count = TITLES[fault]
    pids = ray_processes(title, server_pid)[:count]
    if len(pids) < count:
        raise RuntimeError(f"{fault}: found {pids} for {title!r}")
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    return pids


def run_fault(url: str, fault: str, server_pid: int, a: argparse.Namespace) -> dict[str, Any]:
    prompt = "The control plane survives its own faults. " * 4
    model = Path(a.model).name  # tandem serve names the model after its directory

    def bodies() -> Iterator[dict[str, Any]]:
        while True:
            yield body(prompt, a.max_tokens)

    sender = Sender(url, model, hang_bound_s=300.0)
    load = InThread(sender, requests_of(bodies()), a.clients, a.max_window_s + a.warmup_s)
    poller = Poller(url, model)
    completions = poller.polls["completion"]
    time.sleep(a.warmup_s)
    fault_at = time.time()
    pids = inject(fault, server_pid)
    log(f"{fault}: killed {pids}")
    # At least --min-window-s (a fault's effects can come late: a health check that fails on
    # a restarting dependency gets the ingress replaced seconds after), then until the port
    # has answered completions for --settle-s in a row.
    while time.time() - fault_at < a.max_window_s:
        time.sleep(0.5)
        if time.time() - fault_at < a.min_window_s:
            continue
        since = time.time() - a.settle_s
        recent = [g for t, g in zip(completions.sent, completions.good, strict=False) if t > since]
        if recent and all(recent) and completions.sent[0] < since:
            break
    outcomes = load.join(timeout_s=300)
    polls = poller.stop()
    after = [o.first_token for o in outcomes if (o.sent or 0) > fault_at and o.first_token]
    sent = [o for o in outcomes if not o.refused]
    failed = [o for o in sent if not complete(o, a.max_tokens)]
    # Failed before any token with an HTTP status; cut after the 200 (an error event, or too
    # few tokens); or the connection broken (no status, no typed error).
    before_token = [o for o in failed if o.http_status is not None]
    connection = [
        o for o in failed if o.status == "error" and o.http_status is None and o.error_type is None
    ]
    return {
        "fault": fault,
        "requests": len(sent),
        "refused_connections": len(outcomes) - len(sent),
        "failed": len(failed),
        "failed_status_before_token": len(before_token),
        "failed_with_retry_after": sum(o.retry_after is not None for o in failed),
        "failed_cut_after_200": len(failed) - len(before_token) - len(connection),
        "failed_connection": len(connection),
        "outage_s": round(polls["completion"].outage_s(fault_at), 2),
        "health_outage_s": round(polls["health"].outage_s(fault_at), 2),
        "models_outage_s": round(polls["models"].outage_s(fault_at), 2),
        "polls": {
            path: {
                "answered": p.answered,
                "refused": p.refused,
                "server_errors": p.server_errors,
                "slow": p.slow,
                "bad_after_fault": p.bad(fault_at),
            }
            for path, p in polls.items()
        },
        "routing_back_s": round(min(after) - fault_at, 2) if after else None,
        "window_s": round(time.time() - fault_at, 1),
        "errors": sorted({o.error or f"{o.num_tokens} of {a.max_tokens} tokens" for o in failed})[
            :5
        ],
    }


def wait_serving(url: str, model: str, timeout_s: float = 300.0) -> None:
    """Until the endpoint answers a short completion (all restarted after the last fault)."""
    until = time.time() + timeout_s
    while time.time() < until:
        if complete(send_one(url, model, body("ready?", 4)), 4):
            try:
                if requests.get(f"{url}/health", timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass
        time.sleep(1.0)
    raise TimeoutError(f"{url} did not serve again within {timeout_s:.0f} s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--topology", default=None, help="default: the repo's local.yaml")
    p.add_argument("--faults", nargs="+", choices=FAULTS, default=list(FAULTS))
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--warmup-s", type=float, default=5.0)
    p.add_argument("--settle-s", type=float, default=5.0)
    p.add_argument("--min-window-s", type=float, default=30.0)
    p.add_argument("--max-window-s", type=float, default=240.0)
    p.add_argument("--repo", default=str(ROOT), help="the Tandem checkout to serve from")
    p.add_argument("--label", default="after")
    a = p.parse_args()

    repo = Path(a.repo).resolve()
    env = {
        **os.environ,
        "PYTHONPATH": str(repo),  # the Ray workers import the same version as the driver
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_AUTH_MODE": "disabled",
    }
    cmd = [sys.executable, "-m", "tandem.cli", "serve", "--model", a.model, "--port", str(PORT)]
    if a.topology:
        cmd += ["--topology", a.topology]
    url = f"http://127.0.0.1:{PORT}"
    wait_port_free("127.0.0.1", PORT, 180.0)  # a server still stopping would answer instead
    log(f"starting {' '.join(cmd)} in {repo}")
    proc = subprocess.Popen(cmd, cwd=repo, env=env)
    rows = []
    try:
        wait_healthy(PORT, proc, 600)
        for fault in a.faults:
            wait_serving(url, Path(a.model).name)
            log(f"{fault}: {a.clients} clients, fault after {a.warmup_s:.0f} s")
            row = run_fault(url, fault, proc.pid, a)
            log(json.dumps(row))
            rows.append(row)
    finally:
        stop(proc)
    report(rows, a.label, {**vars(a), "repo": str(repo)})


def report(rows: list[dict[str, Any]], label: str, args: dict[str, Any]) -> None:
    head = f"{'fault':<14}{'outage s':>9}{'health':>7}{'models':>7}{'failed':>8}{'of':>5}"
    head += f"{'status':>8}{'cut':>5}"
    head += f"{'conn':>6}{'refused':>9}{'routing back s':>16}"
    print(f"\nTandem ({label}): SIGKILL per fault, {args['clients']} streaming clients")
    print(head)
    for r in rows:
        back = "-" if r["routing_back_s"] is None else f"{r['routing_back_s']:.2f}"
        print(
            f"{r['fault']:<14}{r['outage_s']:>9.1f}{r['health_outage_s']:>7.1f}"
            f"{r['models_outage_s']:>7.1f}{r['failed']:>8}{r['requests']:>5}"
            f"{r['failed_status_before_token']:>8}{r['failed_cut_after_200']:>5}"
            f"{r['failed_connection']:>6}{r['refused_connections']:>9}{back:>16}"
        )
    RESULTS.mkdir(parents=True, exist_ok=True)
    name = f"fault_bench-{label}"
    (RESULTS / f"{name}.json").write_text(json.dumps({"args": args, "rows": rows}, indent=2))
    plot(rows, label, RESULTS / f"{name}.png")


def plot(rows: list[dict[str, Any]], label: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    faults = [r["fault"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.bar(faults, [r["outage_s"] for r in rows], color="tab:red")
    left.set_ylabel("outage (s): a 1-token completion failed or > 1 s")
    right.bar(faults, [r["failed"] for r in rows], color="tab:orange", label="failed")
    right.bar(faults, [r["requests"] - r["failed"] for r in rows], bottom=[r["failed"] for r in rows],
              color="tab:green", label="complete")  # fmt: skip
    right.set_ylabel("requests in the window")
    right.legend()
    fig.suptitle(f"Tandem ({label}): one SIGKILL per fault")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
