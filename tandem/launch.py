"""Start a topology on Ray (or attach to it, started): the router actor, the worker actors,
and a coordinator for the caller.

Actors live in the Ray namespace ``tandem`` under their topology names (``tandem-router``,
``prefill-0``, ``decode-1``, ...). They are detached: the cluster belongs to the application,
not to the process that started it, so an ingress replica that Serve replaces (or several
replicas at once) attaches to the running actors with their caches instead of starting a
second cluster; :func:`stop_cluster` removes them (``tandem serve``'s shutdown). Creation is
get-or-create by name, so replicas starting together race harmlessly; the router carries a key
of what it was started from, and attaching to a cluster of another topology or model is an
error (:class:`ClusterMismatch`). Actors restart when they die (``max_restarts=-1``; no task
is retried by Ray: the coordinator retries requests itself, with fresh attempt ids); a
restarted worker rejoins once the router's health check reaches it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from cluster.coordinator import Coordinator
from contracts.actors import RouterClient, WorkerClient
from contracts.messages import WorkerInfo
from contracts.roles import NAMESPACE, ROUTER_NAME, Transport
from router.actor import RouterActor
from tandem.demo import ensure_demo_model, ensure_smollm2
from tandem.gguf import ensure_gguf_checkpoint, is_gguf
from tandem.sizing import sized_engine, sizes_itself
from tandem.topology import Role, Topology, WorkerSpec

READY_TIMEOUT_S = 180.0  # loading a model; an actor stuck PENDING for CPUs fails here, loudly
ROUTER_CALLS_BESIDE_QUEUE = 4096


def _actor_class(role: Role) -> type[Any]:
    """The worker actor class of ``role``. Imported here, not at the top: the workers import
    torch, and an ingress that only attaches to a running cluster must not (its restart
    would spend most of its time importing it)."""
    from cluster.worker import EngineWorker
    from decode_worker.worker import DecodeWorker
    from prefill_worker.worker import PrefillWorker

    classes: dict[Role, type[EngineWorker]] = {
        Role.PREFILL: PrefillWorker,
        Role.DECODE: DecodeWorker,
        Role.COLOCATED: EngineWorker,
    }
    return classes[role]


def model_dir_of(topology: Topology) -> Path:
    """The topology's checkpoint dir; a built-in model, or the dir of a GGUF file, is built
    first if it is not yet (raises FileNotFoundError / tandem.gguf.UnsupportedGGUF)."""
    model = topology.model
    if model.path is not None:
        return ensure_gguf_checkpoint(model.path) if is_gguf(model.path) else model.path
    return ensure_demo_model(model.demo_size) if model.builtin == "demo" else ensure_smollm2()


@dataclass
class Cluster:
    topology: Topology
    router: RouterClient
    workers: dict[str, WorkerClient]
    infos: dict[str, WorkerInfo]
    transport: Transport  # the KV transport the decode workers pull over (resolved)
    coordinator: Coordinator

    async def shutdown(self) -> None:
        for handle in [*(w.handle for w in self.workers.values()), self.router.handle]:
            ray.kill(handle, no_restart=True)


class ClusterMismatch(RuntimeError):
    """The cluster running under Tandem's names was started from another topology or model."""


class DomainMissing(RuntimeError):
    """A labelled Ray cluster has no live node in a failure domain the topology places
    workers in (within ``READY_TIMEOUT_S``: nodes of a cluster just launched join late)."""


def cluster_key(topology: Topology, model_dir: Path) -> str:
    """What a cluster is started from, as a short digest: the topology and the model."""
    text = f"{topology.model_dump_json()}\n{model_dir.resolve()}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def stop_cluster(topology: Topology) -> list[str]:
    """Kill the topology's actors (router and workers) for good; the names it found."""
    killed = []
    for name in [ROUTER_NAME, *(s.name for s in topology.workers())]:
        try:
            handle = ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            continue
        ray.kill(handle, no_restart=True)
        killed.append(name)
    return killed


def workers_have_cuda(topology: Topology) -> bool:
    """Whether the prefill and decode workers will run with CUDA: each asks Ray for a GPU and
    the cluster has GPUs (what ``transport: auto`` decides by)."""
    return topology.gpu_workers() and ray.cluster_resources().get("GPU", 0) > 0


