"""What the coordinator asks the router for, without Ray: a request that scores its prompt
(``prompt_logprobs``) computes all of it -- no prefix hit in the engine -- so its route carries no
prefix hashes and the router gives it no cache credit; any other request's route carries the
prompt's salted block hashes, the same the workers' KV events publish."""

from __future__ import annotations

import asyncio

import pytest

from cluster.client_stream import ClientStream
from cluster.coordinator import Coordinator
from cluster.retry import Exclusions, RetryPolicy
from contracts.messages import WorkerInfo
from contracts.roles import Role
from contracts.routing import RouteRequest
from engine.kv_cache_manager import prefix_hashes
from engine.request import EngineRequest
from engine.sampling_params import SamplingParams

PROMPT = tuple(range(3, 43))  # 40 tokens: two full blocks of 16


class _Routed(Exception):
    """The route reached the router: the attempt goes no further here."""


@pytest.mark.parametrize("prompt_logprobs", [None, 2], ids=["generates", "scores-its-prompt"])
def test_only_a_request_scoring_its_prompt_routes_without_prefix_hashes(
    prompt_logprobs: int | None,
) -> None:
    info = WorkerInfo("decode-0", Role.DECODE, "a", None, block_size=16, incarnation="i")
    c = Coordinator(None, {}, {"decode-0": info}, "m", RetryPolicy(), unavailable_wait_s=1.0)  # type: ignore[arg-type]
    routes: list[RouteRequest] = []

    async def admit(route: RouteRequest, deadline: float | None) -> None:
        routes.append(route)
        raise _Routed

    c._admit = admit  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=4, prompt_logprobs=prompt_logprobs)
    attempt = EngineRequest("r", PROMPT, params, cache_salt="tenant-a", attempt=1)

    async def body() -> None:
        await anext(c._run_attempt(attempt, ClientStream(attempt), Exclusions()))

    with pytest.raises(_Routed):
        asyncio.run(asyncio.wait_for(body(), 5.0))
    [route] = routes
    expected = [] if prompt_logprobs else prefix_hashes(PROMPT, 16, "tenant-a", "m")
    assert route.prompt_hashes == expected
    assert len(expected) in (0, 2)
    assert (route.num_prompt_tokens, route.tenant) == (40, "tenant-a")
