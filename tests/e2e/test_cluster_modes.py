"""The cluster's other shapes on the same Ray session (after test_cluster.py's cluster is gone):
colocated only (the baseline), torch.distributed (gloo) KV transport with local prefill of
short prompts, a herding guard that spreads a hot prefix, a client that leaves mid-stream, and
a request no decode worker has room for."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Coroutine, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from test_cluster import (
    ENGINE,
    GREEDY,
    SEEDED,
    assert_clean,
    collect,
    collect_with_logprobs,
    expected,
    expected_with_logprobs,
    prompt,
)

from cluster.retry import RetriesExhausted
from contracts.roles import Transport
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.request import EngineRequest, RequestStatus
from tandem import launch as launch_module
from tandem.launch import Cluster, ClusterMismatch, start_cluster
from tandem.topology import Topology

pytestmark = pytest.mark.e2e
LOOP = asyncio.new_event_loop()
COLOCATED = """
model: {{path: {path}, name: test-llama}}
pools:
  prefill: {{replicas: 0}}
  decode: {{replicas: 0}}
  colocated: {{replicas: 2, num_cpus: 0.5, engine: {engine}}}
"""
TORCH = """
model: {{path: {path}, name: test-llama}}
domains: [a, b]
pools:
  prefill: {{replicas: 2, num_cpus: 0.5, engine: {engine}}}
  decode: {{replicas: 1, num_cpus: 0.5, engine: {engine}}}
transport: auto
router: {{local_prefill_max_tokens: 8, herding_guard: 1}}
"""

# The decode worker's pool holds 64 blocks (1024 tokens of test-llama, 8 KiB a block).
SMALL_DECODE = """
model: {{path: {path}, name: test-llama}}
pools:
  prefill: {{replicas: 1, num_cpus: 0.5, engine: {engine}}}
  decode: {{replicas: 1, num_cpus: 0.5, engine: {{kv_cache_bytes: 524288}}}}
router: {{local_prefill_max_tokens: 0}}
retry: {{max_attempts: 3, budget_ratio: 1.0, backoff_s: 0.0}}
"""


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    return LOOP.run_until_complete(asyncio.wait_for(coro, 240))


@pytest.fixture(scope="module")
def colocated(bf16_llama: Path) -> LLMEngine:
    return LLMEngine.from_checkpoint(bf16_llama, EngineConfig(**ENGINE), model_id="test-llama")


@contextmanager
def launch(text: str, path: Path) -> Iterator[Cluster]:
    c = run(start_cluster(Topology.from_yaml_text(text.format(path=path, engine=ENGINE)), path))
    try:
        yield c
    finally:
        run(c.shutdown())


def test_colocated_topology_serves_the_same_tokens(
    ray_session: None, bf16_llama: Path, colocated: LLMEngine
) -> None:
    cases = [(prompt(n, n), p) for n in (5, 40) for p in (GREEDY, SEEDED)]

    async def body(c: Cluster) -> None:
        got = await asyncio.gather(*(collect(c, t, p) for t, p in cases))
        assert got == [expected(colocated, t, p) for t, p in cases]
        modes = {d["mode"] for d in await c.router.decisions()}
        assert modes == {"colocated"}
        records = c.coordinator.records[-len(cases) :]
        assert all(r.queue_time_s is not None and r.queue_time_s >= 0 for r in records)
        await assert_clean(c)

    with launch(COLOCATED, bf16_llama) as c:
        run(body(c))


def test_a_second_ingress_attaches_to_the_running_cluster_and_never_starts_another(
    ray_session: None, bf16_llama: Path, colocated: LLMEngine
) -> None:
    """What a second (or replacement) ingress replica does: ``start_cluster`` with the same
    topology finds the detached actors by name -- the same actors, with their caches -- and
    its own coordinator serves through them; another topology under the same names is
    refused (ClusterMismatch), leaving the running cluster as it was."""
    topology = Topology.from_yaml_text(COLOCATED.format(path=bf16_llama, engine=ENGINE))

    async def body(first: Cluster) -> None:
        tokens = prompt(40, 7)
        assert await collect(first, tokens, GREEDY) == expected(colocated, tokens, GREEDY)
        second = await start_cluster(topology, bf16_llama)
        ids = {n: w.handle._actor_id for n, w in first.workers.items()}
        assert {n: w.handle._actor_id for n, w in second.workers.items()} == ids
        assert second.router.handle._actor_id == first.router.handle._actor_id
        assert second.coordinator.consumer != first.coordinator.consumer
        await asyncio.sleep(0.5)  # the first request's blocks reach the router
        assert await collect(second, tokens, GREEDY) == expected(colocated, tokens, GREEDY)
        last = (await second.router.decisions())[-1]
        assert last["hit_blocks"] == 2  # the cache the first coordinator's request left
        other = topology.model_copy(update={"heartbeat_timeout_s": 9.0})
        with pytest.raises(ClusterMismatch, match="another topology or model"):
            await start_cluster(other, bf16_llama)
        assert {n: w.handle._actor_id for n, w in first.workers.items()} == ids
        await assert_clean(first)

    with launch(COLOCATED, bf16_llama) as c:
        run(body(c))


def test_torch_transport_local_prefill_herding_and_cancel(
    ray_session: None, bf16_llama: Path, colocated: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``transport: auto`` where the workers have CUDA (detection faked: these workers run on
    CPU, so torch.distributed takes gloo) is the torch transport, end to end."""
    monkeypatch.setattr(launch_module, "workers_have_cuda", lambda topology: True)

    async def body(c: Cluster) -> None:
        assert c.transport is Transport.TORCH
        # Over torch.distributed (gloo), and a short prompt prefilled on the decode worker.
        cases = [(prompt(60, 1), SEEDED), (prompt(6, 2), GREEDY)]
        got = [await collect_with_logprobs(c, t, p) for t, p in cases]
        assert got == [expected_with_logprobs(colocated, t, p) for t, p in cases]
        [pull] = await c.workers["decode-0"].transfer_records()
        assert pull.transport == "torch" and pull.num_bytes > 0
        modes = [d["mode"] for d in await c.router.decisions()]
        assert modes == ["disaggregated", "local_prefill"]
        # A hot prefix, many at once: the guard keeps affinity from piling them on one.
        hot = prompt(48, 3)
        await collect(c, hot + [1], GREEDY)
        await asyncio.sleep(0.3)
        tails = [prompt(12, 100 + i) for i in range(8)]  # > local_prefill_max_tokens
        await asyncio.gather(*(collect(c, hot + tail, GREEDY) for tail in tails))
        recent = (await c.router.decisions())[-8:]
        assert {d["prefill"] for d in recent} == {"prefill-0", "prefill-1"}
        assert any(d["hit_blocks"] == 3 for d in recent)
        # A client that leaves mid-stream: the request is cancelled, every pool recovers.
        spec = EngineRequest("leaver", tuple(prompt(30, 4)), GREEDY, arrival_time=time.time())
        stream = c.coordinator.generate(spec)
        await stream.__anext__()
        await stream.__anext__()
        await stream.aclose()
        assert c.coordinator.records[-1].status is RequestStatus.CANCELLED
        await assert_clean(c)

    with launch(TORCH, bf16_llama) as c:
        run(body(c))