def sized_workers(
    topology: Topology,
    model_dir: Path,
    cluster_memory: float,
    domain_memory: Mapping[str, float] | None = None,
) -> list[WorkerSpec]:
    """``topology``'s workers, those whose pool leaves its KV cache out sized from their
    memory (tandem/sizing.py): the pool's ``memory_bytes``, or an equal share of the memory
    where the worker runs: on a labelled cluster (``domain_memory``: Ray's ``memory`` resource
    of each domain's nodes) its domain's among the domain's workers, else ``cluster_memory``
    among all the workers. (An equal share of the whole cluster would not fit a node that
    holds more than its share of the workers: Ray would never place them.)"""
    specs = topology.workers()
    if not any(sizes_itself(s.engine) for s in specs):
        return specs
    from engine.loader import read_model_config  # torch: not in an ingress that only attaches

    model, weights = read_model_config(model_dir, topology.model.dtype)
    in_domain = Counter(s.domain for s in specs)
    out = []
    for s in specs:
        if sizes_itself(s.engine):
            if s.memory_bytes:
                memory = s.memory_bytes
            elif domain_memory is not None:
                memory = int(domain_memory.get(s.domain, 0.0) // in_domain[s.domain])
            else:
                memory = int(cluster_memory // len(specs))
            engine = sized_engine(s.engine, memory, model, weights, s.kv_memory_fraction)
            s = dataclasses.replace(s, memory_bytes=memory, engine=engine)
        out.append(s)
    return out


async def start_cluster(topology: Topology, model_dir: Path | None = None) -> Cluster:
    """Launch every actor of ``topology``, or attach to those running (started from the same
    topology and model: else ClusterMismatch), and wait until all are ready."""
    model_dir = model_dir or model_dir_of(topology)
    key = cluster_key(topology, model_dir)
    by_label = nodes_carry_label(topology.label_key)
    specs = sized_workers(
        topology,
        model_dir,
        ray.cluster_resources().get("memory", 0.0),
        await domain_memory(topology) if by_label else None,
    )
    transport = topology.resolved_transport(workers_have_cuda(topology))
    router = RouterClient(
        ray.remote(RouterActor)
        .options(
            name=ROUTER_NAME,
            namespace=NAMESPACE,
            get_if_exists=True,
            lifetime="detached",
            num_cpus=0.05,
            max_restarts=-1,
            # Every queued admission is a call in progress: room for the whole queue and
            # the reports, health checks and releases beside it.
            max_concurrency=topology.router.admission.max_queued + ROUTER_CALLS_BESIDE_QUEUE,
        )
        .remote(
            [(s.name, s.role, s.domain) for s in specs],
            topology.router,
            topology.heartbeat_timeout_s,
            NAMESPACE,
            key,
        )
    )
    running = await router.key()
    if running != key:
        raise ClusterMismatch(
            f"a Tandem cluster of another topology or model (key {running}, this one {key}) "
            f"runs in Ray namespace {NAMESPACE!r}: stop it first (tandem serve's Ctrl-C, or "
            "ray.kill its actors)"
        )
    workers = {
        s.name: WorkerClient(_start_worker(s, topology, model_dir, transport, by_label))
        for s in specs
    }
    infos = await asyncio.wait_for(
        asyncio.gather(*(w.ready() for w in workers.values())), READY_TIMEOUT_S
    )
    by_name = {i.name: i for i in infos}
    coordinator = Coordinator(
        router,
        workers,
        by_name,
        topology.model.name,
        topology.retry,
        topology.router.admission.unavailable_wait_s,
        topology.router.reserve_decode_first,
        topology.router.share_prompts,
    )
    await router.wait_ready(READY_TIMEOUT_S)
    return Cluster(topology, router, workers, by_name, transport, coordinator)


def nodes_carry_label(label_key: str) -> bool:
    """Whether the cluster's nodes are labelled with failure domains (a real cluster started
    with ``ray start --labels``); if none is, the topology's domains are logical (one machine)."""
    return any(label_key in (node.get("Labels") or {}) for node in ray.nodes() if node["Alive"])


async def domain_memory(topology: Topology, timeout_s: float = READY_TIMEOUT_S) -> dict[str, float]:
    """:func:`memory_by_domain` once every domain the topology's workers need has a live node
    (a cluster ``ray up`` just launched is still adding its workers); DomainMissing when one
    has none after ``timeout_s``."""
    needed = {s.domain for s in topology.workers()}
    deadline = time.monotonic() + timeout_s
    while True:
        memory = memory_by_domain(topology.label_key)
        missing = sorted(needed - memory.keys())
        if not missing:
            return memory
        if time.monotonic() > deadline:
            raise DomainMissing(
                f"no live Ray node is labelled {topology.label_key}={missing[0]} (the topology "
                f"places workers there) after {timeout_s:.0f} s; labelled nodes: "
                f"{sorted(memory)}"
            )
        await asyncio.sleep(1.0)


def memory_by_domain(label_key: str) -> dict[str, float]:
    """Ray's ``memory`` resource of the live nodes, summed per value of ``label_key``."""
    out: dict[str, float] = {}
    for node in ray.nodes():
        domain = (node.get("Labels") or {}).get(label_key)
        if node["Alive"] and domain is not None:
            out[domain] = out.get(domain, 0.0) + node["Resources"].get("memory", 0.0)
    return out


def _start_worker(
    spec: WorkerSpec, topology: Topology, model_dir: Path, transport: Transport, by_label: bool
) -> Any:
    cls = _actor_class(spec.role)
    kwargs: dict[str, Any] = {}
    if spec.role is Role.PREFILL:
        kwargs["lease_timeout_s"] = topology.lease_timeout_s
    if spec.role is Role.DECODE:
        kwargs["transport"] = transport
    # On a labelled cluster a worker's domain is where it runs: schedule it on such a node.
    placement: dict[str, Any] = (
        {"label_selector": {topology.label_key: spec.domain}} if by_label else {}
    )
    if spec.memory_bytes is not None:
        placement["memory"] = spec.memory_bytes
    if spec.env:
        placement["runtime_env"] = {"env_vars": spec.env}
    return (
        ray.remote(cls)
        .options(
            name=spec.name,
            namespace=NAMESPACE,
            get_if_exists=True,
            lifetime="detached",
            num_cpus=spec.num_cpus,
            num_gpus=spec.num_gpus,
            max_restarts=-1,
            max_task_retries=0,
            **placement,
        )
        .remote(
            spec.name,
            spec.domain,
            str(model_dir),
            topology.model.name,
            spec.engine,
            ROUTER_NAME,
            report_interval_s=min(0.05, topology.heartbeat_interval_s),
            namespace=NAMESPACE,
            **kwargs,
        )
    )
