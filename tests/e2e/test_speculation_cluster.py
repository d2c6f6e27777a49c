"""Speculative decoding through the cluster (docs/design.md#speculative-decoding): decode workers
that draft and verify serve a prefill/decode pair the same token ids and logprobs as one plain
engine in this process -- greedy and seeded, and when the decode worker is killed mid-stream and
the request migrates to the other one, which speculates on from the tokens the client has. The
drafts show in ``/metrics``.

Every pool keeps its KV in int8 (docs/design.md#int8-kv), as the plain engine does: the prefill
worker's int8 blocks cross gRPC as they are, and the migration's re-prefill writes the bytes the
first decode worker had."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest
import ray
from helpers import Listed, clear_faults, completion_logprobs, engine_logprobs

from chaos import probe
from contracts.faults import Fault, FaultAction, FaultPlan, FaultPoint
from contracts.roles import NAMESPACE
from engine.config import EngineConfig
from engine.engine import LLMEngine

pytestmark = pytest.mark.e2e
MODEL = "test-llama"
ENGINE = {"kv_cache_bytes": 4 * 2**20, "max_num_seqs": 8, "kv_cache_dtype": "int8"}
# Drafting on every one-token match whatever the record: the most verification per token.
SPECULATIVE = {"k": 6, "min_n": 1, "threshold": 0.0}
WORKERS = ("prefill-0", "decode-0", "decode-1")
TOPOLOGY = """
model: {{path: {path}, name: test-llama, dtype: bfloat16}}
domains: [a, b]
pools:
  prefill: {{replicas: 1, num_cpus: 0.5, engine: {engine}}}
  decode: {{replicas: 2, num_cpus: 0.5, engine: {decode}}}
transport: grpc
router: {{local_prefill_max_tokens: 0}}
retry: {{max_attempts: 3, budget_ratio: 1.0, backoff_s: 0.0, deadline_s: 60}}
heartbeat_interval_s: 0.2
heartbeat_timeout_s: 5.0
"""
PROMPT = [(53 * i + 7) % 2000 + 8 for i in range(10)] * 4  # a repeating prompt: drafts to take
KINDS: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0, "max_tokens": 40, "logprobs": 2},
    # Cool: the random model's hotter draws seldom repeat a context token, so nothing drafts.
    "seeded": {"temperature": 0.2, "seed": 5, "max_tokens": 40, "logprobs": 2},
}


@pytest.fixture(scope="module")
def client(
    serve_app: Callable[[Path], str], bf16_llama: Path, tmp_path_factory: pytest.TempPathFactory
) -> openai.OpenAI:
    topology = tmp_path_factory.mktemp("speculation") / "topology.yaml"
    decode = {**ENGINE, "speculative": SPECULATIVE}
    topology.write_text(TOPOLOGY.format(path=bf16_llama, engine=ENGINE, decode=decode))
    return openai.OpenAI(base_url=f"{serve_app(topology)}/v1", api_key="-", max_retries=0)


def reference(path: Path, kind: str) -> Listed:
    """One plain engine's answer, as the completions API lists it."""
    engine = LLMEngine.from_checkpoint(path, EngineConfig(dtype="bfloat16", **ENGINE))
    return engine_logprobs(engine, PROMPT, **KINDS[kind])


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_speculating_cluster_serves_one_plain_engines_bits_through_a_migration(
    client: openai.OpenAI, bf16_llama: Path, kind: str
) -> None:
    url = str(client.base_url).removesuffix("/v1/")
    drafted = sum(probe.metric(url, "tandem_spec_decode_num_draft_tokens_total"))
    want = reference(bf16_llama, kind)
    assert completion_logprobs(client, MODEL, PROMPT, **KINDS[kind]) == want
    deadline = time.time() + 10  # the decode worker reports once the request ended
    while sum(probe.metric(url, "tandem_spec_decode_num_draft_tokens_total")) <= drafted:
        assert time.time() < deadline, "no drafts counted"
        time.sleep(0.2)

    before = sum(probe.metric(url, "tandem_migrations_total"))
    for name in ("decode-0", "decode-1"):
        fault = Fault(FaultPoint.DECODE_TOKENS, FaultAction.CRASH, at=9, attempt=1)
        ray.get(
            ray.get_actor(name, namespace=NAMESPACE).set_faults.remote(FaultPlan([fault])),
            timeout=60,
        )
    try:
        moved = completion_logprobs(client, MODEL, PROMPT, **KINDS[kind])
    finally:
        clear_faults(WORKERS)
    assert sum(probe.metric(url, "tandem_migrations_total")) == before + 1
    assert moved == want
