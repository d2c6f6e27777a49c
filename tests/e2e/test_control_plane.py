"""The control plane's own faults, through the real endpoint under load (issue 15,
docs/design.md#control-plane): the router actor killed (Ray's kill and SIGKILL of its
process), the ingress replica's process killed, both decode workers killed, a decode worker
killed with the retry budget spent, a worker gone for good -- and what ``/health``,
``/v1/cluster`` and ``/metrics`` say meanwhile.

One prefill and two decode workers; the retry budget is empty (``budget_burst: 0``), so any
failed attempt before a first token would show as a 503: the router and ingress kills must
fail none, and a started stream must migrate without the budget. Every completed answer is
compared, token ids and top-5 logprobs, with an engine outside the cluster on the same bf16
checkpoint (chaos.reference): no token lost, repeated or changed. A poller sends
``GET /v1/models``, ``GET /health`` and a 1-token completion (through the router) every 100 ms
throughout (chaos.probe.Poller) and reports each.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import requests

from chaos.inject import ray_processes
from chaos.load import InThread, Outcome, Sender, requests_of, send_one
from chaos.probe import Poller, Polls, metric, wait_all_up
from chaos.reference import Expected, expected, reference_engine
from chaos.verdict import mismatch
from contracts.actors import RouterClient
from contracts.roles import NAMESPACE, ROUTER_NAME
from engine import kernels
from engine.engine import LLMEngine
from router.actor import RESTARTED_UNSEEN
from tandem.topology import load_topology

pytestmark = pytest.mark.e2e
MODEL = "test-llama"
MAX_TOKENS = 48
ENGINE = {"kv_cache_bytes": 4 * 2**20, "max_num_seqs": 8, "max_num_batched_tokens": 256}
TOPOLOGY = """
model: {{path: {path}, name: test-llama, dtype: bfloat16}}
domains: [a, b]
pools:
  prefill: {{replicas: 1, num_cpus: 0.5, engine: {engine}}}
  decode: {{replicas: 2, num_cpus: 0.5, engine: {engine}}}
transport: grpc
router:
  local_prefill_max_tokens: 0
  admission: {{unavailable_wait_s: 10, holder_timeout_s: 3}}
retry: {{max_attempts: 4, budget_ratio: 0.0, budget_burst: 0.0, backoff_s: 0.0}}
heartbeat_interval_s: 0.2
heartbeat_timeout_s: 2.0
"""
PROMPTS = [f"control plane {i}: " + "word " * (8 * i) for i in range(4)]
CACHED = "a long shared prefix the prefill worker keeps in its cache " * 4


@pytest.fixture(scope="module")
def topology(bf16_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("control") / "topology.yaml"
    path.write_text(TOPOLOGY.format(path=bf16_llama, engine=ENGINE))
    return path


@pytest.fixture(scope="module")
def server(serve_app: Callable[[Path], str], topology: Path) -> str:
    return serve_app(topology)


def body(prompt: str, max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    return {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "logprobs": 5,
        "return_tokens_as_token_ids": True,  # compared by id with the engine's
    }


def router() -> RouterClient:
    return RouterClient(ray.get_actor(ROUTER_NAME, namespace=NAMESPACE))


@pytest.fixture(scope="module")
def engine(topology: Path, bf16_llama: Path) -> LLMEngine:
    """An engine outside the cluster on the same checkpoint and dtype: the reference."""
    return reference_engine(load_topology(topology), bf16_llama)


@pytest.fixture(scope="module")
def reference(engine: LLMEngine, server: str) -> dict[str, list[Expected]]:
    """Each prompt's fault-free answer (token ids, logprobs, text), from the engine."""
    answers = expected(engine, [(body(p), None) for p in PROMPTS])
    return dict(zip(PROMPTS, answers, strict=True))


def stream(server: str, prompt: str, max_tokens: int = MAX_TOKENS) -> Outcome:
    return send_one(server, MODEL, body(prompt, max_tokens))


def answered(o: Outcome) -> bool:
    """Whether the server answered ``o`` (complete, or with an HTTP status)."""
    return o.status == "ok" or o.http_status is not None


