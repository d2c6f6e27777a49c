"""What the edge sends back: the response, chunk and logprobs objects are what the official
``openai`` client parses, and a prompt is reported (echo, prompt_logprobs) as asked.

The client is driven end to end through ``httpx2.MockTransport``: it builds and sends the request
bytes it would send to a server, and parses our response bytes, with no socket at all."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Literal

import httpx2
import openai
import pytest
from helpers import VOCAB, completion_body
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from api.choices import Choices, _no_tokens
from api.errors import APIError
from api.gate import GateConfig
from api.metrics import Metrics
from api.protocol import ChatCompletionRequest, PromptReport, parse_chat, parse_completion
from api.responses import (
    SSE_DONE,
    Prompt,
    ResponseMeta,
    chat_chunk,
    chat_logprobs,
    chat_response,
    completion_chunk,
    completion_logprobs,
    completion_response,
    models_response,
    openai_finish_reason,
    sse,
    usage_chunk,
)
from api.translate import (
    Translator,
    chat_prompt,
    completion_prompts,
    sampling_params,
)
from engine.outputs import TokenDelta, TokenLogprobs
from engine.request import FinishReason
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer, token_bytes, token_string

META = ResponseMeta(id="cmpl-1", model="demo", created=1_700_000_000)


def test_the_seed_is_a_top_level_field_of_every_response_object(bl_tok: Tokenizer) -> None:
    """With a seed in the meta every object carries it (the openai client keeps it as an extra
    field); without one no object has the field."""
    meta = ResponseMeta("cmpl-3", "demo", 3, seed=2**62)
    choices = [TokenDelta("r", [5], "ok", finish_reason=FinishReason.MAX_TOKENS)]
    kw: dict[str, Any] = {"prompt_tokens": 1, "tokenizer": bl_tok}
    objects = [
        completion_response(meta, choices, **kw),
        chat_response(meta, choices, **kw),
        completion_chunk(meta, 0, "ok"),
        chat_chunk(meta, 0, content="ok"),
        usage_chunk(meta, "text_completion", prompt_tokens=1, completion_tokens=1),
    ]
    assert [o["seed"] for o in objects] == [2**62] * 5
    assert ChatCompletion.model_validate(objects[1]).model_extra == {"seed": 2**62}
    assert "seed" not in completion_response(META, choices, **kw)


# -- logprobs -------------------------------------------------------------------------------------


def test_completion_logprobs_shape(demo_tok: Tokenizer) -> None:
    ids = demo_tok.encode(" Hello world", add_special_tokens=False)
    texts = [token_string(token_bytes(demo_tok, t)) for t in ids]
    lps = [
        TokenLogprobs(-0.5 * (i + 1), [(ids[i], -0.5 * (i + 1)), (7, -3.0)], 1)
        for i in range(len(ids))
    ]
    lps[0] = TokenLogprobs(float("-inf"), [(7, -0.1)], 2048)  # -inf is no JSON: vLLM's -9999
    out = completion_logprobs(demo_tok, ids, lps, text_offset=4)
    assert out["tokens"] == texts
    assert out["token_logprobs"] == [-9999.0] + [lp.logprob for lp in lps[1:]]
    seven = token_string(token_bytes(demo_tok, 7))
    assert out["top_logprobs"][0] == {seven: -0.1, texts[0]: -9999.0}  # the sampled one added
    assert out["top_logprobs"][1] == {texts[1]: -1.0, seven: -3.0}
    offsets = [4]
    for t in texts[:-1]:
        offsets.append(offsets[-1] + len(t))
    assert out["text_offset"] == offsets


def test_chat_logprobs_shape(bl_tok: Tokenizer) -> None:
    ids = bl_tok.encode("ok 🙂", add_special_tokens=False)
    lps = [TokenLogprobs(-1.0, [(ids[0], -1.0)], 1) for _ in ids]
    content = chat_logprobs(bl_tok, ids, lps)["content"]
    assert [bytes(c["bytes"]) for c in content] == [token_bytes(bl_tok, t) for t in ids]
    assert b"".join(bytes(c["bytes"]) for c in content) == "ok 🙂".encode()
    first = token_string(token_bytes(bl_tok, ids[0]))
    assert content[0] == {
        "token": first,
        "logprob": -1.0,
        "bytes": list(first.encode()),
        "top_logprobs": [{"token": first, "logprob": -1.0, "bytes": list(first.encode())}],
    }


# -- responses, parsed by the official client's types ---------------------------------------------


def test_finish_reasons() -> None:
    """Every engine reason: OpenAI's string, or a 500 for one that must not reach a client."""
    assert {r: openai_finish_reason(r) for r in CLIENT_REASONS} == {
        FinishReason.EOS: "stop",
        FinishReason.STOP_TOKEN: "stop",
        FinishReason.STOP_STRING: "stop",
        FinishReason.MAX_TOKENS: "length",
        FinishReason.CONTEXT_LIMIT: "length",
        FinishReason.DEADLINE: "length",
        FinishReason.CANCELLED: "length",
    }
    for reason in set(FinishReason) - CLIENT_REASONS:
        with pytest.raises(APIError) as e:
            openai_finish_reason(reason)
        assert e.value.status == 500 and reason.value in e.value.message


