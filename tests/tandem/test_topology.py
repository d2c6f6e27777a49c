"""Topology files: the shipped examples load and place; bad files fail naming field and value."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import ray
import yaml
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from contracts.roles import Role, Transport
from engine.config import EngineConfig, SpeculativeConfig
from tandem.launch import workers_have_cuda
from tandem.sizing import sizes_itself
from tandem.topology import Topology, TopologyError, WorkerSpec, load_topology

TOPOLOGIES = Path(__file__).resolve().parents[2] / "deploy" / "topologies"
EXAMPLES = sorted(TOPOLOGIES.glob("*.yaml"))
PAIR = "pools: {prefill: {replicas: 1}, decode: {replicas: 1}}\n"


def test_the_seven_examples_are_there() -> None:
    assert [p.name for p in EXAMPLES] == [
        "local-colocated.yaml",
        "local-demo.yaml",
        "local-fp32.yaml",
        "local.yaml",
        "one-gpu-node.yaml",
        "testbed.yaml",
        "two-zone.yaml",
    ]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_loads_places_and_says_what_it_is_for(path: Path) -> None:
    assert path.read_text().startswith("# ")
    topology = load_topology(path)
    workers = topology.workers()
    assert workers
    assert len({w.name for w in workers}) == len(workers)
    assert {w.domain for w in workers} <= set(topology.domains)
    assert workers == topology.workers()  # deterministic


def test_local_yaml_places_exactly() -> None:
    topology = load_topology(TOPOLOGIES / "local.yaml")
    # KV and slots left to be sized from the machine; a spare thread each (idle cores only).
    engine = EngineConfig(num_threads=1, spare_threads=1)
    # The decode workers speculate (exact; docs/benchmarks.md#speculation says where it wins).
    decode = EngineConfig(num_threads=1, spare_threads=1, speculative=SpeculativeConfig())
    assert topology.workers() == [
        WorkerSpec("prefill-0", Role.PREFILL, 0, "a", 0.5, 0.0, engine, None, 0.5),
        WorkerSpec("prefill-1", Role.PREFILL, 1, "b", 0.5, 0.0, engine, None, 0.5),
        WorkerSpec("decode-0", Role.DECODE, 0, "a", 0.5, 0.0, decode, None, 0.5),
        WorkerSpec("decode-1", Role.DECODE, 1, "b", 0.5, 0.0, decode, None, 0.5),
    ]
    assert all(sizes_itself(w.engine) for w in topology.workers())
    assert topology.retry.deadline_s is None
    assert topology.router.admission.max_queued == 1024
    assert topology.model.path is None
    assert topology.model.name == "smollm2-135m-instruct"
    assert topology.resolved_transport(workers_have_cuda=False) == Transport.GRPC
    assert topology.router.local_prefill_max_tokens == 64
    assert topology.label_key == "tandem/failure-domain"


def test_round_robin_and_pack_place_exactly() -> None:
    topology = Topology.from_yaml_text(
        """
        domains: [a, b, c]
        pools:
          prefill: {replicas: 4, spread: round_robin}
          decode: {replicas: 3, spread: pack, domains: [c, b]}
          colocated: {replicas: 3, domains: [c, a]}
        """
    )
    assert [(w.name, w.index, w.domain) for w in topology.workers()] == [
        ("prefill-0", 0, "a"),
        ("prefill-1", 1, "b"),
        ("prefill-2", 2, "c"),
        ("prefill-3", 3, "a"),
        ("decode-0", 0, "c"),
        ("decode-1", 1, "c"),
        ("decode-2", 2, "c"),
        ("colocated-0", 0, "c"),
        ("colocated-1", 1, "a"),
        ("colocated-2", 2, "c"),
    ]


def test_worker_engine_is_the_pool_engine_with_the_model_dtype() -> None:
    topology = Topology.from_yaml_text(
        """
        model: {dtype: bfloat16}
        pools:
          prefill: {replicas: 1, num_cpus: 0.25, engine: {max_num_batched_tokens: 4096}}
          decode: {replicas: 1, num_gpus: 0.5, engine: {max_num_seqs: 8}}
        """
    )
    prefill, decode = topology.workers()
    assert prefill.engine == EngineConfig(max_num_batched_tokens=4096, dtype="bfloat16")
    assert decode.engine == EngineConfig(max_num_seqs=8, dtype="bfloat16")
    assert (prefill.num_cpus, prefill.num_gpus) == (0.25, 0.0)
    assert (decode.num_cpus, decode.num_gpus) == (1.0, 0.5)


@pytest.mark.parametrize(
    ("model", "name"),
    [
        ("{}", "demo-tiny-llama"),
        ("{demo_size: small}", "demo-small-llama"),
        ("{builtin: smollm2-135m-instruct}", "smollm2-135m-instruct"),
        ("{builtin: demo}", "demo-tiny-llama"),
        ("{path: /models/Llama-3.1-8B-Instruct/}", "Llama-3.1-8B-Instruct"),
        ("{path: /models/x, name: served-as}", "served-as"),
    ],
)
def test_model_name_defaults_to_the_demo_or_dir_name(model: str, name: str) -> None:
    assert Topology.from_yaml_text(f"model: {model}\n{PAIR}").model.name == name


def test_a_model_override_serves_that_checkpoint_under_its_dir_name() -> None:
    """``tandem serve --model DIR``: the topology's model (demo or named) gives way entirely."""
    spec = Topology.from_yaml_text(f"model: {{demo_size: small, dtype: float32}}\n{PAIR}")
    moved = spec.with_model_path(Path("/models/Qwen2-0.5B"))
    assert (moved.model.path, moved.model.name) == (Path("/models/Qwen2-0.5B"), "Qwen2-0.5B")
    assert moved.model.dtype == "float32" and moved.pools == spec.pools
    assert spec.model.name == "demo-small-llama"  # the original is untouched (frozen)


