"""The client's side of a request (cluster.client_stream.ClientStream), without Ray: what it
keeps for a migration (the tokens it has, and a sampler snapshot that belongs to exactly those
tokens or none), how each way an attempt ends is taken, and that the text is the engines'."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from helpers import assert_engine_clean

from cluster.client_stream import AttemptFailed, ClientStream
from cluster.token_stream import Outbox
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.outputs import TokenDelta
from engine.request import EngineRequest, FinishReason
from engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def request(prompt: list[int], params: SamplingParams) -> EngineRequest:
    return EngineRequest("r", tuple(prompt), params)


def test_a_greedy_stream_migrates_after_decode_tokens(test_llama: Path) -> None:
    """Greedy requests get the prefill's snapshot (after token 1) and none from decode: once
    decode tokens arrive that snapshot is stale and dropped, so a migration after them resumes
    (it raised 'snapshot taken at 1 output tokens' before) and continues exactly."""
    engine = LLMEngine.from_checkpoint(test_llama, EngineConfig(kv_cache_bytes=2**22))
    prompt = list(range(40, 80))
    [[full]] = engine.generate([prompt], GREEDY)
    rid = engine.add_request(engine.make_request(prompt, GREEDY, prefill_only=True))
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == rid]
    engine.release_kv(rid)
    tokens_1 = [t for o in outs for t in o.token_ids]
    snap = outs[-1].sampler_snapshot  # the prefill's, on its hand-off, at 1 token
    assert tokens_1 == full.token_ids[:1] and snap is not None and snap.num_output_tokens == 1
    assert outs[-1].finish_reason is FinishReason.HANDED_OFF

    stream = ClientStream(request(prompt, GREEDY))
    first = TokenDelta(
        "r", tokens_1, finished=True, finish_reason=FinishReason.HANDED_OFF, sampler_snapshot=snap
    )
    assert stream.accept(first, "p") == TokenDelta("r", tokens_1, "")
    assert stream.snapshot is snap and not stream.finished
    stream.accept(TokenDelta("r", full.token_ids[1:3]), "d")
    assert stream.tokens == full.token_ids[:3] and stream.snapshot is None

    again = engine.add_request(
        engine.make_request(
            prompt, GREEDY, resume_output=stream.tokens, sampler_snapshot=stream.snapshot
        )
    )
    tokens = list(stream.tokens)
    while engine.has_unfinished():
        tokens += [t for o in engine.step() if o.request_id == again for t in o.token_ids]
    assert tokens == full.token_ids
    assert_engine_clean(engine)


def test_text_is_the_engines_and_continues_exactly_across_a_hand_off(test_llama: Path) -> None:
    """A prefill engine's first token and a decode engine that imports the rest give, through
    the client stream, exactly the text one engine gives (detokenised once, by the engines:
    the hand-off releases no held-back text, the decode side releases it in its place)."""
    engine = LLMEngine.from_checkpoint(test_llama, EngineConfig(kv_cache_bytes=2**22))
    prompt = list(range(100, 130))
    [[full]] = engine.generate([prompt], GREEDY)
    stream = ClientStream(request(prompt, GREEDY))
    rid = engine.add_request(engine.make_request(prompt, GREEDY, prefill_only=True))
    while engine.has_unfinished():
        for o in engine.step():
            stream.accept(o, "p")
    engine.release_kv(rid)
    resumed = engine.add_request(engine.make_request(prompt, GREEDY, resume_output=stream.tokens))
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id == resumed:
                stream.accept(o, "d")
    assert (stream.tokens, stream.text) == (full.token_ids, full.text)
    assert stream.finish_reason is FinishReason.MAX_TOKENS
    assert_engine_clean(engine)


@pytest.mark.parametrize(
    "reason",
    [
        FinishReason.EOS,
        FinishReason.STOP_TOKEN,
        FinishReason.STOP_STRING,
        FinishReason.MAX_TOKENS,
        FinishReason.CONTEXT_LIMIT,
        FinishReason.DEADLINE,
    ],
)
def test_a_reason_that_ends_the_request_finishes_the_stream(reason: FinishReason) -> None:
    stream = ClientStream(request([1, 2], GREEDY))
    delta = stream.accept(TokenDelta("r", [5], "a", finished=True, finish_reason=reason), "w")
    assert delta == TokenDelta("r", [5], "a", finished=True, finish_reason=reason)
    assert (stream.finished, stream.finish_reason, stream.tokens, stream.text) == (
        True,
        reason,
        [5],
        "a",
    )
    with pytest.raises(RuntimeError, match="already ended"):
        stream.accept(TokenDelta("r", [6]), "w")


@pytest.mark.parametrize(
    "reason", [FinishReason.ERROR, FinishReason.CANCELLED, FinishReason.REJECTED, None]
)
def test_an_attempt_that_ends_otherwise_fails_blaming_its_worker(
    reason: FinishReason | None,
) -> None:
    """The tokens that came with it are kept (the client has them); the attempt fails so the
    request migrates."""
    stream = ClientStream(request([1, 2], GREEDY))
    batch = TokenDelta("r", [7], "x", finished=True, finish_reason=reason, error="boom")
    with pytest.raises(AttemptFailed) as failed:
        stream.accept(batch, "decode-1")
    assert failed.value.worker == "decode-1" and not failed.value.dead
    assert "boom" in str(failed.value)
    assert (stream.tokens, stream.text, stream.finished) == ([7], "x", False)


def test_first_token_time_queue_time_and_logprobs_only_when_asked() -> None:
    stream = ClientStream(request([1], GREEDY))
    assert stream.accept(TokenDelta("r", [], ""), "w") is None  # nothing to send
    assert stream.first_token_at is None
    stream.accept(TokenDelta("r", [3], "c", logprobs=[], queue_time_s=0.25), "w")
    stream.accept(TokenDelta("r", [4], "d", queue_time_s=9.0), "w")
    assert stream.first_token_at is not None and stream.queue_time_s == 0.25
    delta = stream.accept(TokenDelta("r", [4], "d", logprobs=[]), "w")
    assert delta is not None and delta.logprobs is None  # the request asked for none


def test_prompt_logprobs_travel_with_the_first_token_both_ways(test_llama: Path) -> None:
    """Disaggregated, the prefill's first output carries them (the prefill worker's first
    delta); colocated or with a decode worker's local prefill, the engine's deltas merged in an
    outbox keep them. The client's first delta has them."""
    engine = LLMEngine.from_checkpoint(test_llama, EngineConfig(kv_cache_bytes=2**22))
    params = replace(GREEDY, prompt_logprobs=1)
    prompt = list(range(40, 60))
    [[want]] = engine.generate([prompt], params)
    assert want.prompt_logprobs is not None and len(want.prompt_logprobs) == len(prompt)
    rid = engine.add_request(engine.make_request(prompt, params, prefill_only=True))
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == rid]
    engine.release_kv(rid)
    assert outs[0].token_ids and outs[0].prompt_logprobs == want.prompt_logprobs
    outbox = Outbox()
    for out in engine.stream(prompt, params):
        outbox.put("a@1", out)
    [(_, [merged])] = outbox.take()
    assert merged.prompt_logprobs == want.prompt_logprobs
    delta = ClientStream(request(prompt, params)).accept(merged, "w")
    assert delta is not None and delta.prompt_logprobs == want.prompt_logprobs
    engine.finished_outputs()
    assert_engine_clean(engine)