class Load:
    """``clients`` clients sending streams back to back (bounded in count and time)."""

    def __init__(self, server: str, clients: int, max_each: int = 100) -> None:
        self.prompts = [PROMPTS[n % len(PROMPTS)] for n in range(clients * max_each)]
        sender = Sender(server, MODEL, hang_bound_s=120.0)
        self.load = InThread(sender, requests_of(body(p) for p in self.prompts), clients)

    def outcomes(self) -> list[Outcome]:
        return self.load.outcomes()

    def join(self) -> list[tuple[str, Outcome]]:
        """Each request's prompt and outcome."""
        return [(self.prompts[o.index], o) for o in self.load.join(timeout_s=180)]


@pytest.fixture
def poller(server: str) -> Iterator[Poller]:
    p = Poller(server, MODEL)
    yield p
    p.stop()


def summary(polls: dict[str, Polls], since: float) -> str:
    """Each poller's figures since a fault, a line (printed for the closing notes)."""
    return "; ".join(
        f"{path}: {p.answered} answered, {p.refused} refused, {p.server_errors} errors, "
        f"{p.slow} slow, outage {p.outage_s(since):.2f} s"
        for path, p in polls.items()
    )


def cluster(server: str) -> dict[str, Any]:
    r = requests.get(f"{server}/v1/cluster", timeout=10)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def assert_exact(outcomes: list[tuple[str, Outcome]], reference: dict[str, list[Expected]]) -> None:
    """Every outcome a complete answer equal to the engine's: token ids, logprobs, text."""
    bad = [
        (o.index, o.status, o.error, mismatch(o, reference[p]))
        for p, o in outcomes
        if o.status != "ok" or mismatch(o, reference[p])
    ]
    assert not bad, bad[:3]


def test_health_and_the_router_view_at_full_capacity(
    server: str, reference: dict[str, list[Expected]]
) -> None:
    assert_exact([(p, stream(server, p)) for p in PROMPTS], reference)  # (their blocks cached)
    r = requests.get(f"{server}/health", timeout=10)
    assert (r.status_code, r.json()) == (
        200,
        {"status": "ok", "workers": 3, "down": [], "capacity": 1.0},
    )
    view = cluster(server)
    assert [(w["name"], w["role"], w["domain"], w["state"]) for w in view["workers"]] == [
        ("prefill-0", "prefill", "a", "up"),
        ("decode-0", "decode", "a", "up"),
        ("decode-1", "decode", "b", "up"),
    ]
    assert view["status"] == "ok" and view["retry_budget_tokens"] == 0.0
    assert view["admission_queue"] == {"waiting": 0, "most_waiting": 0}
    assert view["workers"][0]["cached_blocks"] > 0  # the reference prompts' blocks
    # Every worker computes the same bits (one class: docs/design.md#numerics-classes).
    layout = kernels.invariant_layouts()[0]
    assert {w["numerics"] for w in view["workers"]} == {f"bfloat16/invariant/{layout}"}
    out = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "status", "--url", server],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split() == [
        "worker", "role", "domain", "state", "running", "queued", "kv", "used", "cached", "blocks",
    ]  # fmt: skip
    assert [line.split()[:4] for line in lines[1:4]] == [
        ["prefill-0", "prefill", "a", "up"],
        ["decode-0", "decode", "a", "up"],
        ["decode-1", "decode", "b", "up"],
    ]
    assert lines[4].startswith("status: ok; admission queue: 0 waiting")


def router_hits(prompt: str, server: str) -> int:
    """Serve ``prompt``; the prefix-cache blocks the router credited its prefill worker."""
    r = requests.post(
        f"{server}/v1/completions", json={"model": MODEL, **body(prompt, 4)}, timeout=60
    )
    assert r.status_code == 200, r.text
    last = ray.get(router().decisions(), timeout=30)[-1]
    return int(last["hit_blocks"])


