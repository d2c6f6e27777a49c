"""The fault-free answer to each request of a chaos run: an engine on the same checkpoint,
outside the cluster, given what the ingress would give its workers (the same parsing, prompt
tokens, sampling parameters and seed), its outputs turned into the completions API's
``logprobs`` fields by the same function the ingress uses.

Deterministic serving (docs/design.md#determinism) makes every request's tokens and
logprobs independent of its batch, so all of them are computed in one batch here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from api import protocol, responses, translate
from engine.config import EngineConfig
from engine.engine import LLMEngine
from tandem.topology import Topology

REFERENCE_KV_BYTES = 512 * 2**20


@dataclass(frozen=True)
class Expected:
    text: str
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    finish_reason: str


def reference_engine(topology: Topology, model_dir: Path) -> LLMEngine:
    """An engine like the cluster's workers (dtype, deterministic numerics), with its own
    KV cache."""
    config = EngineConfig(dtype=topology.model.dtype, kv_cache_bytes=REFERENCE_KV_BYTES)
    return LLMEngine.from_checkpoint(model_dir, config, model_id=topology.model.name)


def expected(
    engine: LLMEngine, requests: list[tuple[dict[str, Any], int | None]]
) -> list[list[Expected]]:
    """Per request (its body, and the seed the server reported when the body had none), the
    expected output of each of its choices."""
    tokenizer = engine.tokenizer
    prompts, params, shape = [], [], []
    for body, seed in requests:
        req = protocol.parse_completion(json.dumps({"model": "m", **body}).encode())
        [ids] = translate.completion_prompts(req, tokenizer)
        base = translate.sampling_params(
            req, vocab_size=tokenizer.vocab_size, default_max_tokens=body["max_tokens"]
        )
        if base.seed is None and seed is not None:
            base = replace(base, seed=seed)
        for i in range(req.n):
            prompts.append(ids)
            params.append(translate.choice_params(base, i))
        shape.append(req.n)
    outputs = [out for [out] in engine.generate(prompts, params)]
    answers, at = [], 0
    for n in shape:
        answers.append([_expected(engine, out) for out in outputs[at : at + n]])
        at += n
    return answers


def _expected(engine: LLMEngine, out: Any) -> Expected:
    fields = responses.completion_logprobs(
        engine.tokenizer, out.token_ids, out.logprobs or [], num_top=1
    )
    return Expected(
        text=out.text,
        tokens=fields["tokens"],
        token_logprobs=fields["token_logprobs"],
        top_logprobs=fields["top_logprobs"],
        finish_reason=responses.openai_finish_reason(out.finish_reason),
    )
