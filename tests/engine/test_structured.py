"""Structured outputs in the engine (docs/design.md#structured-outputs), on the real trained model
(SmolLM2-135M-Instruct, bf16): a constrained request's output matches its JSON schema, regex or
choice; a constraint masks only its own row; a request resumed mid-output (a migration, or the
decode side of a prefill/decode pair) replays its grammar and continues exactly; a grammar the
engine cannot use is refused at admission, naming the problem."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import torch
from helpers import assert_engine_clean

from engine import kernels
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.outputs import TokenDelta
from engine.request import FinishReason
from engine.sampling_params import Constraint, SamplingParams
from engine.structured import InvalidConstraint, allowed_tokens

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
PHONE = r"[0-9]{3}-[0-9]{4}"


@pytest.fixture(scope="module")
def engine(smollm2: Path) -> LLMEngine:
    return LLMEngine.from_checkpoint(smollm2, EngineConfig(kv_cache_bytes=2**25, max_num_seqs=8))


def chat(engine: LLMEngine, question: str) -> list[int]:
    return engine.tokenizer.encode_chat([{"role": "user", "content": question}])


def run(engine: LLMEngine, prompt: list[int], params: SamplingParams, **kw: object) -> list[int]:
    """One request (``make_request`` keywords in ``kw``) to its end: its new token ids."""
    rid = engine.add_request(engine.make_request(prompt, params, **kw))
    outs: list[TokenDelta] = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == rid]
    assert outs[-1].finished
    return [t for o in outs for t in o.token_ids]


def test_each_kind_of_constraint_is_matched_and_ends_the_output(engine: LLMEngine) -> None:
    """A JSON schema (greedy and sampled), a regex and a choice: each output matches and ends
    where its grammar does (EOS, not the token limit)."""
    person = chat(engine, "Describe a person as JSON.")
    capital = chat(engine, "What is the capital of France? Answer in JSON.")
    cases = [
        (person, Constraint("json_schema", json.dumps(PERSON)), SamplingParams(temperature=0)),
        (person, Constraint("json_schema", json.dumps(PERSON)), SamplingParams(seed=5)),
        (capital, Constraint.json_object(), SamplingParams(temperature=0)),
        (person, Constraint("regex", PHONE), SamplingParams(seed=9)),
        (person, Constraint.choice(["yes", "no", "maybe"]), SamplingParams(temperature=0)),
    ]
    params = [replace(p, max_tokens=96, constraint=c) for _, c, p in cases]
    outs = engine.generate([prompt for prompt, _, _ in cases], params)
    texts = [o.text for [o] in outs]
    assert all(o.finish_reason is FinishReason.EOS for [o] in outs), texts
    jsonschema.validate(json.loads(texts[0]), PERSON)
    jsonschema.validate(json.loads(texts[1]), PERSON)
    assert json.loads(texts[2]) == {"city": "Paris"}
    assert re.fullmatch(PHONE, texts[3])
    assert texts[4] in ("yes", "no", "maybe")
    assert_engine_clean(engine)


def test_a_constraint_masks_only_its_own_row(engine: LLMEngine) -> None:
    """Constrained and free requests in one batch: each gets, token for token and logprob for
    logprob, what it gets alone."""
    prompt = chat(engine, "Name a city.")
    free = SamplingParams(temperature=0.8, seed=3, max_tokens=24, logprobs=3, ignore_eos=True)
    bound = SamplingParams(
        temperature=0.8,
        seed=3,
        max_tokens=24,
        logprobs=3,
        constraint=Constraint("json_schema", json.dumps(PERSON)),
    )
    [[free_alone]] = engine.generate([prompt], free)
    [[bound_alone]] = engine.generate([prompt], bound)
    together = engine.generate([prompt, prompt, prompt], [free, bound, free])
    assert [o.token_ids for [o] in together] == [
        free_alone.token_ids,
        bound_alone.token_ids,
        free_alone.token_ids,
    ]
    assert [o.logprobs for [o] in together][:2] == [free_alone.logprobs, bound_alone.logprobs]
    assert bound_alone.token_ids != free_alone.token_ids


@pytest.mark.parametrize("vocab", [32, 1000, 49152])
def test_the_bitmask_kernel_bans_exactly_the_unpacked_masks_tokens(vocab: int) -> None:
    """engine/csrc/token_bitmask.cpp against the unpacked mask and masked_fill (the path where
    the kernels do not build): the same logits bit for bit, rows without a mask untouched;
    whole words allowed, whole words banned and a vocabulary that ends mid-word included."""
    if kernels.load("token_bitmask") is None:
        pytest.skip("no native kernels here: the sampler takes the unpacked path")
    rng = np.random.default_rng(vocab)
    words = (vocab + 31) // 32
    bitmask = rng.integers(-(2**31), 2**31, size=(3, words), dtype=np.int64).astype(np.int32)
    bitmask[0, ::3] = -1  # every token of the word allowed
    bitmask[1, 1::3] = 0  # none
    logits = torch.from_numpy(rng.standard_normal((5, vocab), dtype=np.float32))
    rows = torch.tensor([4, 0, 2])
    want = logits.clone()
    banned = ~torch.from_numpy(allowed_tokens(bitmask, vocab))
    want[rows] = want[rows].masked_fill(banned, float("-inf"))
    assert kernels.apply_token_bitmask(logits, torch.from_numpy(bitmask), rows)
    assert torch.equal(logits, want)
    with pytest.raises(RuntimeError, match="fewer tokens than the vocabulary"):
        kernels.apply_token_bitmask(
            torch.zeros(1, vocab + 32), torch.from_numpy(bitmask[:1]), rows[:1]
        )


def test_without_the_native_kernel_the_masks_give_the_same_tokens(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The unpacked path (no compiler, ``TANDEM_NATIVE_KERNELS=0``, CUDA): a constrained and a
    free row together, token for token and logprob for logprob as with the kernel."""
    prompt = chat(engine, "Describe a person as JSON.")
    bound = SamplingParams(
        seed=4, max_tokens=32, logprobs=2, constraint=Constraint("json_schema", json.dumps(PERSON))
    )
    free = SamplingParams(seed=4, max_tokens=32, logprobs=2, ignore_eos=True)
    native = engine.generate([prompt, prompt], [bound, free])
    monkeypatch.setattr(kernels, "apply_token_bitmask", lambda *_: False)
    unpacked = engine.generate([prompt, prompt], [bound, free])
    assert [(o.token_ids, o.logprobs) for [o] in unpacked] == [
        (o.token_ids, o.logprobs) for [o] in native
    ]