def credited_soon(server: str, timeout_s: float = 10.0) -> bool:
    """Whether a request with ``CACHED``'s prefix is credited its cache within ``timeout_s``
    (the worker's report of the blocks, or its resync to a new router, is asynchronous)."""
    until = time.time() + timeout_s
    n = 0
    while time.time() < until:
        n += 1
        if router_hits(f"{CACHED}{n} {time.time()}", server) > 0:
            return True
        time.sleep(0.2)
    return False


@pytest.mark.parametrize("how", ["ray.kill", "SIGKILL"])
def test_a_router_kill_under_load_fails_no_request_and_refuses_no_connection(
    server: str, reference: dict[str, list[Expected]], poller: Poller, how: str
) -> None:
    """Ray restarts the router; the workers resync to it; requests routed meanwhile wait.
    No request fails, none changes, the port never refuses, and the prefix cache is credited
    again after the restart (rebuilt from the resyncs)."""
    assert credited_soon(server)
    load = Load(server, clients=8)
    time.sleep(1.5)
    killed_at = time.time()
    if how == "ray.kill":
        ray.kill(ray.get_actor(ROUTER_NAME, namespace=NAMESPACE), no_restart=False)
    else:
        (pid,) = ray_processes("ray::RouterActor", os.getpid())
        os.kill(pid, signal.SIGKILL)
    until = killed_at + 60
    while not any((o.sent or 0) > killed_at and answered(o) for o in load.outcomes()):
        assert time.time() < until, "nothing sent after the kill was answered"
        time.sleep(0.1)  # (a request sent after the kill has been answered: routing is back)
    time.sleep(1.0)
    outcomes = load.join()
    assert_exact(outcomes, reference)
    polls = poller.stop()
    print(summary(polls, killed_at))
    models, health, completion = (polls[path] for path in Poller.PATHS)
    assert (models.refused, models.bad(), health.refused) == (0, 0, 0) and models.answered > 20
    # Through the router: every 1-token completion sent meanwhile waited and was answered.
    assert (completion.refused, completion.server_errors) == (0, 0), summary(polls, killed_at)
    assert completion.answered > 5
    assert credited_soon(server)  # the index rebuilt from the resyncs


def test_a_worker_killed_while_the_router_restarts_is_failed_once_the_router_answers(
    server: str,
) -> None:
    """No detector runs while the router restarts, and the new router has no view of the
    workers: its first look reads Ray's actor table, so decode-1, killed meanwhile (Ray
    restarting it -- or already restarted, when decode-1 tells the new router so itself), is
    FAILED within a second of the router answering -- not left `starting` until it returns --
    no live worker is blamed (they reach the new router up to ~3 s after it answers, so the
    look's silence rule waits at least 5 s), and decode-1 comes back through its health check."""
    wait_all_up(server)
    decode = ray.get_actor("decode-1", namespace=NAMESPACE)
    decode_pid = ray.get(decode.__ray_call__.remote(lambda _: os.getpid()), timeout=30)
    (router_pid,) = ray_processes("ray::RouterActor", os.getpid())
    os.kill(router_pid, signal.SIGKILL)
    os.kill(decode_pid, signal.SIGKILL)
    until = time.time() + 60
    while True:  # the new router answering
        try:
            ray.get(router().key(), timeout=0.5)
            break
        except (ray.exceptions.RayError, TimeoutError):
            assert time.time() < until, "the router never came back"
    answered_at = time.time()
    failed: list[dict[str, Any]] = []
    while not failed and time.time() < answered_at + 10:
        events = ray.get(router().health_events(), timeout=10)
        failed = [e for e in events if e["worker"] == "decode-1" and e["event"] == "failed"]
        time.sleep(0.05)
    assert failed, f"the new router never marked decode-1 FAILED: {events}"
    print(f"decode-1 FAILED {failed[0]['at'] - answered_at:.2f} s after the router answered")
    assert failed[0]["at"] - answered_at < 1.0, failed[0]
    # From Ray's table, or from decode-1 itself if Ray restarted it before the table was read.
    why = failed[0]["why"]
    assert why.startswith("Ray is restarting its actor") or why == RESTARTED_UNSEEN, failed[0]
    assert not [e for e in events if e["event"] == "failed" and e["worker"] != "decode-1"]
    wait_all_up(server)


