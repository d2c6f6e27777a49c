"""Overload through the real endpoint (P9, docs/design.md#cluster-admission): more concurrent
streams than the cluster has batch slots. Every accepted stream completes in full and equals
the engine; what cannot wait is refused before its first byte with a real HTTP status (429 +
Retry-After, 504), and a client that leaves while queued leaves the queue.

One prefill and one decode worker with 4 batch slots each, a queue bound of 8; the clients are
the official ``openai`` client and raw HTTP.
"""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest
import ray
import requests

from chaos import probe
from chaos.load import InThread, Sender, requests_of
from contracts.faults import Fault, FaultAction, FaultPlan, FaultPoint
from contracts.roles import NAMESPACE, ROUTER_NAME
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer

pytestmark = pytest.mark.e2e
MODEL = "test-llama"
SLOTS = 4
BOUND = 8
ENGINE = {"kv_cache_bytes": 8 * 2**20, "max_num_seqs": SLOTS, "max_num_batched_tokens": 256}
TOPOLOGY = """
model: {{path: {path}, name: test-llama}}
domains: [a, b]
pools:
  prefill: {{replicas: 1, num_cpus: 0.5, engine: {engine}}}
  decode: {{replicas: 1, num_cpus: 0.5, engine: {engine}}}
transport: grpc
router:
  local_prefill_max_tokens: 0
  admission: {{max_queued: {bound}, predict_wait: false}}
retry: {{max_attempts: 3, budget_ratio: 1.0, backoff_s: 0.0}}
heartbeat_interval_s: 0.2
heartbeat_timeout_s: 5.0
"""


@pytest.fixture(scope="module")
def server(
    serve_app: Callable[[Path], str], test_llama: Path, tmp_path_factory: pytest.TempPathFactory
) -> str:
    topology = tmp_path_factory.mktemp("overload") / "topology.yaml"
    topology.write_text(TOPOLOGY.format(path=test_llama, engine=ENGINE, bound=BOUND))
    return serve_app(topology)


@pytest.fixture(scope="module")
def engine(test_llama: Path) -> LLMEngine:
    return LLMEngine.from_checkpoint(test_llama, EngineConfig(**ENGINE), model_id=MODEL)


def queue_stats() -> tuple[int, int]:
    """(waiting now, the most that ever waited) in the router's admission queue."""
    router = ray.get_actor(ROUTER_NAME, namespace=NAMESPACE)
    return ray.get(router.queue_stats.remote(), timeout=30)  # type: ignore[no-any-return]


def workers_idle() -> None:
    for name in ("prefill-0", "decode-0"):
        ray.get(ray.get_actor(name, namespace=NAMESPACE).check_idle.remote(), timeout=120)


