"""A worker's heartbeats, against a real router actor: a long engine step keeps them going (a
busy worker is not a dead one); an engine silent past ``ENGINE_SILENCE_S`` stops them, so the
router's heartbeat timeout marks the worker FAILED."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import ray

from cluster import worker as worker_module
from cluster.worker import EngineWorker
from contracts.roles import Role
from engine.config import EngineConfig
from router.actor import RouterActor
from router.config import RouterConfig

pytestmark = pytest.mark.e2e
NAMESPACE = "tandem-reports-test"
HEARTBEAT_TIMEOUT_S = 1.5


async def _healthy_while(router: Any, work: asyncio.Future[None]) -> set[bool]:
    """Every health the router reported for the worker while ``work`` ran."""
    seen: set[bool] = set()
    while not work.done():
        [state] = await router.worker_states.remote()
        seen.add(state.healthy)
        await asyncio.sleep(0.05)
    await work
    return seen


def test_a_long_step_keeps_heartbeats_and_a_hung_engine_falls_silent(
    ray_session: None, test_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(worker_module, "ENGINE_SILENCE_S", 3.0)
    router_name = f"router-{uuid.uuid4().hex[:8]}"
    router: Any = (
        ray.remote(RouterActor)
        .options(name=router_name, namespace=NAMESPACE, num_cpus=0.05)
        .remote([("w", Role.COLOCATED, "a")], RouterConfig(), HEARTBEAT_TIMEOUT_S, NAMESPACE)
    )
    config = EngineConfig(kv_cache_bytes=2**20, max_num_seqs=4, max_num_batched_tokens=64)
    worker = EngineWorker(
        "w", "a", str(test_llama), "test-llama", config, router_name, 0.05, NAMESPACE
    )

    async def body() -> None:
        await worker.ready()
        await router.wait_ready.remote(30.0)
        loop = asyncio.get_running_loop()

        def step(seconds: float) -> asyncio.Future[None]:
            """The engine thread busy for ``seconds``, as inside one long step."""
            return loop.create_task(worker.engine.call(lambda e: time.sleep(seconds)))

        # Longer than the heartbeat timeout, shorter than the silence limit: still healthy.
        assert await _healthy_while(router, step(2.5 * HEARTBEAT_TIMEOUT_S)) == {True}
        # Hung: the reports stop after ENGINE_SILENCE_S, the router's timeout finds it.
        started = time.time()
        assert False in await _healthy_while(router, step(7.0))
        assert time.time() - started >= worker_module.ENGINE_SILENCE_S

    try:
        asyncio.run(body())
    finally:
        if worker._reporter is not None:
            worker._reporter.cancel()
        worker.engine.shutdown()
        ray.kill(router)
