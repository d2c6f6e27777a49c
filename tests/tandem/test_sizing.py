"""Engine limits sized from the machine: a pool that leaves its KV cache out gets it from the
memory Ray gives each worker; one that sets it is left alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.loader import load_checkpoint, read_model_config
from tandem.launch import sized_workers
from tandem.sizing import MAX_AUTO_SEQS, sized_engine
from tandem.topology import Topology

GiB = 2**30


def topology(path: Path, pools: str) -> Topology:
    return Topology.from_yaml_text(f"model: {{path: {path}}}\ndomains: [a, b]\npools:\n{pools}")


def test_read_model_config_is_what_loading_reads(test_llama: Path) -> None:
    config, weights = read_model_config(test_llama)
    loaded = load_checkpoint(test_llama)
    assert config == loaded.config
    assert weights == sum(t.numel() * t.element_size() for t in loaded.weights.values())
    bf16, half = read_model_config(test_llama, "bfloat16")
    assert (half, bf16.kv_bytes_per_token()) == (weights // 2, config.kv_bytes_per_token() // 2)


def test_left_out_kv_is_a_fraction_of_the_memory_share_and_slots_follow(test_llama: Path) -> None:
    model, weights = read_model_config(test_llama)
    topo = topology(
        test_llama,
        """
  prefill: {replicas: 1, engine: {max_num_batched_tokens: 256}}
  decode: {replicas: 2, kv_memory_fraction: 0.25, engine: {max_num_seqs: 7}}
  """,
    )
    prefill, decode0, decode1 = sized_workers(topo, test_llama, cluster_memory=3 * GiB + 2)
    assert prefill.memory_bytes == decode0.memory_bytes == decode1.memory_bytes == GiB
    context_bytes = model.max_position_embeddings * model.kv_bytes_per_token()  # whole blocks
    kv = int(0.5 * (GiB - weights))
    seqs = min(MAX_AUTO_SEQS, kv // context_bytes)
    assert prefill.engine == EngineConfig(
        kv_cache_bytes=min(kv, seqs * context_bytes),
        max_num_seqs=seqs,
        max_num_batched_tokens=256,
    )
    # Seven slots fill at most seven full contexts: no more KV than that.
    assert decode0.engine == EngineConfig(
        kv_cache_bytes=min(int(0.25 * (GiB - weights)), 7 * context_bytes), max_num_seqs=7
    )
    assert decode1.engine == decode0.engine


def test_an_int8_cache_gets_slots_for_its_smaller_rows(test_llama: Path) -> None:
    """``kv_cache_dtype: int8``: the same memory holds ``2d / (d + 4)`` times the full contexts
    (the test model's fp32 rows are 4d bytes a head, int8 ones d + 4), and the slots follow."""
    model, weights = read_model_config(test_llama)
    d = model.head_dim
    assert model.kv_bytes_per_token("int8") * 4 * d == model.kv_bytes_per_token() * (d + 4)
    memory = weights + 8 * model.max_position_embeddings * model.kv_bytes_per_token()
    plain, small = (
        sized_engine(EngineConfig(kv_cache_dtype=kv), memory, model, weights, 0.5)  # type: ignore[arg-type]
        for kv in ("auto", "int8")
    )
    kv = int(0.5 * (memory - weights))
    for config, per_token in (
        (plain, model.kv_bytes_per_token()),
        (small, model.kv_bytes_per_token("int8")),
    ):
        context_bytes = model.max_position_embeddings * per_token
        assert config.max_num_seqs == min(MAX_AUTO_SEQS, kv // context_bytes)
    assert (plain.max_num_seqs, small.max_num_seqs) == (4, 4 * 4 * d // (d + 4))


def test_on_a_labelled_cluster_each_worker_shares_its_domains_memory(test_llama: Path) -> None:
    """Two workers on domain b's node and one on a's: b's memory is halved, a's is whole (an
    equal share of the whole cluster would ask b's node for more than it has)."""
    topo = topology(
        test_llama,
        """
  prefill: {replicas: 1, domains: [a]}
  decode: {replicas: 2, domains: [b]}
  """,
    )
    prefill, decode0, decode1 = sized_workers(
        topo, test_llama, cluster_memory=5 * GiB, domain_memory={"a": GiB, "b": 4 * GiB}
    )
    assert (prefill.domain, decode0.domain, decode1.domain) == ("a", "b", "b")
    assert prefill.memory_bytes == GiB
    assert decode0.memory_bytes == decode1.memory_bytes == 2 * GiB


def test_a_pool_that_sets_its_kv_is_left_alone_and_reserves_nothing(test_llama: Path) -> None:
    topo = topology(
        test_llama,
        """
  colocated: {replicas: 1, engine: {kv_cache_bytes: 4194304}}
  """,
    )
    [worker] = sized_workers(topo, test_llama, cluster_memory=64 * GiB)
    assert worker.memory_bytes is None
    assert worker.engine == EngineConfig(kv_cache_bytes=4 * 2**20)


def test_a_pools_own_memory_is_used_and_reserved(test_llama: Path) -> None:
    topo = topology(
        test_llama,
        """
  colocated: {replicas: 2, memory_bytes: 536870912}
  """,
    )
    workers = sized_workers(topo, test_llama, cluster_memory=64 * GiB)
    assert [w.memory_bytes for w in workers] == [512 * 2**20] * 2


def test_the_slots_are_the_full_context_sequences_the_kv_holds(test_llama: Path) -> None:
    model, _ = read_model_config(test_llama)
    per_block = 16 * model.kv_bytes_per_token()
    context = 64  # max_model_len caps the model's context
    engine = EngineConfig(max_model_len=context)
    for sequences in (1, 3, 40):
        kv_bytes = sequences * context // 16 * per_block + per_block - 1  # not one block more
        sized = sized_engine(engine, 2 * kv_bytes + 1000, model, 1000, 0.5)
        assert sized.max_num_seqs == sequences, sequences
    huge = sized_engine(engine, 10**12, model, 1000, 0.5)
    assert huge.max_num_seqs == MAX_AUTO_SEQS
    assert huge.kv_cache_bytes == MAX_AUTO_SEQS * context // 16 * per_block  # what they fill


def test_memory_that_holds_no_kv_block_is_a_clear_error(test_llama: Path) -> None:
    model, weights = read_model_config(test_llama)
    with pytest.raises(ValueError, match="leave no KV cache once the weights"):
        sized_engine(EngineConfig(), weights + 100, model, weights, 0.5)


def test_sizing_waits_for_every_domains_node_then_names_the_missing_one(
    test_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cluster ``ray up`` just launched adds its labelled nodes one by one: the memory per
    domain is read once every domain the workers need has one; a domain that never gets a node
    is a DomainMissing naming it."""
    import asyncio

    from tandem import launch

    topo = topology(
        test_llama,
        "  prefill: {replicas: 1, domains: [a]}\n  decode: {replicas: 1, domains: [b]}\n",
    )
    joined = [{"a": 1.0}, {"a": 1.0}, {"a": 1.0, "b": 2.0}]
    calls: list[str] = []

    def nodes(label_key: str) -> dict[str, float]:
        calls.append(label_key)
        return joined[min(len(calls), len(joined)) - 1]

    monkeypatch.setattr(launch, "memory_by_domain", nodes)
    assert asyncio.run(launch.domain_memory(topo)) == {"a": 1.0, "b": 2.0}
    assert calls == ["tandem/failure-domain"] * 3
    joined[:] = [{"a": 1.0}]
    with pytest.raises(
        launch.DomainMissing, match="tandem/failure-domain=b .* labelled nodes: \\['a'\\]"
    ):
        asyncio.run(launch.domain_memory(topo, timeout_s=0.0))