def test_engine_overrides_reach_every_pools_engines() -> None:
    """``tandem serve --quantization int8 --speculative ngram``: every declared pool's engines
    take the settings, nothing else changes; a bad setting is refused as in a file."""
    spec = Topology.from_yaml_text(f"model: {{demo_size: small}}\n{PAIR}")
    moved = spec.with_engine({"quantization": "int8", "speculative": {"method": "ngram"}})
    pools = moved.pools.by_role()
    assert pools and all(p.engine.quantization == "int8" for p in pools.values())
    assert all(p.engine.speculative == SpeculativeConfig() for p in pools.values())
    assert moved.pools.colocated is spec.pools.colocated is None
    undo = {"quantization": "none", "speculative": None}
    same = {r: p.engine.model_copy(update=undo) for r, p in pools.items()}
    assert same == {r: p.engine for r, p in spec.pools.by_role().items()}
    assert all(p.engine.quantization == "none" for p in spec.pools.by_role().values())
    with pytest.raises(ValidationError, match="min_n"):
        spec.with_engine({"speculative": {"min_n": 5, "max_n": 2}})


@pytest.mark.parametrize(
    ("transport", "gpus", "cluster_gpus", "expected"),
    [
        ("grpc", 1, 2, Transport.GRPC),
        ("torch", 0, 0, Transport.TORCH),  # gloo on CPU
        ("auto", 1, 2, Transport.TORCH),  # NCCL: the workers get CUDA
        ("auto", 1, 0, Transport.GRPC),
        ("auto", 0, 2, Transport.GRPC),
        ("auto", 0, 0, Transport.GRPC),
    ],
)
def test_transport_resolution(
    monkeypatch: pytest.MonkeyPatch,
    transport: str,
    gpus: int,
    cluster_gpus: int,
    expected: Transport,
) -> None:
    """What start_cluster resolves ``transport`` to, with Ray's GPU count faked."""
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 8.0, "GPU": float(cluster_gpus)})
    pool = f"{{replicas: 1, num_gpus: {gpus}}}"
    topology = Topology.from_yaml_text(
        f"transport: {transport}\npools: {{prefill: {pool}, decode: {pool}}}"
    )
    assert topology.resolved_transport(workers_have_cuda(topology)) == expected


def test_auto_is_grpc_when_only_one_side_has_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"GPU": 4.0})
    topology = Topology.from_yaml_text(
        "pools: {prefill: {replicas: 1, num_gpus: 1}, decode: {replicas: 1}}"
    )
    assert not workers_have_cuda(topology)
    assert topology.resolved_transport(workers_have_cuda(topology)) == Transport.GRPC