def test_the_ingress_replica_killed_comes_back_on_its_port_with_the_same_cluster(
    server: str, reference: dict[str, list[Expected]], poller: Poller
) -> None:
    """SIGKILL of the ingress replica's process under load: Serve starts another, which
    attaches to the running cluster (same actors, caches kept) and answers on the same port
    within seconds. Requests the dead replica held are cut (their connections are gone)."""
    names = ["prefill-0", "decode-0", "decode-1", ROUTER_NAME]
    ids = {n: ray.get_actor(n, namespace=NAMESPACE)._actor_id.hex() for n in names}
    cached = cluster(server)["workers"][0]["cached_blocks"]
    load = Load(server, clients=4)
    time.sleep(1.0)
    (pid,) = ray_processes("ServeReplica:tandem:tandem-ingress", os.getpid())
    killed_at = time.time()
    os.kill(pid, signal.SIGKILL)
    until = killed_at + 30
    while True:  # answering again: a request served end to end by the new replica
        o = stream(server, PROMPTS[0])
        if o.status == "ok":
            break
        assert time.time() < until, o
        time.sleep(0.1)
    back_in = time.time() - killed_at
    time.sleep(2.0)  # the clients' requests reach the new replica
    outcomes = load.join()
    polls = poller.stop()
    print(f"back in {back_in:.2f} s; {summary(polls, killed_at)}")
    # A liveness bound, not a speed goal (the chaos report's `lasted` measures it): a dead
    # replica noticed at the next 1 s health check, a new one started on two busy cores.
    assert back_in < 20.0, f"the port answered again after {back_in:.1f} s"
    # The load: what reached a server completed exactly, except what the dead replica held
    # (open at the kill, or sent as it died: cut with the connection, untyped).
    served = [(p, o) for p, o in outcomes if not o.refused]
    cut = [o for _, o in served if o.status != "ok"]
    assert all(o.status == "error" and o.error_type is None for o in cut), cut
    # (open at the kill, or sent into the dying replica's socket before the port was back)
    assert all((o.sent or 0) <= killed_at + back_in and killed_at <= (o.finished or 0) for o in cut)
    assert len(cut) <= 8, cut
    assert_exact([(p, o) for p, o in served if o.status == "ok"], reference)
    assert any((o.sent or 0) > killed_at + back_in for _, o in served if o.status == "ok")
    assert len([o for _, o in outcomes if o.refused]) > 0  # (sent while nothing listened)
    # The pollers saw the port go (refused: the replica serves it) and come back on all three.
    models, health, completion = (polls[path] for path in Poller.PATHS)
    assert models.refused > 0 and models.outage_s(killed_at) < back_in + 1.0
    assert all(models.good[-5:]) and all(health.good[-5:]) and completion.good[-1]
    assert completion.outage_s(killed_at) >= models.outage_s(killed_at) - 0.5
    # The dead replica's grants (held by its coordinator, which stopped renewing) are released
    # after holder_timeout_s: the tenant's in-flight count, which orders the queue, is not leaked.
    until = time.time() + 15
    while (held := ray.get(router().grants(), timeout=30)) != {}:
        assert time.time() < until, f"grants of the dead replica still held: {held}"
        time.sleep(0.2)
    assert mismatch(o, reference[PROMPTS[0]]) is None
    assert {n: ray.get_actor(n, namespace=NAMESPACE)._actor_id.hex() for n in names} == ids
    assert cluster(server)["workers"][0]["cached_blocks"] >= cached
    assert router_hits(CACHED + "again", server) > 0  # credited at once: same router
    assert_exact([(p, stream(server, p)) for p in PROMPTS], reference)


