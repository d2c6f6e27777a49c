"""The Serve application fixture the HTTP e2e modules share."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import ray

from contracts.roles import NAMESPACE, ROUTER_NAME
from tandem.launch import stop_cluster
from tandem.serve import free_port, wait_port_free, wait_until_ready
from tandem.topology import load_topology

ServeApp = Callable[[Path], str]


def _wait_actors_gone(names: list[str], timeout_s: float = 60.0) -> None:
    """Until none of ``names`` is a live actor in Tandem's namespace (a killed actor's name is
    released a little after ``ray.kill`` returns)."""
    until = time.time() + timeout_s
    for name in names:
        while True:
            try:
                ray.get_actor(name, namespace=NAMESPACE)
            except ValueError:
                break
            assert time.time() < until, f"actor {name} outlived its application"
            time.sleep(0.1)


@pytest.fixture(scope="module")
def serve_app(ray_session: None, direct_ingress_port: int) -> Iterator[ServeApp]:
    """``serve_app(topology_file)`` deploys Tandem's Serve application with that topology and
    returns the ingress replica's URL (direct ingress, as ``tandem serve`` runs it); Serve's
    proxy also serves it, on ``serve_app.proxy_port``. Deleted at the module's end with its
    cluster (detached actors: they outlive the replica), once its actors are gone (the next
    module's cluster takes the same names)."""
    from ray import serve

    from tandem.deployment import app_builder

    names: list[str] = []
    topologies: list[Path] = []
    proxy_port = free_port("127.0.0.1")

    def deploy(topology: Path) -> str:
        names.extend([ROUTER_NAME, *(w.name for w in load_topology(topology).workers())])
        topologies.append(topology)
        _wait_actors_gone(names)  # a previous module's cluster
        wait_port_free(
            "127.0.0.1", direct_ingress_port, 60.0
        )  # and its ingress replica (Serve would block it)
        serve.start(http_options={"host": "127.0.0.1", "port": proxy_port})
        serve.run(app_builder({"topology": str(topology)}), name="tandem", blocking=False)
        url = f"http://127.0.0.1:{direct_ingress_port}"
        wait_until_ready(url, timeout_s=300)
        return url

    deploy.proxy_port = proxy_port  # type: ignore[attr-defined]
    yield deploy
    serve.delete("tandem")
    serve.shutdown()
    for topology in topologies:
        stop_cluster(load_topology(topology))
    _wait_actors_gone(names)


SMOLLM2_PD = """
model: {{path: {path}, name: smollm2}}
pools:
  prefill: {{replicas: 1, num_cpus: 0.5, engine: {engine}}}
  decode: {{replicas: 1, num_cpus: 0.5, engine: {engine}}}
transport: grpc
router: {{local_prefill_max_tokens: 0}}
"""


@pytest.fixture(scope="module")
def smollm2_pd_url(
    serve_app: ServeApp, smollm2: Path, tmp_path_factory: pytest.TempPathFactory
) -> str:
    """The URL of a module's app serving the real model (SmolLM2-135M-Instruct, bf16, named
    ``smollm2``) disaggregated: one prefill and one decode worker, every prompt prefilled
    remotely (the prefill worker samples the first token)."""
    engine = {"kv_cache_bytes": 2**25, "max_num_seqs": 8, "num_threads": 1}
    topology = tmp_path_factory.mktemp("smollm2-pd") / "topology.yaml"
    topology.write_text(SMOLLM2_PD.format(path=smollm2, engine=engine))
    return serve_app(topology)
