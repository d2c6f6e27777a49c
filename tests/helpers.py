"""Helpers shared by test modules: the engine-level assertions, the sampler's filters over one
distribution (a test oracle), the router's view of a worker, schema-driven API bodies."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import pytest
from torch import Tensor

from api.protocol import ChatCompletionRequest, CompletionRequest
from api.translate import sampling_params
from chaos.probe import metric
from contracts.messages import WorkerInfo, WorkerLoad
from contracts.roles import Role
from contracts.routing import WorkerState
from engine.block_pool import KVInvariantError
from engine.engine import LLMEngine
from engine.kv_cache_manager import KVStats
from engine.sampler import (
    MaskFn,
    _renormalise,
    _tempered_probs,
    min_p_mask,
    top_k_mask,
    top_p_mask,
    typical_mask,
)
from engine.sampling_params import SamplingParams

_INFO_FIELDS = {f.name for f in fields(WorkerInfo)}
_LOAD_FIELDS = {f.name for f in fields(WorkerLoad)}


async def eventually_idle(
    check_idle: Callable[[], Awaitable[KVStats]], timeout_s: float = 10.0
) -> KVStats:
    """A worker's leak check (``check_idle``) once it passes, within ``timeout_s``: a lease's
    release reaches the engine a little after the transfer that ended it (it is posted from
    the KV server's thread). A leak still there at the timeout raises KVInvariantError."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await check_idle()
        except KVInvariantError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


def assert_engine_clean(engine: LLMEngine) -> None:
    """The leak check (docs/design.md#p1, #p8): every pool back to baseline, nothing live, and
    exactly one terminal record per request."""
    engine.kv.check_idle()
    assert not engine.has_unfinished()
    ids = [r.request_id for r in engine.scheduler.records]
    assert len(ids) == len(set(ids))


# -- the sampler's filters over one 1-D distribution: the batched code on a batch of one, which
# the tests check against exact references and the batched sampler against
# (docs/design.md#sampling-order).


def temperature_probs(logits: Tensor, temperature: float) -> Tensor:
    """softmax(z / T) of a 1-D logits tensor. Raises ValueError for T <= 0 (greedy is argmax)."""
    if not temperature > 0:
        raise ValueError(f"temperature={temperature!r}: softmax(z / T) is defined only for T > 0")
    return _tempered_probs(_one_row(logits), [temperature])[0]


def greedy_token(logits: Tensor) -> int:
    """argmax of a 1-D logits tensor; the lowest id wins a tie."""
    return int(_one_row(logits).argmax(-1))


def top_k_filter(probs: Tensor, k: int) -> Tensor:
    """Renormalised top-k of a 1-D distribution. Raises ValueError for k < 1."""
    if k < 1:
        raise ValueError(f"k={k}: top-k needs k >= 1")
    return _filter_one(top_k_mask, probs, k)


def top_p_filter(probs: Tensor, p: float) -> Tensor:
    """Renormalised top-p (nucleus) of a 1-D distribution, p in (0, 1]."""
    return _filter_one(top_p_mask, probs, p)


def min_p_filter(probs: Tensor, alpha: float) -> Tensor:
    """Renormalised min-p of a 1-D distribution, alpha in [0, 1]."""
    return _filter_one(min_p_mask, probs, alpha)


def typical_filter(probs: Tensor, mass: float) -> Tensor:
    """Renormalised typical-p of a 1-D distribution, mass in (0, 1]."""
    return _filter_one(typical_mask, probs, mass)


def _one_row(values: Tensor) -> Tensor:
    if values.dim() != 1:
        raise ValueError(f"expected a 1-D tensor, got shape {tuple(values.shape)}")
    return values[None]


def _filter_one(mask: MaskFn, probs: Tensor, value: float) -> Tensor:
    row = _one_row(probs)
    row = row / row.sum(-1, keepdim=True)
    return _renormalise(row, mask(row, [value]))[0]


def worker_state(
    name: str, role: Role, domain: str, healthy: bool = True, **kw: Any
) -> WorkerState:
    """A router's view of a worker that has reported: ``kw`` sets fields of its info
    (``max_num_seqs``, ``block_size``, ...), of its load report (``queue_depth``,
    ``kv_usage``, ...) or of the state itself (``failed``, ``promised_seqs``, ...)."""
    state = WorkerState.unreported(name, role, domain)
    info = {k: kw.pop(k) for k in list(kw) if k in _INFO_FIELDS}
    report = {k: kw.pop(k) for k in list(kw) if k in _LOAD_FIELDS}
    return replace(
        state,
        info=replace(state.info, **info),
        report=replace(state.report, **report),
        healthy=healthy,
        **kw,
    )


def integral(value: Any) -> Any:
    """``value`` with integer-valued floats written as integers: JSON Schema's ``integer``
    (which schema-driven generators follow) includes 1.0; the API's parser, strict, takes only
    1 and answers 1.0 with a 400."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [integral(v) for v in value]
    if isinstance(value, dict):
        return {k: integral(v) for k, v in value.items()}
    return value


# -- HTTP bodies of the API tests --------------------------------------------------------------

VOCAB = 2048  # the test checkpoints' vocabulary
MSGS = [{"role": "user", "content": "hi"}]


def completion_body(**fields: Any) -> bytes:
    return json.dumps({"model": "demo", "prompt": "hi", **fields}).encode()


def chat_body(**fields: Any) -> bytes:
    return json.dumps({"model": "demo", "messages": MSGS, **fields}).encode()


def params(req: CompletionRequest | ChatCompletionRequest) -> SamplingParams:
    """A request's sampling parameters as the edge derives them (the test vocabulary)."""
    return sampling_params(req, vocab_size=VOCAB, default_max_tokens=100)


def skip_unless_bed_possible() -> None:
    """Skip, saying why, only where this machine cannot run the test bed (not root, no network
    namespaces, no apt to install sshd and rsync); fail where setup should have made it able."""
    from tandem import testbed

    try:
        testbed.check_possible()
    except testbed.TestbedUnavailable as exc:
        if exc.installable:
            pytest.fail(f"the test bed could run here but setup left it broken: {exc}")
        pytest.skip(str(exc))


# -- chaos runs through the CLI (tests/e2e) ---------------------------------------------------

# The counters the run must move: (name, labels).
COUNTED = [
    ("tandem_worker_failures_detected_total", {}),
    ("tandem_transport_failures_total", {"kind": "integrity"}),
    ("tandem_migrations_total", {}),
    ("tandem_retries_total", {}),
]


def counters(url: str) -> list[float]:
    """Each of COUNTED's sum over its samples."""
    return [sum(metric(url, name, **labels)) for name, labels in COUNTED]


def run_plan(plan: str, url: str, out: Path, *extra: str) -> dict[str, Any]:
    """``tandem chaos run PLAN [extra...]`` against the session's cluster, as a user runs
    it."""
    import ray

    before = counters(url)
    tandem = Path(sys.executable).with_name("tandem")
    run = subprocess.run(
        [
            str(tandem),
            "chaos",
            "run",
            plan,
            "--address",
            ray.get_runtime_context().gcs_address,
            "--url",
            url,
            "--out",
            str(out),
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=os.environ.copy(),
    )
    return {
        "rc": run.returncode,
        "stderr": run.stderr,
        "report": json.loads((out / "report.json").read_text()) if run.returncode < 2 else None,
        "markdown": (out / "report.md").read_text() if run.returncode < 2 else "",
        "png": out / "timeline.png",
        "out": out,
        "before": before,
        "after": counters(url),
        "url": url,
    }


def report_rows(run: dict[str, Any]) -> list[dict[str, Any]]:
    """The run's ``requests.jsonl``: a row per request."""
    lines = (run["out"] / "requests.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def clear_faults(workers: Sequence[str]) -> None:
    """Each of ``workers`` (actors in Tandem's namespace) back without faults and idle: P1 on
    its pools. A crashed one restarts: wait for it (up to 2 minutes)."""
    import ray
    from ray.exceptions import ActorUnavailableError

    from contracts.faults import FaultPlan
    from contracts.roles import NAMESPACE

    for name in workers:
        actor = ray.get_actor(name, namespace=NAMESPACE)
        deadline = time.monotonic() + 120
        while True:
            try:
                ray.get(actor.set_faults.remote(FaultPlan()), timeout=60)
                ray.get(actor.check_idle.remote(), timeout=60)
                break
            except ActorUnavailableError:
                assert time.monotonic() < deadline, f"{name} did not come back"
                time.sleep(0.2)


def moves(url: str) -> float:
    """Attempts the ingress at ``url`` retried or migrated, so far (its Prometheus counters)."""
    names = ("tandem_retries_total", "tandem_migrations_total")
    return sum(sum(metric(url, name)) for name in names)


# -- logprobs as the completions API lists them -------------------------------------------------

Listed = list[tuple[str, float, dict[str, float]]]


def completion_logprobs(client: Any, model: str, prompt: list[int], **params: Any) -> Listed:
    """One completion (ignore_eos, token ids named ``token_id:N``) through the official client:
    per token its name, logprob and top logprobs, as the API lists them."""
    out = client.completions.create(
        model=model,
        prompt=prompt,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
        **params,
    )
    lp = out.choices[0].logprobs
    return list(zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True))


def engine_logprobs(engine: LLMEngine, prompt: list[int], **params: Any) -> Listed:
    """What :func:`completion_logprobs` lists for the same request run by ``engine``: the top
    entries plus the sampled token (as vLLM's completions list them)."""
    [[want]] = engine.generate([prompt], SamplingParams(ignore_eos=True, **params))
    return [
        (f"token_id:{t}", e.logprob, {f"token_id:{i}": v for i, v in [*e.top, (t, e.logprob)]})
        for t, e in zip(want.token_ids, want.logprobs or [], strict=True)
    ]
