"""Tandem on a multi-host test bed (issue 17), as a user runs it: ``ray up
deploy/cluster-testbed.yaml`` on three hosts (network namespaces with their own addresses,
tandem/testbed.py), ``tandem serve --address`` on the head over SSH with
deploy/topologies/testbed.yaml (prefill-0 on host a, prefill-1 and decode-0 on b, decode-1 on c),
and the official ``openai`` client (chaos.load) in this machine's own namespace, across the
bed's bridge.
Then whole hosts die, are partitioned and come back.

Every answer is compared with an engine in this process on the same checkpoint (bf16, the same
seeds): text and every logprob equal, after migrations and retries too. Ray's own view (its node
table, its actors) is read by a driver on the head host.

The tests run in order on one cluster; each leaves it whole again (hosts revived, Ray nodes
restarted, every worker up). CI runs them all (about 4 minutes with the bed's other tests);
``make test-bed`` runs only the bed's.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests

from chaos.load import InThread, Outcome, Sender, requests_of
from chaos.probe import metric, wait_all_up, worker_states
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.sampling_params import SamplingParams
from tandem import testbed
from tandem.launch import model_dir_of
from tandem.testbed import Testbed
from tandem.topology import load_topology

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
TOPOLOGY = REPO / "deploy" / "topologies" / "testbed.yaml"
HEAD = "10.213.0.1"
URL = f"http://{HEAD}:8000"
HOST_OF = {
    "prefill-0": HEAD,
    "prefill-1": "10.213.0.2",
    "decode-0": "10.213.0.2",
    "decode-1": "10.213.0.3",
}
WORKERS = list(HOST_OF)
HEARTBEAT_TIMEOUT_S = load_topology(TOPOLOGY).heartbeat_timeout_s
# Silence counts from the last heartbeat, which is up to ~0.6 s before the fault (a report at
# least every 0.55 s), the router checks every 0.25 s and these tests poll every 0.1 s over HTTP,
# all on two cores busy with the load: 1 s of margin failed at 6.05 s here.
DETECT_MARGIN_S = 2.0
LEASE_TIMEOUT_S = load_topology(TOPOLOGY).lease_timeout_s


def prompt_ids(i: int) -> list[int]:
    """Request ``i``'s prompt: 96 tokens, longer than the router's local_prefill_max_tokens,
    so a prefill worker computes it and ships its KV to a decode worker."""
    return [(17 * i + 31 * k) % 4000 + 50 for k in range(96)]


def the_bed() -> Testbed:
    bed = testbed.load()
    assert bed is not None, "no test bed is up"
    return bed


def on_head(code: str) -> Any:
    """``code`` in a Ray driver on the bed's head host (testbed.on_head)."""
    return testbed.on_head(the_bed(), code)


def ask_router(method: str) -> Any:
    return testbed.ask_router(the_bed(), method)


RAY_VIEW = """
from ray.util.state import list_actors
nodes = {n['NodeID']: n for n in ray.nodes()}
alive = {}
for n in ray.nodes():
    alive[n['NodeManagerAddress']] = alive.get(n['NodeManagerAddress'], False) or n['Alive']
actors = {}
gcs = ray.get_runtime_context().gcs_address  # not the other Ray instances this machine runs
for a in list_actors(address=gcs, filters=[('ray_namespace', '=', 'tandem')], detail=True):
    if a.state != 'DEAD' and a.name:
        node = nodes.get(a.node_id) or {}
        actors[a.name] = [a.state, node.get('NodeManagerAddress'),
                          (node.get('Labels') or {}).get('tandem/failure-domain')]
reply({'alive': alive, 'actors': actors})
"""

POOLS = """
out = {}
for name in %r:
    s = ray.get(ray.get_actor(name, namespace='tandem').check_idle.remote(), timeout=60)
    out[name] = {'cached': s.cached_blocks, 'in_use': s.in_use_blocks,
                 'reserved': s.reserved_blocks, 'free': s.free_blocks, 'total': s.total_blocks}
reply(out)
"""


def ray_view() -> dict[str, Any]:
    return on_head(RAY_VIEW)  # type: ignore[no-any-return]


def pools(names: list[str]) -> dict[str, dict[str, int]]:
    """P1 on each worker (``check_idle`` raises unless its pool is at baseline): its counts."""
    return on_head(POOLS % (names,))  # type: ignore[no-any-return]


