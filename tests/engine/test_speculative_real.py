"""n-gram speculation on the real trained model (SmolLM2-135M-Instruct, bf16), where drafts from
the context are often right: a code edit and a quoted document come out the same bits with it on
as off, with most drafts accepted; a constrained request's drafts stop where its grammar would
reject one, and its output is the same bits too (docs/design.md#speculative-decoding)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.config import EngineConfig, SpeculativeConfig
from engine.engine import CompletionOutput, LLMEngine
from engine.sampling_params import Constraint, SamplingParams
from engine.speculative import NgramIndex

CODE = """def total_price(items, tax):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    return subtotal * (1 + tax)
"""
EDIT = f"Rename the variable `subtotal` to `amount` in this code and show the result:\n\n{CODE}"
QUOTE = (
    "Here is a note: 'The meeting moves to Thursday at ten in room four, and everyone brings "
    "the quarterly figures.' Repeat the note word for word."
)
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "city": {"type": "string"}},
    "required": ["name", "city"],
    "additionalProperties": False,
}


def engine(path: Path, speculative: SpeculativeConfig | None) -> LLMEngine:
    config = EngineConfig(kv_cache_bytes=2**25, max_num_seqs=8, speculative=speculative)
    return LLMEngine.from_checkpoint(path, config)


@pytest.fixture(scope="module")
def plain(smollm2: Path) -> LLMEngine:
    return engine(smollm2, None)


@pytest.fixture(scope="module")
def spec(smollm2: Path) -> LLMEngine:
    # Drafting whenever a one-token suffix matches, whatever the record: the most verification.
    return engine(smollm2, SpeculativeConfig(k=4, min_n=1, threshold=0.0))


def chat(engine: LLMEngine, text: str) -> list[int]:
    return engine.tokenizer.encode_chat([{"role": "user", "content": text}])


def key(out: CompletionOutput) -> tuple[object, ...]:
    logprobs = [(lp.logprob, tuple(lp.top)) for lp in out.logprobs or []]
    return (tuple(out.token_ids), out.text, out.finish_reason, tuple(logprobs))


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_tokens=80, logprobs=2),
        SamplingParams(temperature=0.7, top_p=0.9, seed=4, max_tokens=80, logprobs=2),
    ],
    ids=["greedy", "seeded"],
)
def test_input_grounded_requests_are_the_same_bits_with_most_drafts_accepted(
    plain: LLMEngine, spec: LLMEngine, params: SamplingParams
) -> None:
    prompts = [chat(plain, EDIT), chat(plain, QUOTE)]
    reference = [out for [out] in plain.generate(prompts, params)]
    before = spec.speculation.num_accepted
    got = [out for [out] in spec.generate(prompts, params)]
    assert [key(o) for o in got] == [key(o) for o in reference]
    stats = [o.record.speculation for o in got]
    assert all(s is not None for s in stats)
    accepted = sum(s.num_accepted for s in stats if s)
    assert accepted == spec.speculation.num_accepted - before
    drafted = sum(s.num_drafted for s in stats if s)
    # Measured 2026-12-04: greedy copies the code and the note (63 of 72 drafts accepted); at
    # T = 0.7 this small model paraphrases (25 of 154).
    assert accepted > (0.6 if params.temperature == 0 else 0.05) * drafted


def test_a_constrained_requests_drafts_stop_where_its_grammar_would_reject(
    spec: LLMEngine,
) -> None:
    prompt = spec.tokenizer.encode("1 2 x 1 2 x 1")
    params = SamplingParams(
        temperature=0.0, max_tokens=8, constraint=Constraint("regex", "[0-9 ]+")
    )
    rid = spec.add_request(spec.make_request(prompt, params, request_id="digits"))
    req = spec.scheduler.get_request(rid)
    try:
        assert req is not None
        index = NgramIndex(1, 4)  # the engine's
        index.sync(prompt, [])
        drafts = index.propose(4)
        x = spec.tokenizer.encode(" x")
        assert x[0] in drafts  # the context goes on with " x", which the regex forbids
        assert 0 < drafts.index(x[0]) < len(drafts) - 1
        assert spec._draft(req, 8) == drafts[: drafts.index(x[0])]
    finally:
        spec.abort(rid)
        while spec.has_unfinished():
            spec.step()
        spec.finished_outputs()


def test_a_constrained_request_speculates_to_the_same_bits(
    plain: LLMEngine, spec: LLMEngine
) -> None:
    example = json.dumps({"name": "Ada Lovelace", "city": "London"})
    prompt = chat(plain, f"Reply with this JSON object exactly: {example}")
    constraint = Constraint("json_schema", json.dumps(PERSON))
    params = SamplingParams(temperature=0.0, max_tokens=40, logprobs=1, constraint=constraint)
    [[reference]] = plain.generate([prompt], params)
    [[out]] = spec.generate([prompt], params)
    assert key(out) == key(reference)
    assert json.loads(out.text)["name"]
    assert out.record.speculation is not None and out.record.speculation.num_accepted > 0
