"""``n`` > 1 on a disaggregated cluster (cluster/prompt_share.py): the choices prefill their prompt
once -- the first on the prefill worker, the others on its decode worker, on the cached prompt
blocks they then share -- and draw the very tokens and logprobs one engine draws for ``n``,
whether or not a fault moved them. Over real HTTP through Ray Serve, with the ``openai`` client.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest
import ray
from helpers import clear_faults, moves

from contracts.faults import Fault, FaultAction, FaultPlan, FaultPoint
from contracts.roles import NAMESPACE
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.e2e
MODEL = "test-llama"
ENGINE = {"kv_cache_bytes": 4 * 2**20, "max_num_seqs": 16, "max_num_batched_tokens": 256}
WORKERS = ("prefill-0", "decode-0", "decode-1")
TOPOLOGY = """
model: {{path: {path}, name: test-llama}}
domains: [a, b]
pools:
  prefill: {{replicas: 1, num_cpus: 0.5, engine: {engine}}}
  decode: {{replicas: 2, num_cpus: 0.5, engine: {engine}}}
transport: grpc
router: {{local_prefill_max_tokens: 0}}
retry: {{max_attempts: 3, budget_ratio: 1.0, backoff_s: 0.0, deadline_s: 60}}
heartbeat_interval_s: 0.2
heartbeat_timeout_s: 5.0
"""
# 6 full blocks of 16 and a partial one: what the later choices share, and what they compute.
PROMPT = list(range(5, 105))
SAMPLED: dict[str, Any] = {"temperature": 1.0, "top_p": 0.9, "seed": 7, "max_tokens": 14}


@pytest.fixture(scope="module")
def client(
    serve_app: Callable[[Path], str], test_llama: Path, tmp_path_factory: pytest.TempPathFactory
) -> openai.OpenAI:
    topology = tmp_path_factory.mktemp("n-choices") / "topology.yaml"
    topology.write_text(TOPOLOGY.format(path=test_llama, engine=ENGINE))
    return openai.OpenAI(base_url=f"{serve_app(topology)}/v1", api_key="-", max_retries=0)


@pytest.fixture(scope="module")
def engine(test_llama: Path) -> LLMEngine:
    return LLMEngine.from_checkpoint(test_llama, EngineConfig(**ENGINE), model_id=MODEL)


def actor(name: str) -> Any:
    return ray.get_actor(name, namespace=NAMESPACE)


def records_of(worker: str, response_id: str) -> list[Any]:
    """The terminal records ``worker``'s engine keeps for the attempts of one response."""
    records = ray.get(actor(worker).records.remote(), timeout=60)
    return [r for r in records if r.request_id.startswith(response_id)]


def hit_tokens(worker: str) -> int:
    """Prompt tokens ``worker``'s engine found in its prefix cache, so far."""
    return int(ray.get(actor(worker).kv_stats.remote(), timeout=60).prefix_hit_tokens)


def choices_of(client: openai.OpenAI, n: int) -> Any:
    return client.completions.create(
        model=MODEL, prompt=PROMPT, n=n, logprobs=2, extra_body={"ignore_eos": True}, **SAMPLED
    )


def drawn(out: Any) -> list[tuple[str, list[float], list[dict[str, float]]]]:
    """Each choice's text, token logprobs and top-2 logprobs, in choice order."""
    return [
        (c.text, c.logprobs.token_logprobs, c.logprobs.top_logprobs)
        for c in sorted(out.choices, key=lambda c: c.index)
    ]


def test_the_choices_prefill_their_prompt_once_and_draw_the_engines_n_samples(
    client: openai.OpenAI, engine: LLMEngine
) -> None:
    """One prefill worker attempt for the four choices; the three others prefill on the decode
    worker that holds the first's prompt, hitting its six full blocks (only the partial one is
    computed again); the texts are the single engine's n=4 texts (which forks after one
    prefill), and they differ."""
    hits = {w: hit_tokens(w) for w in ("decode-0", "decode-1")}
    out = choices_of(client, 4)
    [want] = engine.generate([PROMPT], SamplingParams(n=4, logprobs=2, ignore_eos=True, **SAMPLED))
    assert [c.text for c in sorted(out.choices, key=lambda c: c.index)] == [w.text for w in want]
    assert len({c.text for c in out.choices}) > 1

    assert [r.request_id for r in records_of("prefill-0", out.id)] == [f"{out.id}@1"]
    decode = {w: records_of(w, out.id) for w in ("decode-0", "decode-1")}
    [(shared_on, records)] = [(w, r) for w, r in decode.items() if r]
    assert {r.request_id for r in records} == {
        f"{out.id}@1",
        *(f"{out.id}/{j}@1" for j in (1, 2, 3)),
    }
    # The later choices' hits: the six full blocks each.
    assert hit_tokens(shared_on) - hits[shared_on] == 3 * 6 * 16


def test_a_choice_moved_by_a_fault_draws_what_it_drew_unmoved(client: openai.OpenAI) -> None:
    """The decode worker holding the four choices crashes at the first one's ninth token: each
    choice there moves on its own (its prompt and tokens prefilled again elsewhere) and ends with
    the tokens and logprobs of the fault-free run, bit for bit."""
    want = drawn(choices_of(client, 4))
    url = str(client.base_url).removesuffix("/v1/")
    before = moves(url)
    for name in ("decode-0", "decode-1"):
        fault = Fault(FaultPoint.DECODE_TOKENS, FaultAction.CRASH, at=9, attempt=1)
        ray.get(actor(name).set_faults.remote(FaultPlan([fault])), timeout=60)
    try:
        got = drawn(choices_of(client, 4))
    finally:
        clear_faults(WORKERS)
    # The lead moved, and each later choice the crash found there once: migrated, or retried if
    # its first token had not come yet (one still queued for the worker is routed anew, unmoved).
    assert 1 <= moves(url) - before <= 4
    assert got == want
