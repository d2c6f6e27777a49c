"""The Ray Serve application: the ingress deployment in front of the cluster of its topology.

``Ingress`` attaches to the topology's router and worker actors in its async constructor,
starting them if they are not running (``tandem.launch``: they are detached, named actors of
the application), and answers the OpenAI API through ``api.app.Service``. A replica that
Serve replaces leaves the cluster running, caches and all: the next one attaches to it.
Several replicas (the topology's ``serve.num_replicas``) share one router and one set of
workers; each has its own coordinator.

    serve run deploy/serve.yaml            # import path tandem.deployment:app_builder
    tandem serve --topology FILE           # the same application, from the CLI

No ``from __future__ import annotations`` here: Serve's class-based views need the route
methods' annotations as real types, or FastAPI takes ``request`` for a query parameter.
"""

import logging
import socket
from pathlib import Path
from typing import Any

from fastapi import Request, Response
from ray import serve
from ray.serve import Application

from api.app import Service
from api.edge import GENERATION_RESPONSES, OpenAIApp
from api.gate import IngressGate
from api.metrics import Metrics
from api.protocol import ChatCompletionRequest, CompletionRequest
from api.responses_api import ResponsesRequest
from api.tokenize import DetokenizeRequest, TokenizeRequest
from contracts.roles import Role
from engine.tokenizer import Tokenizer
from tandem.launch import Cluster, model_dir_of, start_cluster
from tandem.topology import load_topology

logger = logging.getLogger("tandem.deployment")
DEFAULT_TOPOLOGY = Path(__file__).resolve().parent.parent / "deploy" / "topologies" / "local.yaml"
# local.yaml with the demo model: the chaos harness's default (what it checks is the cluster).
DEMO_TOPOLOGY = DEFAULT_TOPOLOGY.with_name("local-demo.yaml")


def rebind_after_a_crash() -> None:
    """Make this replica's direct-ingress HTTP socket bindable over TIME_WAIT connections.

    Ray Serve 2.60 binds the replica's port without ``SO_REUSEADDR``, so a replica started
    after one that died (SIGKILL, OOM) cannot bind while the dead one's connections sit in
    TIME_WAIT (60 s on Linux); Serve then blocks the port for good (``NoAvailablePortError``):
    the endpoint stays down. ``SO_REUSEADDR`` (what uvicorn itself sets) allows the bind over
    TIME_WAIT only -- never beside a live listener, unlike ``SO_REUSEPORT``. Serve asks for
    the socket option through ``start_asgi_http_server(enable_so_reuseport=...)`` and
    ``set_socket_reuse_port``, both private: this replica process calls them through a wrapper
    that asks for the option and sets ``SO_REUSEADDR`` alone. Runs in the replica's
    constructor, before Serve starts its server; a Ray without those names is left as it is.
    """
    from ray.serve._private import http_util, replica

    start = getattr(replica, "start_asgi_http_server", None)
    if start is None or not hasattr(http_util, "set_socket_reuse_port"):
        logger.warning("Ray Serve's direct ingress changed: a restarted replica may not rebind")
        return
    if getattr(start, "rebinds", False):
        return

    def reuse_addr(sock: socket.socket) -> bool:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        return True

    async def start_rebindable(*args: Any, **kwargs: Any) -> Any:
        return await start(*args, **{**kwargs, "enable_so_reuseport": True})

    start_rebindable.rebinds = True  # type: ignore[attr-defined]
    http_util.set_socket_reuse_port = reuse_addr
    replica.start_asgi_http_server = start_rebindable


# Its handlers and routes are set before @serve.ingress below freezes a copy for the replicas.
app = OpenAIApp(title="Tandem", description="OpenAI-compatible API of a Tandem cluster")


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
    # A killed replica is noticed at its next health check: Serve's default (10 s) and 5 s
    # kept the port dark for most of that on top of the new replica's start.
    health_check_period_s=1.0,
)
@serve.ingress(app)
class Ingress:
    async def __init__(  # type: ignore[misc]
        self, topology: str, model: str | None = None, engine: dict[str, Any] | None = None
    ) -> None:
        rebind_after_a_crash()
        spec = load_topology(topology)
        if model:
            spec = spec.with_model_path(Path(model))
        if engine:
            spec = spec.with_engine(engine)
        model_dir = model_dir_of(spec)
        self.cluster: Cluster = await start_cluster(spec, model_dir=model_dir)
        self.service = service_for(self.cluster, model_dir)

    async def check_health(self) -> None:
        """Serve's replica health check: raises only when this replica is broken, never
        because the router or a worker restarts (Serve would replace a working replica)."""
        await self.service.check_alive()

    @app.post(
        "/v1/completions",
        openapi_extra=app.json_body(CompletionRequest),
        responses=GENERATION_RESPONSES,
    )
    async def completions(self, request: Request) -> Response:
        return await self.service.completions(request)

    @app.post(
        "/v1/chat/completions",
        openapi_extra=app.json_body(ChatCompletionRequest),
        responses=GENERATION_RESPONSES,
    )
    async def chat_completions(self, request: Request) -> Response:
        return await self.service.chat_completions(request)

    @app.post(
        "/v1/responses",
        openapi_extra=app.json_body(ResponsesRequest),
        responses=GENERATION_RESPONSES,
    )
    async def responses(self, request: Request) -> Response:
        return await self.service.responses(request)

    @app.post("/tokenize", openapi_extra=app.json_body(TokenizeRequest))
    async def tokenize(self, request: Request) -> Response:
        return await self.service.tokenize(request)

    @app.post("/detokenize", openapi_extra=app.json_body(DetokenizeRequest))
    async def detokenize(self, request: Request) -> Response:
        return await self.service.detokenize(request)

    @app.get("/v1/models")
    async def models(self) -> Response:
        return self.service.models()

    @app.get("/health")
    async def health(self) -> Response:
        return await self.service.health()

    @app.get("/v1/cluster")
    async def cluster_view(self) -> Response:
        return await self.service.cluster()

    @app.get("/metrics")
    async def metrics(self) -> Response:
        return await self.service.metrics_response()


def app_builder(args: dict[str, Any]) -> Application:
    """Serve's application builder (``import_path: tandem.deployment:app_builder``); ``args``:
    ``topology`` (a topology YAML path; default ``deploy/topologies/local.yaml``), optional
    ``model`` (a checkpoint directory overriding the topology's) and ``engine`` (engine
    settings over every pool's, e.g. ``{"quantization": "int8"}``)."""
    topology = str(args.get("topology") or DEFAULT_TOPOLOGY)
    model = args.get("model")
    replicas = load_topology(topology).serve.num_replicas
    ingress = Ingress.options(num_replicas=replicas)  # type: ignore[attr-defined]
    bound = ingress.bind(topology, str(model) if model else None, args.get("engine"))
    return bound  # type: ignore[no-any-return]
