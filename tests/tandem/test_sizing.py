"""Engine limits sized from the machine: a pool that leaves its KV cache out gets it from the
memory Ray gives each worker; one that sets it is left alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.loader import load_checkpoint, read_model_config
from tandem.launch import sized_workers
from tandem.sizing import sized_engine
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


def test_left_out_kv_is_a_fraction_of_the_memory_share(test_llama: Path) -> None:
    model, weights = read_model_config(test_llama)
    topo = topology(
        test_llama,
        """
  prefill: {replicas: 1, engine: {max_num_batched_tokens: 256}}
  decode: {replicas: 2, kv_memory_fraction: 0.25, engine: {max_num_seqs: 7}}
  """,
    )
    context_bytes = model.max_position_embeddings * model.kv_bytes_per_token()  # whole blocks
    share = weights + 64 * context_bytes  # half of it after the weights fills half the slots
    prefill, decode0, decode1 = sized_workers(topo, test_llama, cluster_memory=3 * share + 2)
    assert prefill.memory_bytes == decode0.memory_bytes == decode1.memory_bytes == share
    kv = int(0.5 * (share - weights))
    # The slots stay the engine's (64): admission's reservations keep requests within the KV.
    assert prefill.engine == EngineConfig(kv_cache_bytes=kv, max_num_batched_tokens=256)
    assert prefill.engine.max_num_seqs == 64
    # Seven slots fill at most seven full contexts: no more KV than that.
    assert 7 * context_bytes < int(0.25 * (share - weights))
    assert decode0.engine == EngineConfig(kv_cache_bytes=7 * context_bytes, max_num_seqs=7)
    assert decode1.engine == decode0.engine


def test_an_int8_cache_holds_more_tokens_in_the_same_memory(test_llama: Path) -> None:
    """``kv_cache_dtype: int8``: the same bytes hold ``4d / (d + 4)`` times the tokens (the
    test model's fp32 rows are 4d bytes a head, int8 ones d + 4); the slots do not change."""
    model, weights = read_model_config(test_llama)
    d = model.head_dim
    assert model.kv_bytes_per_token("int8") * 4 * d == model.kv_bytes_per_token() * (d + 4)
    memory = weights + 8 * model.max_position_embeddings * model.kv_bytes_per_token()
    plain, small = (
        sized_engine(EngineConfig(kv_cache_dtype=kv), memory, model, weights, 0.5)  # type: ignore[arg-type]
        for kv in ("auto", "int8")
    )
    assert plain.kv_cache_bytes == small.kv_cache_bytes == int(0.5 * (memory - weights))
    assert plain.max_num_seqs == small.max_num_seqs == 64
    tokens = [
        c.kv_cache_bytes // model.kv_bytes_per_token(c.kv_cache_dtype) for c in (plain, small)
    ]
    assert tokens[1] // tokens[0] == 4 * d // (d + 4)


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


def test_the_kv_is_never_more_than_the_slots_fill(test_llama: Path) -> None:
    """The cache stops at a full-context sequence in every slot (memory it could never use);
    below that the memory decides, and the slots stay what the engine says."""
    model, _ = read_model_config(test_llama)
    per_block = 16 * model.kv_bytes_per_token()
    context = 64  # max_model_len caps the model's context
    for slots in (1, 3, 64):
        engine = EngineConfig(max_model_len=context, max_num_seqs=slots)
        fill = slots * context // 16 * per_block
        huge = sized_engine(engine, 10**12, model, 1000, 0.5)
        assert (huge.kv_cache_bytes, huge.max_num_seqs) == (fill, slots)
        some = sized_engine(engine, 2 * (fill - 1) + 1000, model, 1000, 0.5)
        assert (some.kv_cache_bytes, some.max_num_seqs) == (fill - 1, slots)
    assert sized_engine(EngineConfig(max_model_len=context), 10**12, model, 1000, 0.5) == (
        EngineConfig(max_model_len=context, kv_cache_bytes=64 * context // 16 * per_block)
    )


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