def test_both_decode_workers_killed_requests_wait_or_get_a_status_before_any_header(
    server: str, reference: dict[str, list[Expected]]
) -> None:
    """Both decode workers die (Ray restarts them). A stream with tokens migrates once a
    decode worker is back and completes exactly; a request without tokens waits and completes,
    or -- the retry budget being empty -- is refused with 503 and Retry-After as its HTTP
    status. Never a 200 cut by an error event."""
    wait_all_up(server)
    load = Load(server, clients=6)
    time.sleep(1.5)
    for name in ("decode-0", "decode-1"):
        ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=False)
    time.sleep(2.0)
    wait_all_up(server)
    time.sleep(2.0)
    outcomes = load.join()
    refused = [o for _, o in outcomes if o.http_status == 503]
    assert all(o.retry_after == "5" for o in refused), refused[:3]
    assert_exact([(p, o) for p, o in outcomes if o.http_status != 503], reference)
    assert len(refused) < len(outcomes) / 2


def test_with_the_retry_budget_spent_every_started_stream_migrates(
    server: str, engine: LLMEngine
) -> None:
    """The budget is empty, yet every stream that has tokens when its decode worker is killed
    migrates to the other one and completes token-exact: the budget limits retries before a
    first token, never the rescue of a started stream."""
    wait_all_up(server)
    n = 2000
    [long_ref] = expected(engine, [(body(PROMPTS[1], n), None)])
    before = len(ray.get(router().decisions(), timeout=30))
    load = InThread(
        Sender(server, MODEL, hang_bound_s=180.0), requests_of([body(PROMPTS[1], n)] * 4)
    )
    time.sleep(1.0)  # all four are streaming
    serving = [d["decode"] for d in ray.get(router().decisions(), timeout=30)[before:]]
    busiest = max(set(serving), key=serving.count)
    ray.kill(ray.get_actor(busiest, namespace=NAMESPACE), no_restart=False)
    results = load.join(timeout_s=190)
    assert [(o.status, o.error) for o in results] == [("ok", None)] * 4
    assert [mismatch(o, long_ref) for o in results] == [None] * 4
    decisions = ray.get(router().decisions(), timeout=30)[before:]
    migrated = [d for d in decisions if d["request_id"].endswith("@2")]
    assert migrated and {d["decode"] for d in migrated} == {"decode-0", "decode-1"} - {busiest}
    assert metric(server, "tandem_retry_budget_tokens") == [0.0]


def test_a_worker_gone_for_good_is_reported_down_then_nothing_can_serve(server: str) -> None:
    """Last (it kills both decode workers for good). One gone: /health 200 degraded naming it
    with half the decode slots; ``tandem_worker_up`` 0 and its load gauges gone; requests are
    still served. Both gone: /health 503 with Retry-After, and a request waits
    ``unavailable_wait_s`` then gets 503 + Retry-After as its status."""
    wait_all_up(server)
    assert metric(server, "tandem_worker_up", worker="decode-1") == [1.0]
    ray.kill(ray.get_actor("decode-1", namespace=NAMESPACE), no_restart=True)
    until = time.time() + 30
    while (r := requests.get(f"{server}/health", timeout=10)).json()["status"] == "ok":
        assert time.time() < until
        time.sleep(0.2)
    assert (r.status_code, r.json()) == (
        200,
        {"status": "degraded", "workers": 3, "down": ["decode-1"], "capacity": 0.5},
    )
    assert metric(server, "tandem_worker_up", worker="decode-1") == [0.0]
    assert metric(server, "tandem_kv_usage_ratio", worker="decode-1") == []
    assert len(metric(server, "tandem_kv_usage_ratio", worker="decode-0")) == 1
    assert stream(server, PROMPTS[2]).status == "ok"
    ray.kill(ray.get_actor("decode-0", namespace=NAMESPACE), no_restart=True)
    until = time.time() + 30
    while (r := requests.get(f"{server}/health", timeout=10)).status_code == 200:
        assert time.time() < until
        time.sleep(0.2)
    assert (r.status_code, r.headers["Retry-After"], r.json()) == (
        503,
        "5",
        {"status": "unavailable", "workers": 3, "down": ["decode-0", "decode-1"], "capacity": 0.0},
    )
    start = time.time()
    o = stream(server, PROMPTS[2])
    assert (o.http_status, o.retry_after, o.error_type) == (503, "5", "no_replica_available")
    assert 10.0 <= time.time() - start < 20.0
