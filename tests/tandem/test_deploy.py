"""Offline checks of the launch files in deploy/: the `ray up` cluster files, the Serve config
and the topologies they name.

Nothing here reaches a cloud or starts Ray. The cluster files go through Ray's own config
preparation and schema (what `ray up` runs before it contacts a provider) with sockets blocked.
Node labels are checked by running each node's real start commands in bash, the way Ray's
launcher runs them, against a stub `ray` that records its arguments: the labels a node joins
with are then resolved by Ray's own label code, so a typo in a command fails here, not on the
cluster.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from ray._private.ray_constants import LABELS_ENVIRONMENT_VARIABLE
from ray._private.resource_and_label_spec import ResourceAndLabelSpec
from ray.autoscaler._private.util import prepare_config, validate_config
from ray.serve.schema import ServeDeploySchema

from tandem.topology import Topology, load_topology

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
CLUSTER_FILES = ["cluster-aws.yaml", "cluster-local.yaml"]
TOPOLOGY_FILES = sorted(p.name for p in (DEPLOY / "topologies").glob("*.yaml"))
HEAD_IP = "192.0.2.250"  # what Ray exports as RAY_HEAD_IP; a documentation address
ROLES = ("prefill", "decode")  # a cloud node type is named {role}_{zone}


@dataclass(frozen=True)
class NodeStart:
    """One node as it joins: a node type of a cloud file, or a host of the local file."""

    node: str
    is_head: bool
    labels: dict[str, str]


def _read_yaml(path: Path) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    assert isinstance(data, dict), f"{path}: not a mapping"
    return data


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any connection or name lookup fails the test: validation must stay offline."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"network access during an offline check: {args!r}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)


def _prepared(name: str) -> dict[str, Any]:
    """The config as `ray up` sees it: defaults merged, local hosts turned into a node type."""
    return prepare_config(_read_yaml(DEPLOY / name))


def _topology_of(config: dict[str, Any]) -> Topology:
    path = config.get("metadata", {}).get("tandem", {}).get("topology")
    assert path, "metadata.tandem.topology: missing (the topology this cluster is laid out for)"
    return load_topology(REPO / path)


# -- running start commands ------------------------------------------------------------------


@pytest.fixture
def stub_bin(tmp_path: Path) -> Path:
    """A PATH dir whose `ray` records each call (argv and the label override Ray exports) and
    whose `hostname -I` prints $STUB_HOST_IP, plus a HOME with ~/tandem for `cd`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (tmp_path / "home" / "tandem").mkdir(parents=True)
    ray = bin_dir / "ray"
    ray.write_text(
        f"#!{sys.executable}\n"
        "import json, os, sys\n"
        "with open(os.environ['STUB_RAY_CALLS'], 'a') as f:\n"
        f"    override = os.environ.get({LABELS_ENVIRONMENT_VARIABLE!r})\n"
        "    f.write(json.dumps({'argv': sys.argv[1:], 'override': override}) + '\\n')\n"
    )
    hostname = bin_dir / "hostname"
    hostname.write_text('#!/bin/sh\necho "$STUB_HOST_IP "\n')
    for stub in (ray, hostname):
        stub.chmod(0o755)
    return bin_dir


def _run_start_commands(
    commands: list[str], host_ip: str, labels_env: dict[str, str] | None, bin_dir: Path
) -> tuple[bool, list[dict[str, Any]]]:
    """Run ``commands`` one shell each and stop at the first failure, as Ray's updater does.
    Returns whether all succeeded and the recorded `ray` calls."""
    calls = bin_dir.parent / f"calls-{host_ip}.jsonl"
    calls.unlink(missing_ok=True)
    env = {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "HOME": str(bin_dir.parent / "home"),
        "RAY_HEAD_IP": HEAD_IP,
        "STUB_HOST_IP": host_ip,
        "STUB_RAY_CALLS": str(calls),
    }
    if labels_env is not None:
        env[LABELS_ENVIRONMENT_VARIABLE] = json.dumps(labels_env, separators=(",", ":"))
    ok = True
    for command in commands:
        done = subprocess.run(["bash", "-c", command], env=env, capture_output=True, text=True)
        if done.returncode != 0:
            ok = False
            break
    lines = calls.read_text().splitlines() if calls.exists() else []
    return ok, [json.loads(line) for line in lines]


def _cli_labels(argv: list[str]) -> str:
    for i, arg in enumerate(argv):
        if arg.startswith("--labels="):
            return arg.removeprefix("--labels=")
        if arg == "--labels":
            return argv[i + 1]
    return ""