BAD = [
    ("negative replicas", "pools: {prefill: {replicas: -1}, decode: {replicas: 1}}",
     "pools.prefill.replicas", "-1"),
    ("unknown key", "pools: {prefill: {replicas: 1, replcas: 2}, decode: {replicas: 1}}",
     "pools.prefill.replcas", "2"),
    ("unknown top key", PAIR + "trasnport: grpc", "trasnport", "'grpc'"),
    ("unknown domain", "domains: [a, b]\npools: {prefill: {replicas: 1}, "
     "decode: {replicas: 1, domains: [b, c]}}", "pools.decode.domains", "['c']"),
    ("no pools", "pools: {}", "pools", "{}"),
    ("all pools empty", "pools: {prefill: {replicas: 0}, decode: {replicas: 0}}",
     "pools", "{'prefill': 0, 'decode': 0}"),
    ("prefill without decode", "pools: {prefill: {replicas: 2}, colocated: {replicas: 1}}",
     "pools.decode.replicas", "0"),
    ("bad transport", PAIR + "transport: rdma", "transport", "'rdma'"),
    ("bad engine field", "pools: {colocated: {replicas: 1, engine: {block_size: 0}}}",
     "pools.colocated.engine.block_size", "0"),
    ("unknown engine key", "pools: {colocated: {replicas: 1, engine: {blocksize: 8}}}",
     "pools.colocated.engine.blocksize", "8"),
    ("pool dtype", "pools: {colocated: {replicas: 1, engine: {dtype: float16}}}",
     "pools.colocated.engine.dtype", "'float16'"),
    ("block sizes differ", "pools: {prefill: {replicas: 1}, "
     "decode: {replicas: 1, engine: {block_size: 32}}}", "pools.decode.engine.block_size", "32"),
    ("zero cpus", "pools: {colocated: {replicas: 1, num_cpus: 0}}",
     "pools.colocated.num_cpus", "0"),
    ("infinite cpus", "pools: {colocated: {replicas: 1, num_cpus: .inf}}",
     "pools.colocated.num_cpus", "inf"),
    ("negative gpus", "pools: {colocated: {replicas: 1, num_gpus: -1}}",
     "pools.colocated.num_gpus", "-1"),
    ("bad spread", "pools: {colocated: {replicas: 1, spread: packed}}",
     "pools.colocated.spread", "'packed'"),
    ("empty pool domains", "pools: {colocated: {replicas: 1, domains: []}}",
     "pools.colocated.domains", "[]"),
    ("empty domain name", PAIR + "domains: [a, '']", "domains", "['a', '']"),
    ("duplicate domain", PAIR + "domains: [a, b, a]", "domains", "['a', 'b', 'a']"),
    ("no domains", PAIR + "domains: []", "domains", "[]"),
    ("reserved label key", PAIR + "label_key: ray.io/zone", "label_key", "'ray.io/zone'"),
    ("bad model dtype", PAIR + "model: {dtype: fp8}", "model.dtype", "'fp8'"),
    ("demo size with a path", PAIR + "model: {path: /m/x, demo_size: small}",
     "model.demo_size", "'small'"),
    ("demo size with the real model", PAIR + "model: {builtin: smollm2-135m-instruct, "
     "demo_size: small}", "model.demo_size", "'small'"),
    ("builtin with a path", PAIR + "model: {path: /m/x, builtin: demo}", "model.builtin",
     "'demo'"),
    ("unknown builtin", PAIR + "model: {builtin: gpt-5}", "model.builtin", "'gpt-5'"),
    ("zero attempts", PAIR + "retry: {max_attempts: 0}", "retry.max_attempts", "0"),
    ("negative weight", PAIR + "router: {weights: {kv_usage: -1}}",
     "router.weights.kv_usage", "-1"),
    ("negative local prefill", PAIR + "router: {local_prefill_max_tokens: -5}",
     "router.local_prefill_max_tokens", "-5"),
    ("heartbeat timeout below interval", PAIR + "heartbeat_interval_s: 2\nheartbeat_timeout_s: 1",
     "heartbeat_timeout_s", "1"),
    ("missing pools", "domains: [a]", "pools", "missing"),
]  # fmt: skip


