"""Load alone fails no request (P9), with prompts long enough that the KV leases are at stake
(issue 26): many concurrent long prompts are admitted at once and queue at the prefill worker,
so the last ones finish their prefill long after their exports were published. The lease is
0.5 s here: before the lease ran from the KV's completion (and its live puller renewed it),
those requests lost their KV to the lease (`tandem_kv_lease_expired_total`), their transfers
were aborted, the attempts retried -- each prompt computed again -- and, on `local.yaml` with
3,500-token prompts, some were refused after three.

Every request must complete with the engine's own tokens; no lease may expire, no transfer be
aborted, no attempt retried or migrated."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from chaos.load import InThread, Sender, requests_of
from chaos.probe import metric
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.e2e
MODEL = "test-llama"
PROMPT_WORDS = 290  # ~1,000 tokens each; max_model_len 2,048
OUTPUT_TOKENS = 32
REQUESTS = 16
TOPOLOGY = """
model: {{path: {path}, name: test-llama}}
domains: [a]
pools:
  prefill:
    replicas: 1
    num_cpus: 0.5
    # 32-token chunks: ~500 prefill steps for the 16 prompts, seconds in all
    engine: {{kv_cache_bytes: 16777216, max_num_seqs: 32, max_num_batched_tokens: 32}}
  decode:
    replicas: 1
    num_cpus: 0.5
    # room for all 16 (512 B a token): the router admits them at once
    engine: {{kv_cache_bytes: 16777216, max_num_seqs: 16, max_num_batched_tokens: 256}}
transport: grpc
router: {{local_prefill_max_tokens: 0}}
lease_timeout_s: 0.5
"""
COUNTERS = [
    ("tandem_kv_lease_expired_total", {}),
    ("tandem_transport_failures_total", {}),
    ("tandem_retries_total", {}),
    ("tandem_migrations_total", {}),
]


def counters(url: str) -> dict[str, float]:
    return {name: sum(metric(url, name, **labels)) for name, labels in COUNTERS}


@pytest.fixture(scope="module")
def server(
    serve_app: Callable[[Path], str], test_llama: Path, tmp_path_factory: pytest.TempPathFactory
) -> str:
    topology = tmp_path_factory.mktemp("long") / "topology.yaml"
    topology.write_text(TOPOLOGY.format(path=test_llama))
    return serve_app(topology)


def prompt(i: int) -> str:
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf"]
    return f"request {i}: " + " ".join(words[(i + k) % 7] for k in range(PROMPT_WORDS))


def test_long_prompts_beyond_the_decode_kv_all_complete_and_no_lease_expires(
    server: str, test_llama: Path
) -> None:
    before = counters(server)
    bodies = [
        {"prompt": prompt(i), "max_tokens": OUTPUT_TOKENS, "temperature": 0.0, "ignore_eos": True}
        for i in range(REQUESTS)
    ]
    sender = Sender(server, MODEL, hang_bound_s=120.0)
    outcomes = InThread(sender, requests_of(bodies)).join(timeout_s=300)  # all sent at once
    bad = [(o.index, o.status, o.http_status, o.error) for o in outcomes if o.status != "ok"]
    assert not bad, bad
    assert len(outcomes) == REQUESTS
    engine = LLMEngine.from_checkpoint(test_llama, EngineConfig(kv_cache_bytes=32 * 2**20))
    params = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0.0, ignore_eos=True)
    want = [c[0].text for c in engine.generate([b["prompt"] for b in bodies], params)]
    assert [o.text for o in sorted(outcomes, key=lambda o: o.index)] == want
    moved = {k: v - before[k] for k, v in counters(server).items()}
    assert moved == dict.fromkeys(moved, 0.0), moved  # no lease lost, no prompt computed twice