CLIENT_REASONS = set(FinishReason) - {
    FinishReason.ERROR,
    FinishReason.REJECTED,
    FinishReason.HANDED_OFF,
}


def test_completion_response_parses(demo_tok: Tokenizer) -> None:
    ids = demo_tok.encode(" Hi there", add_special_tokens=False)
    choices = [
        TokenDelta("r", [9], "b", index=1, finish_reason=FinishReason.DEADLINE),
        TokenDelta(
            "r",
            ids,
            " Hi there",
            finish_reason=FinishReason.EOS,
            logprobs=[TokenLogprobs(-1.0, [(ids[0], -1.0)], 1)] * len(ids),
        ),
    ]
    obj = completion_response(META, choices, prompt_tokens=5, tokenizer=demo_tok)
    parsed = Completion.model_validate(obj)
    assert parsed.model_extra == {}
    assert (parsed.id, parsed.object, parsed.created, parsed.model) == (
        "cmpl-1",
        "text_completion",
        1_700_000_000,
        "demo",
    )
    assert [(c.index, c.text, c.finish_reason) for c in parsed.choices] == [
        (0, " Hi there", "stop"),
        (1, "b", "length"),
    ]
    assert parsed.choices[1].logprobs is None
    lp = parsed.choices[0].logprobs
    assert lp is not None and "".join(lp.tokens or []) == " Hi there"
    assert lp.token_logprobs == [-1.0] * len(ids) and lp.text_offset is not None
    assert parsed.usage is not None
    assert parsed.usage.model_dump(exclude_none=True) == {
        "prompt_tokens": 5,
        "completion_tokens": len(ids) + 1,
        "total_tokens": len(ids) + 6,
    }


def test_chat_response_parses(bl_tok: Tokenizer) -> None:
    ids = bl_tok.encode("ok", add_special_tokens=False)
    choices = [
        TokenDelta(
            "r",
            ids,
            "ok",
            finish_reason=FinishReason.MAX_TOKENS,
            logprobs=[TokenLogprobs(-0.25, [], 1)] * len(ids),
        )
    ]
    obj = chat_response(
        ResponseMeta("chatcmpl-1", "demo", 3), choices, prompt_tokens=4, tokenizer=bl_tok
    )
    parsed = ChatCompletion.model_validate(obj)
    assert parsed.model_extra == {} and parsed.object == "chat.completion"
    (c,) = parsed.choices
    assert (c.index, c.finish_reason, c.message.role, c.message.content) == (
        0,
        "length",
        "assistant",
        "ok",
    )
    assert c.logprobs is not None and c.logprobs.content is not None
    assert [t.logprob for t in c.logprobs.content] == [-0.25] * len(ids)
    assert [t.top_logprobs for t in c.logprobs.content] == [[]] * len(ids)
    assert parsed.usage is not None and parsed.usage.total_tokens == 4 + len(ids)