def credited() -> dict[str, int]:
    """The router's prefix index: blocks it credits each worker with."""
    r = requests.get(f"{URL}/v1/cluster", timeout=10)
    r.raise_for_status()
    return {w["name"]: w["cached_blocks"] for w in r.json()["workers"]}


def decisions() -> list[dict[str, Any]]:
    return ask_router("decisions")  # type: ignore[no-any-return]


def arm(worker: str, *faults: str) -> None:
    """Arm ``worker`` with ``faults`` (contracts.faults expressions); none: disarm it."""
    code = "from contracts.faults import Fault, FaultAction, FaultPlan, FaultPoint\n"
    code += f"plan = FaultPlan([{', '.join(faults)}])\n"
    code += f"ray.get(ray.get_actor('{worker}', namespace='tandem').set_faults.remote(plan))\n"
    code += "reply(None)\n"
    on_head(code)


def health_events() -> list[dict[str, Any]]:
    """The router's log of health transitions (failed / checked / up), oldest first."""
    return ask_router("health_events")  # type: ignore[no-any-return]


@dataclass
class Served:
    """The bed, and the SSH session running ``tandem serve`` on its head."""

    bed: Testbed
    proc: subprocess.Popen[bytes]


@pytest.fixture(scope="module")
def cluster(bed: Testbed) -> Iterator[Served]:
    testbed.ray_up(bed.cluster_file)
    served = Served(bed, testbed.serve_on_head(bed, TOPOLOGY))
    yield served
    testbed.stop_serving(bed, served.proc)
    testbed.ray_down(bed.cluster_file)


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    """The reference: the served checkpoint in this process, deterministic as served."""
    topology = load_topology(TOPOLOGY)
    return LLMEngine.from_checkpoint(
        model_dir_of(topology),
        EngineConfig(dtype=topology.model.dtype, kv_cache_bytes=64 * 2**20),
        model_id=topology.model.name,
    )


@pytest.fixture(scope="module")
def url(cluster: Served) -> str:  # noqa: ARG001  (it must be serving)
    return URL


def params(i: int, max_tokens: int) -> SamplingParams:
    """Greedy for even ``i``, seeded sampling for odd."""
    if i % 2 == 0:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    return SamplingParams(
        temperature=0.8, seed=i, max_tokens=max_tokens, ignore_eos=True, logprobs=0
    )


def body(i: int, max_tokens: int) -> dict[str, Any]:
    """Request ``i``, streamed, with its tokens' logprobs."""
    p = params(i, max_tokens)
    return {
        "prompt": prompt_ids(i),
        "max_tokens": max_tokens,
        "temperature": p.temperature,
        "seed": p.seed,
        "logprobs": 0,
        "ignore_eos": True,
    }


def assert_reference(engine: LLMEngine, i: int, max_tokens: int, answer: Outcome) -> None:
    [[want]] = engine.generate([prompt_ids(i)], params(i, max_tokens))
    assert answer.status == "ok", f"request {i}: {answer.status} {answer.error}"
    assert answer.text == want.text, f"request {i}: text differs"
    got = answer.choices[0].token_logprobs
    assert got == [lp.logprob for lp in want.logprobs or []], f"request {i}"


class Load:
    """``n`` streams of ``max_tokens`` each, sent at once (chaos.load)."""

    def __init__(self, url: str, n: int, max_tokens: int, first: int = 0) -> None:
        self.max_tokens = max_tokens
        self.ids = list(range(first, first + n))
        sender = Sender(url, load_topology(TOPOLOGY).model.name, hang_bound_s=120.0)
        self.load = InThread(sender, requests_of(body(i, max_tokens) for i in self.ids))

    def wait_streaming(self, chunks: int, timeout_s: float = 60.0) -> None:
        """Until every stream has had ``chunks`` chunks with tokens."""
        until = time.time() + timeout_s
        while (
            len(outcomes := self.load.outcomes()) < len(self.ids)
            or min(len(o.token_times) for o in outcomes) < chunks
        ):
            assert time.time() < until, "the streams did not start"
            time.sleep(0.02)

    def join(self, timeout_s: float = 120.0) -> list[Outcome]:
        return self.load.join(timeout_s)

    def assert_reference(self, engine: LLMEngine) -> None:
        for i, answer in zip(self.ids, self.join(), strict=True):
            assert_reference(engine, i, self.max_tokens, answer)


