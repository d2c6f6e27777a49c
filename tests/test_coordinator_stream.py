"""How the coordinator keeps a client's stream ready for a migration (no Ray needed): the
tokens it has, and a sampler snapshot that belongs to exactly those tokens or none."""

from __future__ import annotations

from pathlib import Path

from helpers import assert_engine_clean

from cluster.coordinator import Coordinator, _ClientStream
from cluster.messages import RequestSpec, TokenBatch
from engine.config import EngineConfig
from engine.detokenizer import TextStream
from engine.engine import LLMEngine
from engine.sampling_params import SamplingParams


def test_a_greedy_stream_migrates_after_decode_tokens(test_llama: Path) -> None:
    """Greedy requests get the prefill's snapshot (after token 1) and none from decode: once
    decode tokens arrive that snapshot is stale and dropped, so a migration after them resumes
    (it raised 'snapshot taken at 1 output tokens' before) and continues exactly."""
    engine = LLMEngine.from_checkpoint(test_llama, EngineConfig(kv_cache_bytes=2**22))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompt = list(range(40, 80))
    [[full]] = engine.generate([prompt], params)
    rid = engine.add_request(prompt, params, prefill_only=True)
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == rid]
    engine.release_kv(rid)
    tokens_1 = [t for o in outs for t in o.token_ids]
    snap = outs[-1].sampler_snapshot  # the prefill's, on its hand-off, at 1 token
    assert tokens_1 == full.token_ids[:1] and snap is not None and snap.num_output_tokens == 1

    spec = RequestSpec("r", prompt, params)
    stream = _ClientStream(spec, TextStream(engine.tokenizer, params.stop, False))
    accept = Coordinator._accept  # uses only its arguments
    accept(None, TokenBatch(tokens_1, sampler_snapshot=snap), "p", stream)  # type: ignore[arg-type]
    assert stream.snapshot is snap
    accept(None, TokenBatch(full.token_ids[1:3]), "d", stream)  # type: ignore[arg-type]
    assert stream.tokens == full.token_ids[:3] and stream.snapshot is None

    again = engine.add_request(
        prompt, params, resume_output=stream.tokens, sampler_snapshot=stream.snapshot
    )
    tokens = list(stream.tokens)
    while engine.has_unfinished():
        tokens += [t for o in engine.step() if o.request_id == again for t in o.token_ids]
    assert tokens == full.token_ids
    assert_engine_clean(engine)