@pytest.mark.parametrize(("text", "path", "value"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_topology_names_field_path_and_value(text: str, path: str, value: str) -> None:
    with pytest.raises(TopologyError) as info:
        Topology.from_yaml_text(text, source="bad.yaml")
    assert str(info.value).startswith("bad.yaml: ")
    assert f"{path}: {value}" in str(info.value)


def test_topology_error_is_a_value_error() -> None:
    assert issubclass(TopologyError, ValueError)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("pools: {colocated: [", "not valid YAML"),
        ("pools: {colocated: {replicas: 1}}\npools: {}\n", "duplicate key 'pools'"),
        ("- a\n- b\n", "got ['a', 'b']"),
        ("", "got None"),
        ("just a string", "got 'just a string'"),
    ],
    ids=["syntax", "duplicate key", "list", "empty", "scalar"],
)
def test_unusable_yaml_names_the_file(tmp_path: Path, text: str, needle: str) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text(text)
    with pytest.raises(TopologyError) as info:
        load_topology(path)
    assert str(info.value).startswith(f"{path}: ")
    assert needle in str(info.value)


def test_missing_file_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "nowhere.yaml"
    with pytest.raises(TopologyError) as info:
        load_topology(path)
    assert str(info.value).startswith(f"{path}: ")


# -- placement property ---------------------------------------------------------------------------

DOMAIN_NAMES = st.lists(
    st.from_regex(r"[a-z0-9]([a-z0-9-]{0,6}[a-z0-9])?", fullmatch=True),
    min_size=1,
    max_size=5,
    unique=True,
)


@st.composite
def layouts(draw: st.DrawFn) -> dict[str, Any]:
    domains = draw(DOMAIN_NAMES)
    pools: dict[str, Any] = {}
    disagg = draw(st.booleans())
    sizes = {
        "prefill": draw(st.integers(1, 8)) if disagg else 0,
        "decode": draw(st.integers(1, 8)) if disagg else 0,
        "colocated": draw(st.integers(0 if disagg else 1, 8)),
    }
    for role, replicas in sizes.items():
        pool: dict[str, Any] = {
            "replicas": replicas,
            "spread": draw(st.sampled_from(["round_robin", "pack"])),
        }
        if draw(st.booleans()):
            allowed = draw(st.permutations(domains))
            pool["domains"] = allowed[: draw(st.integers(1, len(allowed)))]
        pools[role] = pool
    return {"domains": domains, "pools": pools}


@given(layouts())
def test_placement_property(layout: dict[str, Any]) -> None:
    topology = Topology.from_yaml_text(yaml.safe_dump(layout))
    workers = topology.workers()
    assert len({w.name for w in workers}) == len(workers)
    for role, pool in layout["pools"].items():
        mine = [w for w in workers if w.role == role]
        assert [w.name for w in mine] == [f"{role}-{i}" for i in range(pool["replicas"])]
        allowed = pool.get("domains", layout["domains"])
        counts = Counter(w.domain for w in mine)
        assert set(counts) <= set(allowed)
        if pool["spread"] == "round_robin":
            per_domain = [counts[d] for d in allowed]
            assert max(per_domain) - min(per_domain) <= 1
        else:
            assert set(counts) <= {allowed[0]}


def test_serve_section_errors_name_the_field_but_never_an_api_key() -> None:
    base = "pools: {prefill: {replicas: 1}, decode: {replicas: 1}}\n"
    text = base + "serve: {gate: {api_keys: {'sk-secret value': alice}}}\n"
    with pytest.raises(TopologyError) as info:
        Topology.from_yaml_text(text)
    assert "serve.gate.api_keys" in str(info.value)
    assert "sk-secret" not in str(info.value)
    ok = Topology.from_yaml_text(base + "serve: {gate: {api_keys: {sk-1: alice}}}\n")
    assert ok.serve.gate.api_keys == {"sk-1": "alice"}


def test_local_demo_is_local_with_the_demo_model() -> None:
    """The chaos harness's default (local-demo.yaml) is what users serve (local.yaml, the real
    model) but for the model: the two files cannot drift apart."""
    served, demo = (load_topology(TOPOLOGIES / f) for f in ("local.yaml", "local-demo.yaml"))
    assert (served.model.builtin, served.model.name) == ("smollm2-135m-instruct",) * 2
    assert (demo.model.builtin, demo.model.name) == ("demo", "demo-tiny-llama")
    assert served.model_copy(update={"model": demo.model}) == demo