def test_a_request_no_decode_worker_has_room_for_ends_as_a_capacity_rejection(
    ray_session: None, test_llama: Path
) -> None:
    """The decode worker refuses a prompt its pool cannot hold (phase 2) and is excluded; the
    retries then find no replica. The request ends ``rejected`` (the API's 503 kv_capacity),
    not as a generic failure, and the prefill worker's lease is given back."""

    async def body(c: Cluster) -> None:
        with pytest.raises(RetriesExhausted) as info:
            await collect(c, prompt(1100), GREEDY)
        assert info.value.rejected and info.value.attempts == 3, info.value
        assert c.coordinator.records[-1].status is RequestStatus.REJECTED
        cause = info.value.cause  # the router's own words, not a Ray traceback
        assert re.fullmatch(
            r"no replica: no decode replica for request '\w+@3': decode-0 excluded", cause
        )
        await assert_clean(c)

    with launch(SMALL_DECODE, test_llama) as c:
        run(body(c))


SIZED = """
model: {{path: {path}, name: test-llama}}
pools:
  colocated: {{replicas: 1, num_cpus: 0.5, memory_bytes: 134217728, kv_memory_fraction: 0.25}}
"""


def test_a_pool_without_kv_limits_is_sized_from_the_memory_ray_gives_it(
    ray_session: None, test_llama: Path
) -> None:
    """The worker Ray starts has the KV blocks and batch slots sizing computed for its memory
    (128 MiB here, reserved as Ray's `memory` resource), and serves with them."""
    import ray

    from engine.loader import read_model_config
    from tandem.launch import sized_workers

    topology = Topology.from_yaml_text(SIZED.format(path=test_llama))
    [spec] = sized_workers(topology, test_llama, ray.cluster_resources()["memory"])
    model, _ = read_model_config(test_llama)
    free = ray.available_resources().get("memory", 0.0)
    with launch(SIZED, test_llama) as c:
        info = c.infos["colocated-0"]
        block_bytes = 16 * model.kv_bytes_per_token()
        assert info.num_kv_blocks == spec.engine.kv_cache_bytes // block_bytes > 0
        assert info.max_num_seqs == spec.engine.max_num_seqs > 1
        assert free - ray.available_resources().get("memory", 0.0) == 128 * 2**20  # reserved
        tokens = run(collect(c, prompt(12, 1), GREEDY))
        assert len(tokens) == GREEDY.max_tokens
        run(assert_clean(c))
