"""Start a topology on Ray: the router actor, the worker actors, and a coordinator.

Actors live in the Ray namespace ``tandem`` under their topology names (``tandem-router``,
``prefill-0``, ``decode-1``, ...). Workers restart when they die (``max_restarts=-1``; no task
is retried by Ray: the coordinator retries requests itself, with fresh attempt ids); a
restarted worker rejoins once the router's health check reaches it.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from cluster.coordinator import Coordinator
from cluster.messages import WorkerInfo
from cluster.retry import RetryPolicy
from cluster.topology import Role, Topology, WorkerSpec
from cluster.worker import EngineWorker
from decode_worker.worker import DecodeWorker
from engine.tokenizer import Tokenizer
from prefill_worker.worker import PrefillWorker
from router.actor import RouterActor

NAMESPACE = "tandem"
ROUTER_NAME = "tandem-router"
READY_TIMEOUT_S = 180.0  # loading a model; an actor stuck PENDING for CPUs fails here, loudly
_ACTOR_CLASSES: dict[Role, type[EngineWorker]] = {
    Role.PREFILL: PrefillWorker,
    Role.DECODE: DecodeWorker,
    Role.COLOCATED: EngineWorker,
}


def init_local_ray(num_cpus: int = 8) -> None:
    """A local Ray that listens on loopback only (RAY_NOTES: set before ray.init)."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if not ray.is_initialized():
        ray.init(
            num_cpus=num_cpus,  # logical CPUs: fractional actors must never wait for a core
            include_dashboard=False,
            log_to_driver=False,
            object_store_memory=256 * 2**20,
            namespace=NAMESPACE,
        )


def model_dir_of(topology: Topology) -> Path:
    if topology.model.path is not None:
        return topology.model.path
    from engine.cli import ensure_demo_model

    return ensure_demo_model(topology.model.demo_size)


@dataclass
class Cluster:
    topology: Topology
    router: Any
    workers: dict[str, Any]
    infos: dict[str, WorkerInfo]
    coordinator: Coordinator

    async def shutdown(self) -> None:
        for handle in [*self.workers.values(), self.router]:
            ray.kill(handle, no_restart=True)


async def start_cluster(
    topology: Topology, model_dir: Path | None = None, cuda_available: bool = False
) -> Cluster:
    """Launch every actor of ``topology`` and wait until all are ready."""
    model_dir = model_dir or model_dir_of(topology)
    model_id = topology.model.name
    specs = topology.workers()
    router: Any = (
        ray.remote(RouterActor)
        .options(name=ROUTER_NAME, namespace=NAMESPACE, num_cpus=0.05, max_restarts=-1)
        .remote(
            [(s.name, s.role, s.domain) for s in specs],
            topology.router,
            topology.heartbeat_timeout_s,
            NAMESPACE,
        )
    )
    by_label = nodes_carry_label(topology.label_key)
    workers = {s.name: _start_worker(s, topology, model_dir, model_id, by_label) for s in specs}
    infos = await asyncio.wait_for(
        asyncio.gather(*(w.ready.remote() for w in workers.values())), READY_TIMEOUT_S
    )
    tokenizer = Tokenizer(model_dir)
    retry = topology.retry
    coordinator = Coordinator(
        router,
        workers,
        {i.name: i for i in infos},
        tokenizer,
        model_id,
        RetryPolicy(retry.max_attempts, retry.budget_ratio, backoff_s=retry.backoff_s),
        transport=topology.resolved_transport(cuda_available),
    )
    await router.wait_ready.remote(READY_TIMEOUT_S)
    return Cluster(topology, router, workers, {i.name: i for i in infos}, coordinator)


def nodes_carry_label(label_key: str) -> bool:
    """Whether the cluster's nodes are labelled with failure domains (a real cluster started
    with ``ray start --labels``); if none is, the topology's domains are logical (one machine)."""
    return any(label_key in (node.get("Labels") or {}) for node in ray.nodes() if node["Alive"])


def _start_worker(
    spec: WorkerSpec, topology: Topology, model_dir: Path, model_id: str, by_label: bool
) -> Any:
    cls = _ACTOR_CLASSES[spec.role]
    kwargs: dict[str, Any] = {}
    if spec.role is Role.PREFILL:
        kwargs["lease_timeout_s"] = topology.lease_timeout_s
    # On a labelled cluster a worker's domain is where it runs: schedule it on such a node.
    placement = {"label_selector": {topology.label_key: spec.domain}} if by_label else {}
    return (
        ray.remote(cls)
        .options(
            name=spec.name,
            namespace=NAMESPACE,
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
            model_id,
            spec.engine,
            ROUTER_NAME,
            report_interval_s=min(0.05, topology.heartbeat_interval_s),
            namespace=NAMESPACE,
            **kwargs,
        )
    )
