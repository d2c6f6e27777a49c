"""On a cluster whose nodes carry failure-domain labels, each worker runs on a node of its
domain (two labelled Ray nodes on loopback, in a child process: a second Ray instance)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tandem.bootstrap import LOOPBACK_ENV

pytestmark = pytest.mark.e2e

SCRIPT = r"""
import asyncio, json, sys
import ray
from ray.cluster_utils import Cluster
from tandem.bootstrap import init_ray
from tandem.launch import start_cluster
from tandem.topology import Topology

cluster = Cluster()
for domain in ("a", "b"):
    cluster.add_node(num_cpus=4, labels={"tandem/failure-domain": domain})
init_ray(cluster.address)
topology = Topology.from_yaml_text('''
model: {path: %s, name: test-llama}
domains: [a, b]
pools:
  prefill: {replicas: 2, num_cpus: 0.5, engine: {kv_cache_bytes: 1048576}}
  decode: {replicas: 2, num_cpus: 0.5, engine: {kv_cache_bytes: 1048576}}
transport: grpc
''')
c = asyncio.run(start_cluster(topology))
labels = {n["NodeID"]: n["Labels"].get("tandem/failure-domain") for n in ray.nodes()}
placed = {}
for name, handle in c.workers.items():
    node = ray.get(handle.node_id())
    placed[name] = labels[node]
print(json.dumps({"placed": placed, "domains": {s.name: s.domain for s in topology.workers()}}))
ray.shutdown()
cluster.shutdown()
"""


def test_workers_run_on_nodes_of_their_domain(test_llama: Path) -> None:
    env = {**os.environ, **LOOPBACK_ENV}
    tmp = tempfile.mkdtemp(prefix="tandem-ray-")  # short: Ray's socket paths must fit 107 bytes
    env["RAY_TMPDIR"] = tmp
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT % test_llama],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    shutil.rmtree(tmp, ignore_errors=True)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["placed"] == result["domains"]
    assert set(result["placed"].values()) == {"a", "b"}