@pytest.mark.parametrize("k", [1, 7])
def test_a_resumed_constrained_request_replays_its_grammar_and_continues_exactly(
    engine: LLMEngine, k: int
) -> None:
    """Resumed after k tokens (k = 1: the decode side after its prefill worker's first token),
    mid-JSON: the grammar is rebuilt from the tokens already out, not restarted at the root, so
    the rest is the uninterrupted run's, and the whole still validates."""
    prompt = chat(engine, "Describe a person as JSON.")
    params = SamplingParams(
        temperature=1.0,
        seed=11,
        max_tokens=96,
        constraint=Constraint("json_schema", json.dumps(PERSON)),
    )
    whole = run(engine, prompt, params)
    rest = run(engine, prompt, params, resume_output=whole[:k])
    assert whole[:k] + rest == whole
    jsonschema.validate(json.loads(engine.tokenizer.decode(whole)), PERSON)
    assert_engine_clean(engine)


@pytest.mark.parametrize(
    ("constraint", "says"),
    [
        (Constraint("json_schema", "{not json"), "invalid json_schema"),
        (Constraint("regex", "(abc"), "unclosed group"),
        (Constraint("grammar", "start: missing_rule"), "missing_rule"),
        (Constraint("choice", "[1, 2]"), "invalid choice"),
    ],
)
def test_a_grammar_the_engine_cannot_use_is_refused_at_admission(
    engine: LLMEngine, constraint: Constraint, says: str
) -> None:
    with pytest.raises(InvalidConstraint, match=re.escape(says)):
        engine.add_request(engine.make_request([1, 2, 3], SamplingParams(constraint=constraint)))
    assert_engine_clean(engine)
