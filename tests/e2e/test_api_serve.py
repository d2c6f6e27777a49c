"""The OpenAI API over real HTTP through Ray Serve, in front of a real disaggregated cluster
(1 prefill + 1 decode worker, KV over gRPC on 127.0.0.1), called with the official ``openai``
client and with raw HTTP for the SSE wire format.

Outputs are compared with the colocated engine (which the engine tests hold equal to
transformers); pools are checked back at baseline after cancellations.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest
import ray
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer, token_bytes

pytestmark = pytest.mark.e2e
MODEL = "test-llama"
ENGINE = {"kv_cache_bytes": 4 * 2**20, "max_num_seqs": 16, "max_num_batched_tokens": 256}
KEYS = {"key-alice": "alice", "key-bob": "bob", "key-carol": "carol", "key-dave": "dave"}
TOPOLOGY = """
model: {{path: {path}, name: test-llama}}
domains: [a, b]
pools:
  prefill: {{replicas: 1, num_cpus: 0.5, engine: {engine}}}
  decode: {{replicas: 1, num_cpus: 0.5, engine: {engine}}}
transport: grpc
router: {{local_prefill_max_tokens: 0}}
retry: {{max_attempts: 3, budget_ratio: 1.0, backoff_s: 0.0, deadline_s: 60}}
heartbeat_interval_s: 0.2
heartbeat_timeout_s: 5.0
serve:
  gate:
    max_body_bytes: 65536
    api_keys: {keys}
    quotas:
      bob: {{requests_per_s: 0.001, burst: 2, max_concurrent: 8}}
      dave: {{requests_per_s: 1000, burst: 1000, max_concurrent: 1}}
"""


@pytest.fixture(scope="module")
def proxy_port(server: str, serve_app: Callable[[Path], str]) -> int:
    """Serve's proxy port: it serves the same application."""
    return serve_app.proxy_port  # type: ignore[attr-defined, no-any-return]


@pytest.fixture(scope="module")
def server(
    serve_app: Callable[[Path], str], test_llama: Path, tmp_path_factory: pytest.TempPathFactory
) -> str:
    """The ingress replica's own URL (direct ingress, as ``tandem serve`` runs it)."""
    topology = tmp_path_factory.mktemp("serve") / "topology.yaml"
    topology.write_text(TOPOLOGY.format(path=test_llama, engine=ENGINE, keys=json.dumps(KEYS)))
    return serve_app(topology)


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="key-alice", max_retries=0)


@pytest.fixture(scope="module")
def engine(test_llama: Path) -> LLMEngine:
    return LLMEngine.from_checkpoint(test_llama, EngineConfig(**ENGINE), model_id=MODEL)


@pytest.fixture(scope="module")
def tok(test_llama: Path) -> Tokenizer:
    return Tokenizer(test_llama)


def expected(engine: LLMEngine, tokens: list[int], params: SamplingParams) -> Any:
    [[out]] = engine.generate([tokens], params)
    return out


def workers_idle() -> None:
    """P1 on every worker: nothing running, every pool at baseline (raises otherwise)."""
    for name in ("prefill-0", "decode-0"):
        ray.get(ray.get_actor(name, namespace="tandem").check_idle.remote(), timeout=60)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


# -- the API against the engine ------------------------------------------------------------------


def test_completion_equals_the_engine(
    client: openai.OpenAI, engine: LLMEngine, tok: Tokenizer
) -> None:
    prompt = "Once upon a time there was"
    out = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    want = expected(engine, tok.encode(prompt), greedy(12))
    assert out.choices[0].text == want.text
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (
        len(tok.encode(prompt)),
        12,
    )


def test_serves_proxy_answers_the_same(proxy_port: int, client: openai.OpenAI) -> None:
    """Serve's proxy (how ``serve run deploy/serve.yaml`` on a cluster without direct ingress
    is reached) serves the same application."""
    via_proxy = openai.OpenAI(
        base_url=f"http://127.0.0.1:{proxy_port}/v1", api_key="key-alice", max_retries=0
    )
    args: dict[str, Any] = {"model": MODEL, "prompt": "Both ways", "max_tokens": 8, "seed": 5}
    assert via_proxy.completions.create(**args).choices[0].text == (
        client.completions.create(**args).choices[0].text
    )


