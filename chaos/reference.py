"""The fault-free answer to each request of a chaos run: an engine on the same checkpoint,
outside the cluster, given each planned body through this module's own small path -- the
prompt's tokens as the tokenizer encodes the text, the body's sampling fields, choice ``c`` of
a seeded request drawing stream ``c`` of its seed (docs/design.md#sampling-seeds; a body without
a seed takes the one the server reported), its ``structured_outputs`` the grammar vLLM's field
names (docs/design.md#structured-outputs) -- and its outputs written as the API documents its
completions ``logprobs`` with ``return_tokens_as_token_ids`` (``token_id:N`` names, the sampled
token among its top, ``-inf`` as -9999.0). Nothing here is the ingress's own code: a bug in its
parsing, seeding or formatting shows as a mismatch instead of appearing on both sides.

Deterministic serving (docs/design.md#determinism) makes every request's tokens and
logprobs independent of its batch, so all of them are computed in one batch here.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.outputs import TokenLogprobs
from engine.request import FinishReason
from engine.sampling_params import Constraint, SamplingParams
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
    prompts, params, shape = [], [], []
    for body, seed in requests:
        ids = engine.tokenizer.encode(body["prompt"])
        n = body.get("n", 1)
        base = SamplingParams(
            temperature=body.get("temperature", 1.0),
            top_p=body.get("top_p", 1.0),
            max_tokens=body["max_tokens"],
            stop=tuple(body.get("stop") or ()),
            seed=body.get("seed", seed),
            logprobs=body["logprobs"],
            ignore_eos=body.get("ignore_eos", False),
            constraint=constraint_of(body.get("structured_outputs")),
        )
        for choice in range(n):
            prompts.append(ids)
            params.append(replace(base, choice=choice))
        shape.append(n)
    outputs = [out for [out] in engine.generate(prompts, params)]
    answers, at = [], 0
    for (body, _), n in zip(requests, shape, strict=True):
        top = body["logprobs"]
        answers.append([_expected(out, top) for out in outputs[at : at + n]])
        at += n
    return answers


def constraint_of(field: dict[str, Any] | None) -> Constraint | None:
    """The grammar a body's ``structured_outputs`` names (exactly one of ``json``: a schema,
    as an object or its text; ``regex``; ``choice``: a list of strings; ``grammar``: Lark)."""
    if field is None:
        return None
    [(name, spec)] = field.items()
    if name == "json":
        return Constraint("json_schema", spec if isinstance(spec, str) else json.dumps(spec))
    if name == "choice":
        return Constraint.choice(spec)
    if name == "regex":
        return Constraint("regex", spec)
    if name == "grammar":
        return Constraint("grammar", spec)
    raise ValueError(f"structured_outputs.{name}: not json, regex, choice or grammar")


# OpenAI's finish_reason for how a reference run ends (the API's documented mapping).
FINISH = {
    FinishReason.EOS: "stop",
    FinishReason.STOP_TOKEN: "stop",
    FinishReason.STOP_STRING: "stop",
    FinishReason.MAX_TOKENS: "length",
    FinishReason.CONTEXT_LIMIT: "length",
}
MIN_LOGPROB = -9999.0  # how the API writes -inf (docs/design.md#sampling)


def _expected(out: Any, top: int) -> Expected:
    names = [f"token_id:{t}" for t in out.token_ids]
    lps: list[TokenLogprobs] = out.logprobs or []
    values = [_finite(lp.logprob) for lp in lps]
    tops: list[dict[str, float] | None] = []
    for name, lp in zip(names, lps, strict=True):
        alternatives = {f"token_id:{t}": _finite(v) for t, v in lp.top[:top]}
        alternatives.setdefault(name, _finite(lp.logprob))
        tops.append(alternatives)
    return Expected(
        text=out.text,
        tokens=names,
        token_logprobs=list(values),
        top_logprobs=tops,
        finish_reason=FINISH[out.finish_reason],
    )


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else MIN_LOGPROB


def transformers_greedy(model_dir: Path, bodies: list[dict[str, Any]]) -> list[list[str] | None]:
    """Per body, the token names (``token_id:N``) transformers' own tokenizer and greedy
    ``generate`` give in float32 -- a reference sharing nothing with Tandem's engine; None
    for a body that is not plain greedy (sampled, stop strings, ``n`` > 1)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out: list[list[str] | None] = []
    for body in bodies:
        if body.get("temperature", 1.0) != 0.0 or body.get("stop") or body.get("n", 1) != 1:
            out.append(None)
            continue
        ids = tokenizer(body["prompt"], return_tensors="pt").input_ids
        with torch.inference_mode():
            new = model.generate(
                ids, do_sample=False, max_new_tokens=body["max_tokens"], pad_token_id=0
            )
        out.append([f"token_id:{t}" for t in new[0, ids.shape[1] :].tolist()])
    return out