def test_chunks_parse() -> None:
    meta = ResponseMeta("chatcmpl-2", "demo", 3)
    first = ChatCompletionChunk.model_validate(chat_chunk(meta, 1, role=True))
    assert first.choices[0].delta.model_dump(exclude_none=True) == {
        "role": "assistant",
        "content": "",
    }
    mid = ChatCompletionChunk.model_validate(chat_chunk(meta, 1, content="he"))
    assert mid.choices[0].delta.model_dump(exclude_none=True) == {"content": "he"}
    assert mid.choices[0].finish_reason is None
    last = ChatCompletionChunk.model_validate(
        chat_chunk(meta, 1, finish_reason=FinishReason.STOP_STRING)
    )
    assert last.choices[0].delta.model_dump(exclude_none=True) == {}
    assert (last.choices[0].index, last.choices[0].finish_reason) == (1, "stop")
    tail = ChatCompletionChunk.model_validate(
        usage_chunk(meta, "chat.completion.chunk", prompt_tokens=3, completion_tokens=2)
    )
    assert tail.choices == [] and tail.usage is not None and tail.usage.total_tokens == 5
    text = Completion.model_validate(
        completion_chunk(META, 2, "yo", finish_reason=FinishReason.MAX_TOKENS)
    )
    assert [(c.index, c.text, c.finish_reason) for c in text.choices] == [(2, "yo", "length")]


def test_sse_framing_and_models() -> None:
    assert sse({"a": "é", "b": [1, None]}) == 'data: {"a":"é","b":[1,null]}\n\n'.encode()
    assert SSE_DONE == b"data: [DONE]\n\n"
    with pytest.raises(ValueError):
        sse({"x": float("nan")})
    listing = models_response(["demo", "other"])
    assert listing["object"] == "list"
    assert [Model.model_validate(m).id for m in listing["data"]] == ["demo", "other"]


# -- the official client, end to end over a mock transport ---------------------------------------


def mock_client(handler: Callable[[httpx2.Request], httpx2.Response]) -> openai.OpenAI:
    transport = httpx2.MockTransport(handler)
    return openai.OpenAI(
        api_key="test",
        base_url="http://127.0.0.1:1/v1",
        http_client=httpx2.Client(transport=transport),
        max_retries=0,
    )


def fake_server(tok: Tokenizer, seen: list[Any]) -> Callable[[httpx2.Request], httpx2.Response]:
    """Parse what the client sent; answer every choice with the prompt's first 3 tokens."""

    def handle(request: httpx2.Request) -> httpx2.Response:
        chat = request.url.path.endswith("/chat/completions")
        try:
            req = (parse_chat if chat else parse_completion)(request.content)
        except APIError as e:
            return httpx2.Response(e.status, json=e.body())
        seen.append(req)
        sp = sampling_params(req, vocab_size=tok.vocab_size, default_max_tokens=16)
        prompts = (
            [chat_prompt(req, tok)]
            if isinstance(req, ChatCompletionRequest)
            else completion_prompts(req, tok)
        )
        meta = ResponseMeta("x-1", req.model, 9)
        out = [
            TokenDelta("r", ids[1:4], tok.decode(ids[1:4]), index=p * req.n + j,
                       finish_reason=FinishReason.MAX_TOKENS,
                       logprobs=[TokenLogprobs(-1.0, [], 1)] * 3 if sp.logprobs is not None else None)
            for p, ids in enumerate(prompts)
            for j in range(req.n)
        ]  # fmt: skip
        n_prompt = sum(len(p) for p in prompts)
        if not req.stream:
            build = chat_response if chat else completion_response
            return httpx2.Response(
                200, json=build(meta, out, prompt_tokens=n_prompt, tokenizer=tok)
            )
        events: list[bytes] = []
        for c in out:
            if chat:
                events += [sse(chat_chunk(meta, c.index, role=True))]
                events += [sse(chat_chunk(meta, c.index, content=c.text))]
                events += [sse(chat_chunk(meta, c.index, finish_reason=c.finish_reason))]
            else:
                events += [
                    sse(
                        completion_chunk(
                            meta, c.index, c.text, finish_reason=FinishReason.MAX_TOKENS
                        )
                    )
                ]
        if req.include_usage:
            kind: Literal["text_completion", "chat.completion.chunk"] = (
                "chat.completion.chunk" if chat else "text_completion"
            )
            events.append(
                sse(usage_chunk(meta, kind, prompt_tokens=n_prompt, completion_tokens=3 * len(out)))
            )
        events.append(SSE_DONE)
        return httpx2.Response(
            200, content=b"".join(events), headers={"content-type": "text/event-stream"}
        )

    return handle


