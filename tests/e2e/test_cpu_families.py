"""A cluster mixing CPU families (docs/design.md#numerics-classes), on one machine: the prefill
worker runs PyTorch's AVX2 kernels (``ATEN_CPU_CAPABILITY: avx2`` in its pool's ``env``, as an
AVX2-only CPU does), the decode workers the machine's best (AVX-512 where it has it), every
engine in the portable layout (bf16, ``invariant_layout: columns``). A stream that crosses
between the two -- at the hand-off, and again when its decode worker is killed and it migrates
(its prompt and tokens prefilled again under AVX2) -- has the bits of one engine in this
process, token ids and logprobs. On an AVX2-only machine both sides run AVX2 and the test
shows nothing more than the other e2e tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest
import ray
import torch
from helpers import clear_faults, completion_logprobs, engine_logprobs

from chaos import probe
from contracts.faults import Fault, FaultAction, FaultPlan, FaultPoint
from contracts.roles import NAMESPACE
from engine.config import EngineConfig
from engine.engine import LLMEngine

pytestmark = pytest.mark.e2e
MODEL = "test-llama"
ENGINE = {"invariant_layout": "columns", "kv_cache_bytes": 4 * 2**20, "max_num_seqs": 8}
WORKERS = ("prefill-0", "decode-0", "decode-1")
TOPOLOGY = """
model: {{path: {path}, name: test-llama, dtype: bfloat16}}
domains: [a, b]
pools:
  prefill: {{replicas: 1, num_cpus: 0.5, engine: {engine}, env: {{ATEN_CPU_CAPABILITY: avx2}}}}
  decode: {{replicas: 2, num_cpus: 0.5, engine: {engine}}}
transport: grpc
router: {{local_prefill_max_tokens: 0}}
retry: {{max_attempts: 3, budget_ratio: 1.0, backoff_s: 0.0, deadline_s: 60}}
heartbeat_interval_s: 0.2
heartbeat_timeout_s: 5.0
"""
PROMPT = list(range(7, 47))
SAMPLED: dict[str, Any] = {"temperature": 1.0, "seed": 3, "max_tokens": 16, "logprobs": 2}


@pytest.fixture(scope="module")
def client(
    serve_app: Callable[[Path], str], bf16_llama: Path, tmp_path_factory: pytest.TempPathFactory
) -> openai.OpenAI:
    topology = tmp_path_factory.mktemp("cpu-families") / "topology.yaml"
    topology.write_text(TOPOLOGY.format(path=bf16_llama, engine=ENGINE))
    return openai.OpenAI(base_url=f"{serve_app(topology)}/v1", api_key="-", max_retries=0)


def actor(name: str) -> Any:
    return ray.get_actor(name, namespace=NAMESPACE)


def test_a_stream_crossing_cpu_families_keeps_one_engines_bits(
    client: openai.OpenAI, bf16_llama: Path
) -> None:
    infos = {n: ray.get(actor(n).info.remote(), timeout=60) for n in WORKERS}
    assert infos["prefill-0"].cpu_capability == "AVX2"
    best = torch.backends.cpu.get_cpu_capability()
    assert {infos[d].cpu_capability for d in ("decode-0", "decode-1")} == {best}
    assert {i.numerics for i in infos.values()} == {"bfloat16/invariant/columns"}

    config = EngineConfig(dtype="bfloat16", **ENGINE)
    engine = LLMEngine.from_checkpoint(bf16_llama, config, model_id=MODEL)
    crossed = completion_logprobs(client, MODEL, PROMPT, **SAMPLED)  # prefill under AVX2
    assert crossed == engine_logprobs(engine, PROMPT, **SAMPLED)  # decode under the best

    url = str(client.base_url).removesuffix("/v1/")
    before = sum(probe.metric(url, "tandem_migrations_total"))
    for name in ("decode-0", "decode-1"):
        fault = Fault(FaultPoint.DECODE_TOKENS, FaultAction.CRASH, at=6, attempt=1)
        ray.get(actor(name).set_faults.remote(FaultPlan([fault])), timeout=60)
    try:
        moved = completion_logprobs(
            client, MODEL, PROMPT, **SAMPLED
        )  # and back: migrated, re-prefilled under AVX2
    finally:
        clear_faults(WORKERS)
    assert sum(probe.metric(url, "tandem_migrations_total")) == before + 1
    assert moved == crossed
