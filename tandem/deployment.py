"""The Ray Serve application: one ingress deployment that owns the cluster of its topology.

``Ingress`` starts the router and worker actors of the topology (``tandem.launch``) in its
async constructor and answers the OpenAI API through ``api.app.Service``. The workers are
named actors owned by the replica: when Serve replaces the replica, they go with it and the new
replica starts its own. Keep ``num_replicas`` at 1 (two replicas would race for the names).

    serve run deploy/serve.yaml            # import path tandem.deployment:app_builder
    tandem serve --topology FILE           # the same application, from the CLI

No ``from __future__ import annotations`` here: Serve's class-based views need the route
methods' annotations as real types, or FastAPI takes ``request`` for a query parameter.
"""

from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request, Response
from ray import serve
from ray.serve import Application

from api.app import Service
from api.gate import IngressGate
from api.metrics import Metrics
from contracts.roles import Role
from engine.tokenizer import Tokenizer
from tandem.launch import Cluster, model_dir_of, start_cluster
from tandem.topology import load_topology

DEFAULT_TOPOLOGY = Path(__file__).resolve().parent.parent / "deploy" / "topologies" / "local.yaml"

app = FastAPI(title="Tandem", description="OpenAI-compatible API of a Tandem cluster")


def service_for(cluster: Cluster, model_dir: Path) -> Service:
    """The HTTP service of a started cluster, configured from its topology."""
    spec = cluster.topology
    infos = list(cluster.infos.values())
    return Service(
        coordinator=cluster.coordinator,
        router=cluster.router,
        tokenizer=Tokenizer(model_dir),
        model_name=spec.model.name,
        max_model_len=min(i.max_model_len for i in infos),
        vocab_size=infos[0].vocab_size,
        gate=IngressGate(spec.serve.gate),
        metrics=Metrics(),
        request_timeout_s=spec.retry.deadline_s,
        decode_workers={
            name: client
            for name, client in cluster.workers.items()
            if cluster.infos[name].role is Role.DECODE
        },
    )


@serve.deployment(
    name="tandem-ingress",
    num_replicas=1,
    ray_actor_options={"num_cpus": 0.1},
    max_ongoing_requests=1024,  # the gate and the engines' admission bound the real load
    health_check_period_s=5.0,
)
@serve.ingress(app)
class Ingress:
    async def __init__(self, topology: str, model: str | None = None) -> None:  # type: ignore[misc]
        spec = load_topology(topology)
        if model:
            spec = spec.with_model_path(Path(model))
        model_dir = model_dir_of(spec)
        self.cluster: Cluster = await start_cluster(spec, model_dir=model_dir)
        self.service = service_for(self.cluster, model_dir)

    async def check_health(self) -> None:
        """Serve's replica health check: the router answers and a pair can serve."""
        await self.service.check_ready()

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self.service.completions(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self.service.chat_completions(request)

    @app.get("/v1/models")
    async def models(self) -> Response:
        return self.service.models()

    @app.get("/health")
    async def health(self) -> Response:
        return await self.service.health()

    @app.get("/metrics")
    async def metrics(self) -> Response:
        return await self.service.metrics_response()


def app_builder(args: dict[str, Any]) -> Application:
    """Serve's application builder (``import_path: tandem.deployment:app_builder``); ``args``:
    ``topology`` (a topology YAML path; default ``deploy/topologies/local.yaml``) and optional
    ``model`` (a checkpoint directory overriding the topology's)."""
    topology = str(args.get("topology") or DEFAULT_TOPOLOGY)
    model = args.get("model")
    return Ingress.bind(topology, str(model) if model else None)  # type: ignore[attr-defined]