@pytest.fixture
def client_and_seen(demo_tok: Tokenizer) -> Iterator[tuple[openai.OpenAI, list[Any]]]:
    seen: list[Any] = []
    with mock_client(fake_server(demo_tok, seen)) as client:
        yield client, seen


def test_client_completion_with_extras(
    client_and_seen: tuple[openai.OpenAI, list[Any]], demo_tok: Tokenizer
) -> None:
    client, seen = client_and_seen
    resp = client.completions.create(
        model="demo",
        prompt=["Hello world", "Once upon"],
        n=2,
        max_tokens=5,
        temperature=0.5,
        stop=["\n"],
        seed=7,
        logit_bias={"5": -100},
        logprobs=2,
        extra_body={"top_k": 4, "min_p": 0.1, "repetition_penalty": 1.2, "ignore_eos": True},
    )
    (req,) = seen
    assert sampling_params(req, vocab_size=VOCAB, default_max_tokens=16) == SamplingParams(
        max_tokens=5, temperature=0.5, stop=("\n",), seed=7, logit_bias={5: -100.0}, logprobs=2,
        top_k=4, min_p=0.1, repetition_penalty=1.2, ignore_eos=True,
    )  # fmt: skip
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    want = demo_tok.decode(demo_tok.encode("Once upon")[1:4])
    assert resp.choices[3].text == want and resp.choices[3].finish_reason == "length"
    assert resp.usage is not None and resp.usage.completion_tokens == 12


def test_client_chat_stream_with_usage(client_and_seen: tuple[openai.OpenAI, list[Any]]) -> None:
    client, seen = client_and_seen
    stream = client.chat.completions.create(
        model="demo",
        messages=[{"role": "system", "content": "s"}, {"role": "user", "content": "Hello world"}],
        stream=True,
        stream_options={"include_usage": True},
        max_completion_tokens=3,
        logprobs=True,
        top_logprobs=1,
    )
    chunks = list(stream)
    (req,) = seen
    assert req.include_usage and req.max_completion_tokens == 3
    assert [c.choices[0].delta.role for c in chunks[:1]] == ["assistant"]
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 3


def test_client_completion_stream(client_and_seen: tuple[openai.OpenAI, list[Any]]) -> None:
    client, seen = client_and_seen
    chunks = list(client.completions.create(model="demo", prompt=[1, 2, 3, 4, 5], stream=True))
    assert [c.choices[0].finish_reason for c in chunks] == ["length"]
    assert all(c.usage is None for c in chunks)
    assert not seen[0].include_usage


def test_client_sees_our_errors(client_and_seen: tuple[openai.OpenAI, list[Any]]) -> None:
    client, _ = client_and_seen
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": "x"}], temperature=3
        )
    assert (e.value.status_code, e.value.param, e.value.type) == (
        400,
        "temperature",
        "invalid_request_error",
    )
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="demo", prompt="x", extra_body={"top_kk": 3})
    assert e.value.param == "top_kk"


# -- scoring a prompt: echo, max_tokens 0, prompt_logprobs ----------------------------------------


def lps(ids: list[int], alternatives: list[int]) -> list[TokenLogprobs | None]:
    """Made-up prompt logprobs: None first, then token i at -i, rank 7, ``alternatives`` on top."""
    top = [(t, -0.5 * j) for j, t in enumerate(alternatives)]
    return [None] + [TokenLogprobs(-float(i), top, 7) for i in range(1, len(ids))]