def _joined_labels(call: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The labels a node gets from one `ray start`, resolved by Ray's own code: --labels
    parsed, then the launcher's override merged over it."""
    from ray._private.label_utils import parse_node_labels_string

    spec = ResourceAndLabelSpec(labels=parse_node_labels_string(_cli_labels(call["argv"])))
    with monkeypatch.context() as env:
        env.delenv(LABELS_ENVIRONMENT_VARIABLE, raising=False)
        if call["override"] is not None:
            env.setenv(LABELS_ENVIRONMENT_VARIABLE, call["override"])
        spec._resolve_labels(None)
    assert spec.labels is not None
    return spec.labels


def _started_nodes(
    config: dict[str, Any], bin_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> list[NodeStart]:
    """Start every node of a prepared config and return the labels each joins with."""
    provider = config["provider"]
    if provider["type"] == "local":
        # One node type; each host is its own node. Ray exports no label override here.
        hosts = [(provider["head_ip"], True), *((ip, False) for ip in provider["worker_ips"])]
        nodes = [(ip, ip, is_head, None) for ip, is_head in hosts]
    else:
        # Ray's updater exports a node type's `labels` to `ray start` on every other provider.
        nodes = [
            (name, "198.51.100.200", name == config["head_node_type"], spec.get("labels"))
            for name, spec in config["available_node_types"].items()
        ]
    started = []
    for node, ip, is_head, labels in nodes:
        commands = config["head_start_ray_commands" if is_head else "worker_start_ray_commands"]
        ok, calls = _run_start_commands(commands, ip, labels, bin_dir)
        starts = [c for c in calls if c["argv"][:1] == ["start"]]
        assert ok and len(starts) == 1, f"{node}: start commands ran {ok=}, ray calls {calls}"
        started.append(NodeStart(node, is_head, _joined_labels(starts[0], monkeypatch)))
    return started


# -- cluster files ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", CLUSTER_FILES)
@pytest.mark.usefixtures("no_network")
def test_cluster_file_passes_rays_validation(name: str) -> None:
    config = _prepared(name)
    validate_config(config)  # Ray's shipped JSON schema plus its node-type checks
    assert config["head_node_type"] in config["available_node_types"]


@pytest.mark.parametrize("name", CLUSTER_FILES)
def test_cluster_file_names_an_existing_topology(name: str) -> None:
    topology = _topology_of(_prepared(name))
    assert topology.pools.prefill is not None and topology.pools.decode is not None


@pytest.mark.parametrize("name", CLUSTER_FILES)
def test_every_node_joins_labelled_with_a_topology_domain(
    name: str, stub_bin: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = _prepared(name)
    topology = _topology_of(config)
    started = _started_nodes(config, stub_bin, monkeypatch)
    domains = {node.node: node.labels.get(topology.label_key) for node in started}
    assert set(domains.values()) <= set(topology.domains), domains
    assert [n.is_head for n in started].count(True) == 1


def test_every_cloud_domain_has_prefill_and_decode_node_types(
    stub_bin: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = _prepared("cluster-aws.yaml")
    topology = _topology_of(config)
    roles: dict[str, set[str]] = {domain: set() for domain in topology.domains}
    for node in _started_nodes(config, stub_bin, monkeypatch):
        if node.is_head:
            continue
        role = node.node.split("_", 1)[0]
        assert role in ROLES, f"node type {node.node!r}: name must start with one of {ROLES}"
        roles[node.labels[topology.label_key]].add(role)
    assert roles == {domain: set(ROLES) for domain in topology.domains}


def test_every_cloud_domain_holds_the_workers_placed_there() -> None:
    """The nodes kept up (min_workers, and the head) of each domain fit the topology's workers
    of that domain, placed first fit by Ray resources, largest GPU ask first."""
    config = _prepared("cluster-aws.yaml")
    topology = _topology_of(config)
    for domain in topology.domains:
        free: list[dict[str, float]] = []
        for name, spec in config["available_node_types"].items():
            if spec["labels"][topology.label_key] != domain:
                continue
            count = 1 if name == config["head_node_type"] else spec["min_workers"]
            free += [{"CPU": 0, "GPU": 0, **spec["resources"]} for _ in range(count)]
        workers = [w for w in topology.workers() if w.domain == domain]
        for worker in sorted(workers, key=lambda w: -w.num_gpus):
            node = next(
                (n for n in free if n["CPU"] >= worker.num_cpus and n["GPU"] >= worker.num_gpus),
                None,
            )
            assert node is not None, f"{domain}: no node left for {worker.name}"
            node["CPU"] -= worker.num_cpus
            node["GPU"] -= worker.num_gpus


def test_cloud_nodes_download_the_topologys_checkpoint() -> None:
    config = _prepared("cluster-aws.yaml")
    model_path = _topology_of(config).model.path
    assert model_path is not None
    for key in ("head_setup_commands", "worker_setup_commands"):
        targets = []
        for command in config[key]:
            argv = shlex.split(command)
            if "--local-dir" in argv:
                targets.append(argv[argv.index("--local-dir") + 1])
        assert targets == [str(model_path)], f"{key}: checkpoint downloads to {targets}"


def test_every_local_domain_has_worker_hosts(
    stub_bin: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = _prepared("cluster-local.yaml")
    topology = _topology_of(config)
    started = _started_nodes(config, stub_bin, monkeypatch)
    workers = [n for n in started if not n.is_head]
    assert {n.node for n in workers} == set(config["provider"]["worker_ips"])
    assert {n.labels[topology.label_key] for n in workers} == set(topology.domains)


def test_a_local_host_missing_from_the_domain_map_refuses_to_start(stub_bin: Path) -> None:
    config = _prepared("cluster-local.yaml")
    ok, calls = _run_start_commands(
        config["worker_start_ray_commands"], "203.0.113.99", None, stub_bin
    )
    assert not ok
    assert [c["argv"][:1] for c in calls] == [["stop"]]


# -- serve config and topologies -------------------------------------------------------------


def test_serve_config_parses_with_one_tandem_application() -> None:
    config = ServeDeploySchema.model_validate(_read_yaml(DEPLOY / "serve.yaml"))
    assert [app.name for app in config.applications] == ["tandem"]
    app = config.applications[0]
    assert app.import_path == "tandem.deployment:app_builder"
    assert app.route_prefix == "/"
    assert "working_dir" not in (app.runtime_env or {})  # `serve run` rejects a local one
    assert (config.http_options.host, config.http_options.port) == ("127.0.0.1", 8000)


def test_serve_config_topology_exists_and_loads() -> None:
    app = _read_yaml(DEPLOY / "serve.yaml")["applications"][0]
    assert set(app["args"]) <= {"topology", "model"}, app["args"]
    assert load_topology(REPO / app["args"]["topology"]).pools.by_role()


def test_topology_files_are_found() -> None:
    assert {"local.yaml", "two-zone.yaml"} <= set(TOPOLOGY_FILES)


@pytest.mark.parametrize("name", TOPOLOGY_FILES)
def test_every_topology_file_loads(name: str) -> None:
    assert load_topology(DEPLOY / "topologies" / name).workers()


@pytest.mark.parametrize("replicas", [1, 3])
def test_the_application_runs_the_topologys_ingress_replicas(tmp_path: Path, replicas: int) -> None:
    """``serve.num_replicas`` is the ingress deployment's replica count (the replicas share
    the cluster: they attach to its detached actors, test_cluster_modes.py)."""
    from tandem.deployment import app_builder

    topology = tmp_path / "topology.yaml"
    topology.write_text(
        "model: {demo_size: test}\npools:\n  colocated: {replicas: 1}\n"
        f"serve: {{num_replicas: {replicas}}}\n"
    )
    app = app_builder({"topology": str(topology)})
    assert app._bound_deployment.num_replicas == replicas


@pytest.mark.e2e  # it listens on a loopback port
def test_a_port_is_waited_for_until_its_listener_goes() -> None:
    """``tandem serve``'s port check, waiting: busy while something listens there, free as
    soon as it stops (its connections left in TIME_WAIT do not count: SO_REUSEADDR)."""
    import threading
    import time

    from tandem.serve import free_port, wait_port_free

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    with pytest.raises(ValueError, match=f"cannot listen on 127.0.0.1:{port}"):
        free_port("127.0.0.1", port)
    with pytest.raises(TimeoutError):
        wait_port_free("127.0.0.1", port, 0.2)
    threading.Timer(0.3, listener.close).start()
    start = time.time()
    wait_port_free("127.0.0.1", port, 10.0)
    assert 0.3 <= time.time() - start < 5.0
    assert free_port("127.0.0.1", port) == port


@pytest.mark.e2e  # it listens on loopback ports
def test_a_picked_port_is_free_and_outside_the_range_ray_takes_its_own_from() -> None:
    """Port 0 picks from PICK_PORTS, never the kernel's ephemeral range: Ray's components,
    started after the pick, take theirs from there (CI saw Ray's runtime-env agent listen on
    the port picked for the ingress)."""
    from tandem.serve import PICK_PORTS, free_port

    low, high = (int(n) for n in open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
    picked = {free_port("127.0.0.1") for _ in range(20)}
    assert all(p in PICK_PORTS and not low <= p <= high for p in picked) and len(picked) > 1
    with socket.socket() as s:
        s.bind(("127.0.0.1", picked.pop()))  # free indeed