def metric(server: str, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels`` (0: none exported)."""
    return sum(probe.metric(server, name, **labels))


def long_body(tag: str, max_tokens: int = 1500) -> dict[str, Any]:
    return {
        "model": MODEL,
        "prompt": f"hold {tag}",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


class Holders:
    """Streams that occupy the cluster (read slowly to the end)."""

    def __init__(self, server: str, n: int, tag: str) -> None:
        bodies = [long_body(f"{tag}{i}") | {"logprobs": 0} for i in range(n)]  # counts tokens
        self.load = InThread(Sender(server, MODEL, hang_bound_s=300.0), requests_of(bodies))
        self.results: list[int] = []

    def join(self) -> None:
        outcomes = self.load.join(timeout_s=310)
        assert all(o.status == "ok" for o in outcomes), [o.error for o in outcomes]
        self.results = [o.num_tokens for o in outcomes]


def wait_until(predicate: Any, timeout_s: float = 60.0) -> None:
    until = time.time() + timeout_s
    while not predicate():
        assert time.time() < until, "timed out waiting"
        time.sleep(0.05)


def test_three_times_the_batch_slots_all_complete_and_equal_the_engine(
    server: str, engine: LLMEngine, demo_tok: Tokenizer
) -> None:
    """3x the batch slots at once: every stream gets exactly max_tokens tokens, its text is the
    engine's, none saw an error; some had to wait in the queue, which never passed its bound.
    Waiting spends no attempt and no retry token: every engine request is an attempt 1, none
    retried or migrated, the retry budget where it was."""
    prompts = [f"Story number {i} begins with" for i in range(3 * SLOTS)]
    max_tokens = 48
    bodies = [
        {"prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "logprobs": 0}
        for p in prompts
    ]
    errors_before = metric(server, "tandem_stream_errors_total")
    moved = ("tandem_retries_total", "tandem_migrations_total")
    moved_before = [metric(server, name) for name in moved]
    budget_before = metric(server, "tandem_retry_budget_tokens")
    outcomes = InThread(Sender(server, MODEL), requests_of(bodies)).join()
    results = [(o.text, o.choices[0].finish_reason, o.num_tokens) for o in outcomes]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for prompt, (text, finish, tokens) in zip(prompts, results, strict=True):
        [[want]] = engine.generate([demo_tok.encode(prompt)], params)
        assert (text, finish, tokens) == (want.text, "length", max_tokens), prompt
    waiting, deepest = queue_stats()
    assert waiting == 0 and 0 < deepest <= BOUND
    assert metric(server, "tandem_stream_errors_total") == errors_before == 0
    assert [metric(server, name) for name in moved] == moved_before
    assert metric(server, "tandem_retry_budget_tokens") == budget_before > 0
    workers_idle()
    for name in ("prefill-0", "decode-0"):
        records = ray.get(ray.get_actor(name, namespace=NAMESPACE).records.remote(), timeout=30)
        assert records and all(r.request_id.endswith("@1") for r in records), name


def test_past_the_queue_bound_the_excess_gets_429_and_a_client_that_retries_succeeds(
    server: str,
) -> None:
    """With the slots taken and the queue at its bound, one more request is refused before
    any byte of a stream: 429, Retry-After, OpenAI's error object. The official client,
    which honours Retry-After, gets through once the queue has room."""
    holders = Holders(server, SLOTS + BOUND, "bound")
    wait_until(lambda: queue_stats()[0] == BOUND)
    assert metric(server, "tandem_admission_queue_depth") == BOUND
    refused = requests.post(
        f"{server}/v1/completions", json=long_body("excess", 4), stream=True, timeout=30
    )
    assert refused.status_code == 429, refused.text
    assert refused.headers["content-type"].startswith("application/json")
    assert int(refused.headers["Retry-After"]) >= 1
    error = refused.json()["error"]
    assert (error["code"], error["type"]) == ("queue_full", "rate_limit_error")
    assert metric(server, "tandem_rejections_total", cause="queue_full") >= 1
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=50)
    out = client.completions.create(
        model=MODEL, prompt="patient", max_tokens=5, extra_body={"ignore_eos": True}
    )
    assert out.usage is not None and out.usage.completion_tokens == 5
    holders.join()
    assert holders.results == [1500] * (SLOTS + BOUND)
    assert queue_stats()[1] <= BOUND
    workers_idle()


def test_a_deadline_that_passes_in_the_queue_is_a_504_before_any_token(server: str) -> None:
    holders = Holders(server, SLOTS, "deadline")
    wait_until(lambda: metric(server, "tandem_running_requests", worker="decode-0") == SLOTS)
    started = time.time()
    late = requests.post(
        f"{server}/v1/completions",
        json=long_body("late", 4),
        headers={"X-Request-Timeout": "1.0"},
        stream=True,
        timeout=30,
    )
    assert late.status_code == 504, late.text
    assert late.json()["error"]["code"] == "deadline_passed_in_queue"
    assert 0.9 < time.time() - started < 5.0
    body_timeout = requests.post(
        f"{server}/v1/completions", json={**long_body("late2", 4), "timeout": 0.5}, timeout=30
    )
    assert body_timeout.status_code == 504, body_timeout.text
    assert queue_stats()[0] == 0
    holders.join()
    workers_idle()


def test_a_client_that_leaves_while_queued_leaves_the_queue(server: str) -> None:
    holders = Holders(server, SLOTS, "leave")
    wait_until(lambda: metric(server, "tandem_running_requests", worker="decode-0") == SLOTS)
    cancelled = metric(server, "tandem_requests_total", status="cancelled")
    host, port = server.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request(
        "POST",
        "/v1/completions",
        json.dumps(long_body("leaver", 4)),
        {"Content-Type": "application/json"},
    )
    wait_until(lambda: queue_stats()[0] == 1)
    conn.close()  # hang up before any byte of the response came
    wait_until(lambda: queue_stats()[0] == 0, timeout_s=10)
    wait_until(
        lambda: metric(server, "tandem_requests_total", status="cancelled") == cancelled + 1,
        timeout_s=10,
    )
    holders.join()
    records = ray.get(ray.get_actor("decode-0", namespace=NAMESPACE).records.remote())
    assert not [r for r in records if "leaver" in r.request_id]  # it never reached a worker
    workers_idle()


def test_a_stream_cut_after_its_first_token_is_an_error_event_and_is_counted(
    server: str,
) -> None:
    """The decode worker fails the attempt mid-stream and no other decode worker exists: the
    stream has its 200 and tokens, then one error event; tandem_stream_errors_total says so."""
    decode = ray.get_actor("decode-0", namespace=NAMESPACE)
    plan = FaultPlan([Fault(FaultPoint.DECODE_TOKENS, FaultAction.RAISE, at=3, attempt=1)])
    before = metric(server, "tandem_stream_errors_total", cause="failed")
    ray.get(decode.set_faults.remote(plan))
    try:
        with requests.post(
            f"{server}/v1/completions",
            json=long_body("cut", 20) | {"logprobs": 0},
            stream=True,
            timeout=60,
        ) as r:
            assert r.status_code == 200
            events = [line for line in r.iter_lines() if line.startswith(b"data: ")]
    finally:
        ray.get(decode.set_faults.remote(FaultPlan()))
    # A slow reader can get several tokens in one event: count them by their logprobs.
    chunks = [json.loads(e.removeprefix(b"data: ")) for e in events if b'"choices"' in e]
    tokens = [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]
    assert len(tokens) >= 2 and events[-1] == b"data: [DONE]"
    error = json.loads(events[-2].removeprefix(b"data: "))["error"]
    assert error["code"] == "failed"
    assert metric(server, "tandem_stream_errors_total", cause="failed") == before + 1
    workers_idle()