def routed_exactly(url: str, engine: LLMEngine, first: int) -> list[dict[str, Any]]:
    """Four short requests, each equal to the engine's; the router's decisions for them."""
    marked = len(decisions())
    load = Load(url, 4, 8, first=first)
    load.join()
    load.assert_reference(engine)
    return decisions()[marked:]


def watch_states(until_s: float) -> list[tuple[float, dict[str, str]]]:
    """The router's worker states, polled every 100 ms for ``until_s``: (time, states) at
    each change."""
    seen: list[tuple[float, dict[str, str]]] = []
    end = time.time() + until_s
    while time.time() < end:
        try:
            now = worker_states(URL)
        except OSError:  # urllib's errors, a timeout
            now = {}
        if now and (not seen or seen[-1][1] != now):
            seen.append((time.time(), now))
        time.sleep(0.1)
    return seen


def first_time(seen: list[tuple[float, dict[str, str]]], name: str, state: str) -> float:
    return next(t for t, s in seen if s.get(name) == state)


def bring_back(bed: Testbed, host: testbed.Host) -> None:
    """A dead host rebooted: its sshd, then its Ray node (the cluster file's commands)."""
    testbed.revive_host(bed, host)
    testbed.restart_ray_node(bed, host)
    wait_all_up(URL)


# -- the tests, in order ---------------------------------------------------------------------


def test_workers_land_on_their_domains_hosts_and_answer_as_the_engine(
    cluster: Served, url: str, engine: LLMEngine
) -> None:
    """Placement follows the node labels (Ray's own node table); prefill and decode on other
    hosts (KV over gRPC across the bridge) give the engine's tokens and logprobs."""
    view = ray_view()
    assert view["alive"] == {HEAD: True, "10.213.0.2": True, "10.213.0.3": True}
    domain = {"prefill-0": "a", "prefill-1": "b", "decode-0": "b", "decode-1": "c"}
    for name in WORKERS:
        assert view["actors"][name] == ["ALIVE", HOST_OF[name], domain[name]], name
    before = transfers()
    load = Load(url, 6, 16)
    load.join()
    load.assert_reference(engine)
    assert transfers() - before == 6  # every prompt's KV shipped to a decode worker
    shipped = [d for d in decisions() if d["mode"] == "disaggregated"][-6:]
    assert {(d["prefill"], d["decode"]) for d in shipped} - {("prefill-1", "decode-0")}


def transfers() -> int:
    """KV transfers the ingress has counted (``tandem_kv_transfer_seconds_count``)."""
    return int(sum(metric(URL, "tandem_kv_transfer_seconds_count")))


def test_a_killed_decode_host_migrates_its_streams_and_comes_back(
    cluster: Served, url: str, engine: LLMEngine
) -> None:
    """Host c (decode-1, the whole of domain c) dies mid-stream: its streams migrate to
    decode-0 and finish exactly; the router marks decode-1 FAILED within the heartbeat timeout
    and routes nothing to it; no KV leaks on the surviving hosts; Ray marks the node DEAD and
    cannot restart decode-1 elsewhere (its domain has no live node). Revived, the host's Ray
    node rejoins and decode-1 serves again after a health check."""
    bed = cluster.bed
    victim = bed.hosts[2]
    load = Load(url, 6, 300)
    load.wait_streaming(10)
    killed_at = time.time()
    testbed.kill_host(victim)
    seen = watch_states(HEARTBEAT_TIMEOUT_S + 3)
    assert (
        first_time(seen, "decode-1", "failed") - killed_at < HEARTBEAT_TIMEOUT_S + DETECT_MARGIN_S
    )
    load.join()
    load.assert_reference(engine)
    # Routed after the failure: never to decode-1.
    assert all(d["decode"] != "decode-1" for d in routed_exactly(url, engine, first=100))
    survivors = [n for n in WORKERS if n != "decode-1"]
    for name, pool in pools(survivors).items():
        assert pool["in_use"] == pool["reserved"] == 0, name
    # Ray's view, once its health checks give up on the node.
    until = time.time() + 90
    while (view := ray_view())["alive"]["10.213.0.3"]:
        assert time.time() < until, "Ray never marked the dead host's node DEAD"
        time.sleep(2)
    assert view["actors"]["decode-1"][0] in ("RESTARTING", "PENDING_CREATION")
    assert worker_states(URL)["decode-1"] == "failed"
    bring_back(bed, victim)
    assert ray_view()["actors"]["decode-1"][:2] == ["ALIVE", "10.213.0.3"]
    again = Load(url, 4, 8, first=200)
    again.join()
    again.assert_reference(engine)