def test_echo_and_prompt_logprobs_in_a_completion_choice(demo_tok: Tokenizer) -> None:
    """Echo: the prompt's text leads the choice's, its tokens lead the logprobs object (the
    first with null values), with ``logprobs`` alternatives each; ``prompt_logprobs``: vLLM's
    per-token dicts, the prompt token first (with its rank), then the top ones ranked 1..k.
    (The official client reads both: tests/e2e/test_api_serve.py.)"""
    prompt = demo_tok.encode("Hello world")
    gen = demo_tok.encode(" again", add_special_tokens=False)
    choice = TokenDelta(
        "r",
        gen,
        " again",
        finish_reason=FinishReason.MAX_TOKENS,
        logprobs=[TokenLogprobs(-0.25, [], 1)] * len(gen),
    )
    report = PromptReport(echo=True, logprobs=1, prompt_logprobs=2)
    obj = completion_response(
        META,
        [choice],
        prompt_tokens=3,
        tokenizer=demo_tok,
        report=report,
        prompts=[Prompt("Hello world", prompt, lps(prompt, [5, 6, 8]))],
    )
    [parsed] = obj["choices"]
    assert parsed["text"] == "Hello world again"
    lp = parsed["logprobs"]
    texts = [token_string(token_bytes(demo_tok, t)) for t in prompt + gen]
    five, six = (token_string(token_bytes(demo_tok, t)) for t in (5, 6))
    assert lp["tokens"] == texts
    scores = [-float(i) for i in range(1, len(prompt))]
    assert lp["token_logprobs"] == [None, *scores] + [-0.25] * len(gen)
    assert lp["top_logprobs"][0] is None
    assert lp["top_logprobs"][1] == {five: 0.0, texts[1]: -1.0}  # 1 alternative, and the token
    assert lp["top_logprobs"][-1] == {texts[-1]: -0.25}
    offsets = [0]
    for t in texts[:-1]:
        offsets.append(offsets[-1] + len(t))
    assert lp["text_offset"] == offsets
    want = [None] + [
        {
            str(prompt[i]): {"logprob": -float(i), "rank": 7, "decoded_token": texts[i]},
            "5": {"logprob": 0.0, "rank": 1, "decoded_token": five},
            "6": {"logprob": -0.5, "rank": 2, "decoded_token": six},
        }
        for i in range(1, len(prompt))
    ]
    assert parsed["prompt_logprobs"] == want
    plain = completion_response(META, [choice], prompt_tokens=3, tokenizer=demo_tok)["choices"]
    assert plain[0]["text"] == " again" and "prompt_logprobs" not in plain[0]
    assert plain[0]["logprobs"]["tokens"] == texts[len(prompt) :]


@pytest.fixture
def translator(demo_tok: Tokenizer) -> Translator:
    return Translator(demo_tok, "demo", 512, demo_tok.vocab_size, GateConfig().max_choices, None)


def test_echo_with_max_tokens_0_scores_the_prompt_alone(
    translator: Translator, demo_tok: Tokenizer
) -> None:
    """lm-eval's scoring call with max_tokens 0: the engine samples one token, which the app
    drops (text, token, logprob); the choice ends ``length``. Streamed, a choice's first chunk
    holds the prompt and its logprobs; a later chunk's offsets continue after the prompt."""
    body = completion_body(prompt=[[5, 6, 7]], echo=True, logprobs=1, max_tokens=0, n=2)
    job = translator.job("cmpl-1", body, "completion", "tenant", 0.0, {})
    choices = Choices(None, demo_tok, Metrics())  # type: ignore[arg-type]  # chunks need no cluster
    assert job.score_only and [p.max_tokens for p in job.params] == [1, 1]
    assert job.prompt_texts == [demo_tok.decode([5, 6, 7])] * 2
    sampled = TokenLogprobs(-2.5, [(9, -1.0)], 3)
    last = TokenDelta(
        "r",
        [9],
        "x",
        finished=True,
        finish_reason=FinishReason.EOS,
        logprobs=[sampled],
        prompt_logprobs=lps([5, 6, 7], [9]),
    )
    [chunk] = choices.chunks(job, 0, None, _no_tokens(last))
    (c,) = chunk["choices"]
    assert (c["text"], c["finish_reason"]) == (job.prompt_texts[0], "length")
    assert c["logprobs"]["token_logprobs"] == [None, -1.0, -2.0]
    assert "prompt_logprobs" not in c  # not asked
    started = TokenDelta("r", [])
    [chunk] = choices.chunks(job, 0, started, TokenDelta("r", [9], "y", logprobs=[sampled]))
    assert chunk["choices"][0]["logprobs"]["text_offset"] == [len(job.prompt_texts[0])]