def test_streamed_completion_equals_the_whole_one(client: openai.OpenAI) -> None:
    args: dict[str, Any] = {"model": MODEL, "prompt": "The sea", "max_tokens": 20, "seed": 3}
    whole = client.completions.create(**args)
    chunks = list(
        client.completions.create(**args, stream=True, stream_options={"include_usage": True})
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    finals = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finals == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_chat_uses_the_template_and_streams_the_same(
    client: openai.OpenAI, engine: LLMEngine, tok: Tokenizer
) -> None:
    messages: list[Any] = [{"role": "user", "content": "Tell me a story"}]
    whole = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=10,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    want = expected(engine, tok.encode_chat(messages), greedy(10))
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == want.text
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=10,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text


def test_n_and_several_prompts_give_every_choice(
    client: openai.OpenAI, engine: LLMEngine, tok: Tokenizer
) -> None:
    prompts = ["Hello there", "A long time ago"]
    out = client.completions.create(
        model=MODEL,
        prompt=prompts,
        n=2,
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    for c in out.choices:
        want = expected(engine, tok.encode(prompts[c.index // 2]), greedy(6))
        assert c.text == want.text
    assert out.usage is not None and out.usage.completion_tokens == 4 * 6


def test_a_seeded_sampled_n_2_request_draws_the_engines_n_2_texts_and_its_seed_replays(
    client: openai.OpenAI, engine: LLMEngine, tok: Tokenizer
) -> None:
    """docs/design.md#sampling-seeds: the edge runs choice j as its own request with choice j of
    the request's seed, so a seeded n = 2 request draws, through the cluster, the texts one
    engine draws for n = 2; an unseeded one reports the seed it drew, and sending it back
    reproduces the response."""
    prompt = "A long time ago"
    sampled: dict[str, Any] = {"temperature": 0.8, "top_p": 0.95, "max_tokens": 8}
    out = client.completions.create(
        model=MODEL, prompt=prompt, n=2, seed=1234, extra_body={"ignore_eos": True}, **sampled
    )
    params = SamplingParams(n=2, seed=1234, ignore_eos=True, **sampled)
    [want] = engine.generate([tok.encode(prompt)], params)
    assert [c.text for c in out.choices] == [w.text for w in want]
    assert out.choices[0].text != out.choices[1].text  # each choice its own draws

    first = client.completions.create(
        model=MODEL, prompt=prompt, n=2, extra_body={"ignore_eos": True}, **sampled
    )
    seed = (first.model_extra or {})["seed"]
    again = client.completions.create(
        model=MODEL, prompt=prompt, n=2, seed=seed, extra_body={"ignore_eos": True}, **sampled
    )
    assert [c.text for c in again.choices] == [c.text for c in first.choices]
    assert (again.model_extra or {})["seed"] == seed


def test_logprobs_match_the_engine(
    client: openai.OpenAI, engine: LLMEngine, tok: Tokenizer
) -> None:
    prompt = "Logprobs of"
    out = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=5,
        temperature=0,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=2)
    want = expected(engine, tok.encode(prompt), params)
    lp = out.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert lp.token_logprobs == pytest.approx([x.logprob for x in want.logprobs], abs=1e-4)
    assert [len(t) for t in lp.top_logprobs] == [2] * 5


def test_tokens_as_token_ids_name_the_engines_tokens_exactly(
    client: openai.OpenAI, engine: LLMEngine, tok: Tokenizer
) -> None:
    """vLLM's ``return_tokens_as_token_ids``: every token in logprobs (sampled and top-k, both
    endpoints, streamed or not) is ``token_id:N`` with the engine's own ids; text unchanged."""
    prompt = "Token ids of"
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=3)
    want = expected(engine, tok.encode(prompt), params)
    ids = [f"token_id:{t}" for t in want.token_ids]
    tops = [
        {f"token_id:{t}" for t, _ in lp.top[:3]} | {i}
        for lp, i in zip(want.logprobs, ids, strict=True)
    ]
    extra = {"ignore_eos": True, "return_tokens_as_token_ids": True}
    args: dict[str, Any] = {"model": MODEL, "max_tokens": 5, "temperature": 0, "extra_body": extra}
    out = client.completions.create(prompt=prompt, logprobs=3, **args)
    lp = out.choices[0].logprobs
    assert lp is not None and lp.top_logprobs is not None and out.choices[0].text == want.text
    assert lp.tokens == ids and [set(t) for t in lp.top_logprobs] == tops
    streamed = list(client.completions.create(prompt=prompt, logprobs=3, stream=True, **args))
    assert [
        t for c in streamed if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens or []
    ] == ids
    chat = client.chat.completions.create(
        messages=[{"role": "user", "content": prompt}], logprobs=True, top_logprobs=3, **args
    )
    content = chat.choices[0].logprobs.content if chat.choices[0].logprobs else None
    assert content is not None and all(e.token.startswith("token_id:") for e in content)
    named = [int(e.token.split(":")[1]) for e in content]
    assert [bytes(e.bytes or []) for e in content] == [token_bytes(tok, t) for t in named]
    assert all(len(e.top_logprobs) == 3 for e in content)
    plain = client.completions.create(
        prompt=prompt, logprobs=3, **{**args, "extra_body": {"ignore_eos": True}}
    )
    assert plain.choices[0].logprobs is not None and plain.choices[0].logprobs.tokens != ids


def test_echo_scores_a_generation_as_it_was_generated(
    client: openai.OpenAI, engine: LLMEngine, tok: Tokenizer
) -> None:
    """Scoring equals generating, over HTTP: prompt + a greedy generation sent back as lm-eval's
    loglikelihood call (echo, logprobs=1, max_tokens=1) with vLLM's prompt_logprobs gives each
    generated token the logprob (and top) the generation reported -- the same floats, though
    the generation's came from a prefill (token 1) and decode steps (the others) and the
    scoring's from one prefill. max_tokens 0 scores the prompt alone; streamed, the first chunk
    holds the prompt."""
    prompt = tok.encode("Once upon a time")
    gen = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=6,
        temperature=0,
        logprobs=1,
        extra_body={"ignore_eos": True},
    )
    full = prompt + expected(engine, prompt, greedy(6)).token_ids  # what the cluster generated
    gen_lp = gen.choices[0].logprobs
    args: dict[str, Any] = {"model": MODEL, "prompt": full, "echo": True, "logprobs": 1}
    scored = client.completions.create(
        **args, max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 2}
    )
    choice = scored.choices[0]
    lp = choice.logprobs
    assert gen_lp is not None and lp is not None and lp.tokens is not None
    assert lp.token_logprobs is not None and lp.top_logprobs is not None
    assert choice.text.startswith(tok.decode(full)) and len(lp.tokens) == len(full) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[len(prompt) : len(full)] == gen_lp.token_logprobs
    assert lp.top_logprobs[len(prompt) : len(full)] == gen_lp.top_logprobs
    scores = choice.model_extra["prompt_logprobs"] if choice.model_extra else None
    assert scores is not None and len(scores) == len(full) and scores[0] is None
    assert [scores[i][str(t)]["logprob"] for i, t in enumerate(full) if i] == (
        lp.token_logprobs[1 : len(full)]
    )
    assert all(len(entry) in (2, 3) for entry in scores[1:])  # the top 2, and the token
    only = client.completions.create(**args, max_tokens=0)
    assert only.choices[0].text == tok.decode(full) and only.choices[0].finish_reason == "length"
    assert only.choices[0].logprobs is not None
    assert only.choices[0].logprobs.token_logprobs == lp.token_logprobs[: len(full)]
    assert only.usage is not None and only.usage.completion_tokens == 0
    chunks = list(client.completions.create(**args, max_tokens=2, temperature=0, stream=True))
    first = chunks[0].choices[0]
    assert first.text.startswith(tok.decode(full)) and first.logprobs is not None
    assert first.logprobs.token_logprobs == lp.token_logprobs
    workers_idle()


# -- the SSE wire format ---------------------------------------------------------------------------


def test_sse_wire_format(server: str) -> None:
    body = {"model": MODEL, "prompt": "Wire", "max_tokens": 4, "stream": True}
    headers = {"Authorization": "Bearer key-alice"}
    with requests.post(
        f"{server}/v1/completions", json=body, headers=headers, timeout=60, stream=True
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(r.iter_content(chunk_size=None))
    events = raw.split(b"\n\n")
    assert events[-1] == b"" and events[-2] == b"data: [DONE]"
    for event in events[:-2]:
        assert event.startswith(b"data: ")
        assert json.loads(event[len(b"data: ") :])["object"] == "text_completion"


# -- errors ------------------------------------------------------------------------------------------


def post(
    server: str, body: Any, key: str | None = "key-alice", headers: dict[str, str] | None = None
) -> requests.Response:
    auth = {"Authorization": f"Bearer {key}"} if key else {}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return requests.post(
        f"{server}/v1/completions",
        data=content,
        headers={**auth, "Content-Type": "application/json", **(headers or {})},
        timeout=60,
    )


def assert_error(r: requests.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"]
    if param is not None:
        assert error["param"] == param
    return dict(error)


def test_errors_are_openai_error_objects(server: str, client: openai.OpenAI) -> None:
    ok = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    assert_error(post(server, ok, key=None), 401)
    assert_error(post(server, ok, key="wrong"), 401)
    assert_error(post(server, b"{not json"), 400)
    assert_error(post(server, {**ok, "model": "nope"}), 404, "model")
    assert_error(post(server, {**ok, "temperature": 9}), 400, "temperature")
    assert_error(post(server, {**ok, "max_tokens": "many"}), 400, "max_tokens")
    assert_error(post(server, {**ok, "prompt": ""}), 400, "prompt")
    assert_error(post(server, {**ok, "prompt": "x " * 40_000}), 413)
    too_long = assert_error(post(server, {**ok, "max_tokens": 10**6}), 400)
    assert too_long["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", top_p=0)


def test_a_tenant_over_its_rate_gets_429_with_retry_after(server: str) -> None:
    ok = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    assert [post(server, ok, key="key-bob").status_code for _ in range(2)] == [200, 200]
    r = post(server, ok, key="key-bob")
    assert_error(r, 429)
    assert int(r.headers["Retry-After"]) >= 1
    assert post(server, ok, key="key-carol").status_code == 200  # other tenants unaffected


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    body=st.dictionaries(
        st.sampled_from(
            [
                "model",
                "prompt",
                "max_tokens",
                "temperature",
                "top_p",
                "n",
                "stop",
                "seed",
                "logprobs",
                "logit_bias",
                "top_k",
                "min_p",
                "presence_penalty",
                "stream",
            ]
        ),
        st.one_of(
            st.none(),
            st.booleans(),
            st.integers(-5, 10**7),
            st.floats(allow_nan=True),
            st.text(max_size=5),
            st.lists(st.integers(-3, 5000), max_size=3),
            st.dictionaries(st.text(max_size=3), st.integers(-200, 200), max_size=2),
        ),
    )
)
def test_bad_input_is_a_4xx_never_a_crash(server: str, body: dict[str, Any]) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2, **body}
    r = post(server, body)
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        assert r.json()["error"]["message"]


def test_rejected_requests_change_nothing(server: str) -> None:
    """P11: a 4xx takes nothing with it: dave may have one request in flight, and after a run
    of bad requests his next good one is still admitted; the workers are idle."""
    ok = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    bad = [b"{", {**ok, "temperature": -1}, {**ok, "model": "nope"}, {**ok, "n": 0}, {**ok, "x": 1}]
    for body in bad * 3:
        assert 400 <= post(server, body, key="key-dave").status_code < 500
    assert post(server, ok, key="key-dave").status_code == 200
    workers_idle()


# -- cancellation, deadlines, backpressure, metrics ---------------------------------------------------


def test_dropped_streams_free_their_kv(server: str) -> None:
    """Clients that hang up mid-stream cancel their requests (each ends CANCELLED, long before
    its 1000 tokens): every pool is back at baseline."""

    def cancelled() -> float:
        text = requests.get(f"{server}/metrics", timeout=10).text
        return sum(
            float(line.split()[-1])
            for line in text.splitlines()
            if line.startswith("tandem_requests_total{") and 'status="cancelled"' in line
        )

    def drop_after(n: int) -> None:
        body = {
            "model": MODEL,
            "prompt": f"drop {n}",
            "max_tokens": 1000,  # four fit in the KV cache at once
            "stream": True,
            "ignore_eos": True,
        }
        headers = {"Authorization": "Bearer key-alice"}
        r = requests.post(
            f"{server}/v1/completions", json=body, headers=headers, timeout=60, stream=True
        )
        try:
            assert r.status_code == 200, r.text
            sock = r.raw._fp.fp.raw._sock  # before reading: leaving the loop below may close it
            events = []
            for line in r.iter_lines():
                if line:
                    events.append(line)
                if len(events) == n:
                    break
            assert len(events) == n and b"error" not in b"".join(events), events
            with contextlib.suppress(OSError):  # closed already: that was the hang-up
                sock.shutdown(socket.SHUT_RDWR)  # hang up mid-stream
        except BaseException as e:  # a thread's failure is the test's
            failures.append(e)
        finally:
            r.close()

    before = cancelled()
    failures: list[BaseException] = []
    threads = [threading.Thread(target=drop_after, args=(n,)) for n in (1, 3, 6, 10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures
    workers_idle()
    until = time.time() + 10  # the ingress records a request once its cancellation is done
    while cancelled() < before + 4 and time.time() < until:
        time.sleep(0.1)
    assert cancelled() == before + 4, [
        line
        for line in requests.get(f"{server}/metrics", timeout=10).text.splitlines()
        if line.startswith("tandem_requests_total")
    ]


class _SmallWindowConnection(http.client.HTTPConnection):
    """A client whose receive window stays small (set before connecting): when it stops
    reading, the server's socket fills after a few KiB."""

    def connect(self) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.connect((self.host, self.port))


def test_a_slow_http_reader_backpressures_its_request(
    server: str, engine: LLMEngine, tok: Tokenizer
) -> None:
    """A client that stops reading its SSE stream stops the decode engine: once the socket's
    buffers are full (the kernel's send buffer: up to ``net.ipv4.tcp_wmem``'s 4 MiB here) the
    replica's write waits, the SSE generator stops pulling, and the request goes BACKPRESSURED
    (KV kept, no tokens: server memory bounded) and stays so while the client does not read;
    reading again resumes it and the stream completes exactly. Chunks carry 20 top logprobs
    (~1.5 KiB a token) so that 4000 tokens overflow those buffers."""
    wmem_max = int(Path("/proc/sys/net/ipv4/tcp_wmem").read_text().split()[2])
    if wmem_max > 5 << 20:
        pytest.skip(f"a {wmem_max >> 20} MiB TCP send buffer holds this whole ~7 MB stream")
    decode = ray.get_actor("decode-0", namespace="tandem")
    before = ray.get(decode.backpressure_stats.remote(), timeout=30)
    messages: list[Any] = [{"role": "user", "content": "A slow reader"}]
    n = 4000
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": n,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 20,
        "ignore_eos": True,
        "stream": True,
    }
    host, port = server.removeprefix("http://").split(":")
    conn = _SmallWindowConnection(host, int(port), timeout=120)
    try:
        conn.request(
            "POST",
            "/v1/chat/completions",
            json.dumps(body),
            {"Authorization": "Bearer key-alice", "Content-Type": "application/json"},
        )
        reply = conn.getresponse()
        assert reply.status == 200
        data = reply.read(64)  # the stream is flowing; now stop reading
        until = time.time() + 60
        while (stats := ray.get(decode.backpressure_stats.remote(), timeout=30)).pauses == (
            before.pauses
        ):
            assert time.time() < until, f"never backpressured: {stats}"
            time.sleep(0.2)
        time.sleep(1.0)  # not reading: it stays paused
        assert ray.get(decode.backpressure_stats.remote(), timeout=30).resumes == stats.resumes
        data += reply.read()
    finally:
        conn.close()
    after = ray.get(decode.backpressure_stats.remote(), timeout=30)
    assert after.resumes > stats.resumes and after.max_buffered <= 64
    events = [e.removeprefix("data: ") for e in data.decode().split("\n\n") if e]
    assert events[-1] == "[DONE]"
    deltas = [json.loads(e)["choices"] for e in events[:-1]]
    text = "".join(c[0]["delta"].get("content") or "" for c in deltas if c)
    assert text == expected(engine, tok.encode_chat(messages), greedy(n)).text
    workers_idle()


def test_a_request_past_its_timeout_gets_a_typed_error(server: str) -> None:
    body = {"model": MODEL, "prompt": "slow", "max_tokens": 3000, "ignore_eos": True}
    r = post(server, body, headers={"X-Request-Timeout": "0.5"})
    error = assert_error(r, 504)
    assert error["code"] == "timeout"
    workers_idle()


def test_timeouts_come_from_the_header_or_the_body_and_only_shorten_the_servers(
    server: str,
) -> None:
    """This server's topology sets retry.deadline_s = 60: a client may ask for less (header or
    body field; the shorter wins), never more, and only for a positive number of seconds."""
    body = {"model": MODEL, "prompt": "slow", "max_tokens": 3000, "ignore_eos": True}
    for headers, extra, param in [
        ({"X-Request-Timeout": "soon"}, {}, "X-Request-Timeout"),
        ({"X-Request-Timeout": "-1"}, {}, "X-Request-Timeout"),
        ({"X-Request-Timeout": "61"}, {}, "X-Request-Timeout"),
        ({}, {"timeout": 61.0}, "timeout"),
        ({}, {"timeout": 0}, "timeout"),
    ]:
        error = assert_error(post(server, {**body, **extra}, headers=headers), 400, param)
        assert error["code"] in ("invalid_timeout", None), error
    started = time.time()
    r = post(server, {**body, "timeout": 30.0}, headers={"X-Request-Timeout": "0.5"})
    assert assert_error(r, 504)["code"] == "timeout"
    assert time.time() - started < 10
    r = post(server, {**body, "timeout": 0.5}, headers={"X-Request-Timeout": "30"})
    assert assert_error(r, 504)["code"] == "timeout"
    workers_idle()


def test_health_models_and_metrics(server: str, client: openai.OpenAI) -> None:
    assert requests.get(f"{server}/health", timeout=10).status_code == 200
    assert [m.id for m in client.models.list().data] == [MODEL]
    client.completions.create(model=MODEL, prompt="count me", max_tokens=3)
    text = requests.get(f"{server}/metrics", timeout=10).text
    for name in (
        "tandem_time_to_first_token_seconds_count",
        "tandem_requests_total",
        "tandem_kv_usage_ratio",
        "tandem_rejections_total",
    ):
        assert name in text
    for count in ("tandem_kv_transfer_bytes_count", "tandem_queue_time_seconds_count"):
        lines = [line for line in text.splitlines() if line.startswith(count)]
        assert lines and float(lines[0].split()[-1]) > 0, count  # observed, not just declared


def test_tenants_never_share_cached_prefixes(server: str) -> None:
    """P10: the API key's tenant salts the prefix cache; the same prompt from another tenant
    gets no cache hit, the same tenant's repeat does."""
    router = ray.get_actor("tandem-router", namespace="tandem")
    prompt = list(range(100, 100 + 96))  # six full blocks of 16

    def prefill_hits(key: str) -> int:
        r = post(server, {"model": MODEL, "prompt": prompt, "max_tokens": 1}, key=key)
        assert r.status_code == 200, r.text
        last = ray.get(router.decisions.remote())[-1]
        return max(c["hit_blocks"] for c in last["candidates"] if c["role"] == "prefill")

    assert prefill_hits("key-alice") == 0
    time.sleep(0.5)  # the prefill worker's KV events reach the router
    assert prefill_hits("key-carol") == 0  # same tokens, other tenant: nothing shared
    time.sleep(0.5)
    assert prefill_hits("key-alice") == 6  # all six blocks, in the index of its own salt