def test_a_partitioned_host_is_failed_then_readmitted_with_its_index_resynced(
    cluster: Served, url: str, engine: LLMEngine
) -> None:
    """Host b (prefill-1, decode-0) is cut off for a few seconds, under load, with prefill-1's
    KV streams stalled so a transfer is in flight: both are marked FAILED within the heartbeat
    timeout; every request finishes exactly (retried or migrated elsewhere); decode-1's
    reservations are released within the lease; when the link heals the two rejoin only through
    a health check (failed, then starting, then up) and the router's index of their caches is
    exactly what they hold (P12)."""
    bed = cluster.bed
    victim = bed.hosts[1]
    arm("prefill-1", "Fault(FaultPoint.TRANSFER_CHUNK, FaultAction.STALL, at=2, seconds=30.0)")
    load = Load(url, 8, 200, first=300)
    load.wait_streaming(1)
    logged = len(health_events())
    cut_at = time.time()
    testbed.partition(victim)
    seen = watch_states(HEARTBEAT_TIMEOUT_S + 3)
    for name in ("prefill-1", "decode-0"):
        assert first_time(seen, name, "failed") - cut_at < HEARTBEAT_TIMEOUT_S + DETECT_MARGIN_S, (
            name
        )
    testbed.heal(victim)
    wait_all_up(URL)
    events = health_events()[logged:]
    for name in ("prefill-1", "decode-0"):
        mine = [e for e in events if e["worker"] == name]
        # Failed for its silence, readmitted by its health check, then its reports taken.
        assert [e["event"] for e in mine][:3] == ["failed", "checked", "up"], mine
        assert mine[0]["why"].startswith("silent for ")
    load.join()
    load.assert_reference(engine)
    # Nothing waited for the stalled transfer (30 s) or for a lease to lapse.
    ended = max(o.token_times[-1][0] for o in load.join() if o.token_times)
    assert ended - cut_at < LEASE_TIMEOUT_S
    wait_all_up(URL)
    arm("prefill-1")  # disarmed, whether it fired or not
    held = pools(WORKERS)
    for name, pool in held.items():
        assert pool["in_use"] == pool["reserved"] == 0, name
    assert credited() == {name: pool["cached"] for name, pool in held.items()}


def test_losing_a_domain_leaves_the_rest_serving(
    cluster: Served, url: str, engine: LLMEngine
) -> None:
    """Domain b's host (prefill-1 and decode-0) dies under load: the streams it held migrate,
    new requests go to prefill-0 and decode-1 only, all exact; then it comes back."""
    bed = cluster.bed
    victim = bed.hosts[1]
    load = Load(url, 6, 200, first=400)
    load.wait_streaming(5)
    testbed.kill_host(victim)
    load.join()
    load.assert_reference(engine)
    for d in routed_exactly(url, engine, first=500):
        assert d["prefill"] in (None, "prefill-0") and d["decode"] in (None, "decode-1"), d
    bring_back(bed, victim)


def test_kv_over_torch_gloo_between_hosts_answers_as_the_engine(
    cluster: Served, url: str, engine: LLMEngine, tmp_path: Path
) -> None:
    """The same cluster served again with ``transport: torch`` (gloo pair groups between the
    hosts' addresses): the engine's tokens and logprobs."""
    bed = cluster.bed
    testbed.stop_serving(bed, cluster.proc)
    torch_topology = tmp_path / "testbed-torch.yaml"
    torch_topology.write_text(TOPOLOGY.read_text().replace("transport: grpc", "transport: torch"))
    cluster.proc = testbed.serve_on_head(bed, torch_topology)
    before = transfers()
    load = Load(url, 6, 16, first=600)
    load.join()
    load.assert_reference(engine)
    assert transfers() - before == 6
