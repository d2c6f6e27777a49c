"""The OpenAI protocol layer: validation errors name the field, requests translate into exact
SamplingParams, and what the builders emit is what the official ``openai`` client parses.

The client is driven end to end through ``httpx2.MockTransport``: it builds and sends the request
bytes it would send to a server, and parses our response bytes, with no socket at all."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import httpx2
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from api.app import Service, _Choice, _no_tokens
from api.gate import GateConfig, IngressGate
from api.metrics import Metrics
from api.protocol import (
    SSE_DONE,
    APIError,
    ChatCompletionRequest,
    Choice,
    CompletionRequest,
    Prompt,
    PromptReport,
    ResponseMeta,
    chat_chunk,
    chat_logprobs,
    chat_prompt,
    chat_response,
    check_model,
    choice_params,
    completion_chunk,
    completion_logprobs,
    completion_prompts,
    completion_response,
    models_response,
    openai_finish_reason,
    parse_chat,
    parse_completion,
    sampling_params,
    sse,
    token_bytes,
    token_string,
    usage_chunk,
)
from cluster.client_stream import ClientDelta
from engine.request import FinishReason
from engine.sampler import TokenLogprobs
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer

VOCAB = 2048  # the test checkpoints' vocabulary
MSGS = [{"role": "user", "content": "hi"}]
META = ResponseMeta(id="cmpl-1", model="demo", created=1_700_000_000)


def completion_body(**fields: Any) -> bytes:
    return json.dumps({"model": "demo", "prompt": "hi", **fields}).encode()


def chat_body(**fields: Any) -> bytes:
    return json.dumps({"model": "demo", "messages": MSGS, **fields}).encode()


def params(req: CompletionRequest | ChatCompletionRequest) -> SamplingParams:
    return sampling_params(req, vocab_size=VOCAB, default_max_tokens=100)


# -- validation: every field's range, status 400 with the field named ----------------------------

SHARED_BAD: list[tuple[str, Any]] = [
    ("model", 5),
    ("max_tokens", 0),
    ("max_tokens", 1.5),
    ("temperature", -0.01),
    ("temperature", 2.01),
    ("temperature", "1"),
    ("temperature", True),
    ("top_p", 0),
    ("top_p", 1.01),
    ("n", 0),
    ("n", 17),
    ("n", True),
    ("stream", "yes"),
    ("stop", ["a", "b", "c", "d", "e"]),
    ("stop", ""),
    ("stop", ["ok", ""]),
    ("stop", 7),
    ("stop", ["a", 7]),
    ("seed", 2**63),
    ("seed", -(2**63) - 1),
    ("seed", 1.0),
    ("presence_penalty", -2.01),
    ("presence_penalty", 2.01),
    ("frequency_penalty", -2.01),
    ("frequency_penalty", 2.01),
    ("logit_bias", {"5": 100.5}),
    ("logit_bias", {"5": -101}),
    ("logit_bias", {"five": 1}),
    ("logit_bias", {"-5": 1}),
    ("logit_bias", {"5": "1"}),
    ("logit_bias", [5]),
    ("user", 5),
    ("top_k", -2),
    ("min_p", -0.1),
    ("min_p", 1.1),
    ("typical_p", 0),
    ("typical_p", 1.1),
    ("repetition_penalty", 0),
    ("repetition_penalty", -1),
    ("min_tokens", -1),
    ("ignore_eos", 1),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", [1.5]),
    ("stop_token_ids", 3),
    ("include_stop_str_in_output", "true"),
    ("temprature", 0.5),  # unknown field: a typo is an error, not a silent default
    ("best_of", 2),  # an OpenAI field this server does not implement
]


@pytest.mark.parametrize(("field", "value"), SHARED_BAD)
@pytest.mark.parametrize("parse", [parse_completion, parse_chat])
def test_shared_fields_out_of_range(parse: Callable[[bytes], Any], field: str, value: Any) -> None:
    body = completion_body if parse is parse_completion else chat_body
    with pytest.raises(APIError) as e:
        parse(body(**{field: value}))
    assert (e.value.status, e.value.type) == (400, "invalid_request_error")
    assert e.value.param is not None and e.value.param.split(".")[0] == field  # "stop.1"
    assert e.value.param in e.value.message


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"prompt": []}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": ["a", ""]}, "prompt"),
        ({"prompt": [[]]}, "prompt"),
        ({"prompt": [[1, 2], []]}, "prompt"),
        ({"prompt": [1, -2]}, "prompt"),
        ({"prompt": [1, True]}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": ["a", [1]]}, "prompt"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": None}, "prompt"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"echo": 1}, "echo"),
        ({"echo": False, "max_tokens": 0}, "max_tokens"),  # 0 only scores an echoed prompt
        ({"echo": True, "max_tokens": -1}, "max_tokens"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt_logprobs": True}, "prompt_logprobs"),
        ({"prompt_logprobs": "2"}, "prompt_logprobs"),
        ({"max_completion_tokens": 5}, "max_completion_tokens"),  # chat only
        ({"stream_options": {"include_usage": True}}, "stream_options"),  # needs stream
        ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
        (
            {"stream": True, "stream_options": {"include_obfuscation": True}},
            "stream_options.include_obfuscation",
        ),
    ],
)
def test_completion_fields_out_of_range(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as e:
        parse_completion(completion_body(**fields))
    assert (e.value.status, e.value.param) == (400, param)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.role"),
        ({"messages": [MSGS[0], {"content": "x"}]}, "messages.1.role"),
        ({"messages": [{"role": "user"}]}, "messages.0.content"),
        ({"messages": [{"role": "user", "content": None}]}, "messages.0.content"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages.0.content",
        ),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages.0.content"),
        (
            {"messages": [{"role": "user", "content": "x", "tool_calls": []}]},
            "messages.0.tool_calls",
        ),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"logprobs": 1}, "logprobs"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"top_logprobs": -1, "logprobs": True}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs
        ({"prompt": "x"}, "prompt"),  # completions only
        ({"echo": True}, "echo"),  # completions only
        ({"prompt_logprobs": 1}, "prompt_logprobs"),  # completions only
        ({"tools": []}, "tools"),
    ],
)
def test_chat_fields_out_of_range(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as e:
        parse_chat(chat_body(**fields))
    assert (e.value.status, e.value.param) == (400, param)


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (b"{", "not valid JSON"),
        (b"", "the body is empty"),
        (b"\xff\xfe", "not valid JSON"),
        (b'{"model": "demo", "prompt": "\\ud800"}', "not valid JSON"),  # a lone surrogate
        (b"[1, 2]", "must be a JSON object"),
        (b'"text"', "must be a JSON object"),
        (b'{"prompt": "hi"}', "'model' is required"),
        (b'{"model": "demo", "prompt": "hi", "temperature": NaN}', "temperature"),
    ],
)
def test_malformed_bodies(body: bytes, needle: str) -> None:
    with pytest.raises(APIError) as e:
        parse_completion(body)
    assert e.value.status == 400 and needle in e.value.message


def test_error_body_is_openais_error_object() -> None:
    with pytest.raises(APIError) as e:
        parse_completion(completion_body(n=17))
    assert e.value.body() == {
        "error": {
            "message": "invalid value for 'n' (17): Input should be less than or equal to 16",
            "type": "invalid_request_error",
            "param": "n",
            "code": None,
        }
    }
    assert APIError(429, "slow down").type == "rate_limit_error"
    assert APIError(503, "draining", type="overloaded").type == "overloaded"


def test_check_model() -> None:
    check_model("demo", ["demo"])
    with pytest.raises(APIError) as e:
        check_model("gpt-4", ["demo"])
    assert (e.value.status, e.value.type, e.value.param, e.value.code) == (
        404,
        "not_found_error",
        "model",
        "model_not_found",
    )


# -- arbitrary bodies: APIError and nothing else --------------------------------------------------

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4)
    ),
    max_leaves=12,
)
small_values = st.one_of(
    json_values,
    st.integers(-3, 30),
    st.floats(-3, 3),
    st.text(max_size=3),
    st.lists(st.integers(-2, VOCAB + 2), max_size=4),
    st.lists(st.lists(st.integers(-1, VOCAB), max_size=3), max_size=3),
    st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system", "assistant", "x"]), "content": json_values}
        ),
        max_size=3,
    ),
    st.dictionaries(st.sampled_from(["0", "5", str(VOCAB), "x"]), st.floats(-200, 200), max_size=2),
)


def field_bodies(
    model: type[CompletionRequest | ChatCompletionRequest],
) -> st.SearchStrategy[bytes]:
    """A valid body with up to three of the endpoint's own fields set to arbitrary values."""
    base = {"model": "demo", "prompt": "hi"} if model is CompletionRequest else chat_body()
    base = json.loads(base) if isinstance(base, bytes) else base
    fields = st.dictionaries(st.sampled_from(sorted(model.model_fields)), small_values, max_size=3)
    good = st.deferred(lambda: valid_fields)  # valid values, then the arbitrary ones on top
    return st.builds(lambda g, d: json.dumps({**base, **g, **d}).encode(), good, fields)


def any_bodies(model: type[CompletionRequest | ChatCompletionRequest]) -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.binary(max_size=40),
        json_values.map(lambda v: json.dumps(v).encode()),
        field_bodies(model),
    )


@settings(max_examples=300, deadline=None)
@given(data=st.data())
@pytest.mark.parametrize(
    ("parse", "prompts"), [(parse_completion, completion_prompts), (parse_chat, chat_prompt)]
)
def test_arbitrary_bodies_raise_only_api_errors(
    demo_tok: Tokenizer,
    parse: Callable[[bytes], Any],
    prompts: Callable[..., Any],
    data: st.DataObject,
) -> None:
    """Parse, translate and tokenise: a body either makes it through or is an APIError(400)."""
    model = CompletionRequest if parse is parse_completion else ChatCompletionRequest
    body = data.draw(any_bodies(model))
    try:
        req = parse(body)
        sampling_params(req, vocab_size=VOCAB, default_max_tokens=16)
        assert all(prompts(req, demo_tok))
    except APIError as e:
        assert e.status == 400 and e.message and e.type == "invalid_request_error"


# -- translation into SamplingParams --------------------------------------------------------------

valid_fields = st.fixed_dictionaries(
    {},
    optional={
        "max_tokens": st.integers(20, 10_000),
        "temperature": st.floats(0, 2),
        "top_p": st.floats(0, 1, exclude_min=True),
        "n": st.integers(1, 16),
        "stop": st.text(min_size=1, max_size=4) | st.lists(st.text(min_size=1), max_size=4),
        "seed": st.integers(-(2**63), 2**63 - 1),
        "presence_penalty": st.floats(-2, 2),
        "frequency_penalty": st.floats(-2, 2),
        "logit_bias": st.dictionaries(
            st.integers(0, VOCAB - 1).map(str), st.integers(-100, 100) | st.floats(-100, 100)
        ),
        "top_k": st.integers(-1, VOCAB),
        "min_p": st.floats(0, 1),
        "typical_p": st.floats(0, 1, exclude_min=True),
        "repetition_penalty": st.floats(0.01, 10),
        "min_tokens": st.integers(0, 20),
        "ignore_eos": st.booleans(),
        "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=3),
        "include_stop_str_in_output": st.booleans(),
        "user": st.text(max_size=5),
    },
)


def expected_params(fields: dict[str, Any], logprobs: int | None) -> SamplingParams:
    stop = fields.get("stop", [])
    return SamplingParams(
        n=1,
        max_tokens=fields.get("max_tokens", 100),
        min_tokens=fields.get("min_tokens", 0),
        temperature=fields.get("temperature", 1.0),
        top_k=max(fields.get("top_k", 0), 0),
        top_p=fields.get("top_p", 1.0),
        min_p=fields.get("min_p", 0.0),
        typical_p=fields.get("typical_p", 1.0),
        repetition_penalty=fields.get("repetition_penalty", 1.0),
        frequency_penalty=fields.get("frequency_penalty", 0.0),
        presence_penalty=fields.get("presence_penalty", 0.0),
        logit_bias={int(k): v for k, v in fields.get("logit_bias", {}).items()},
        seed=fields.get("seed"),
        stop=(stop,) if isinstance(stop, str) else tuple(stop),
        stop_token_ids=tuple(fields.get("stop_token_ids", ())),
        include_stop_str_in_output=fields.get("include_stop_str_in_output", False),
        ignore_eos=fields.get("ignore_eos", False),
        logprobs=logprobs,
    )


@given(valid_fields, st.none() | st.integers(0, 20))
def test_completion_round_trips_into_sampling_params(
    fields: dict[str, Any], lp: int | None
) -> None:
    req = parse_completion(completion_body(**fields, logprobs=lp))
    assert params(req) == expected_params(fields, lp)
    assert req.n == fields.get("n", 1)


@given(valid_fields, st.booleans(), st.none() | st.integers(0, 20))
def test_chat_round_trips_into_sampling_params(
    fields: dict[str, Any], logprobs: bool, top: int | None
) -> None:
    if top is not None:
        logprobs = True
    req = parse_chat(chat_body(**fields, logprobs=logprobs, top_logprobs=top))
    assert params(req) == expected_params(fields, (top or 0) if logprobs else None)


def test_max_tokens_sources() -> None:
    assert params(parse_completion(completion_body())).max_tokens == 100  # the default
    assert params(parse_chat(chat_body(max_tokens=7))).max_tokens == 7
    both = parse_chat(chat_body(max_tokens=7, max_completion_tokens=9))
    assert params(both).max_tokens == 9  # the current name wins over the deprecated one


@pytest.mark.parametrize(
    ("fields", "param", "needle"),
    [
        ({"logit_bias": {str(VOCAB): 1}}, "logit_bias", f"token id {VOCAB}"),
        ({"stop_token_ids": [3, VOCAB + 5]}, "stop_token_ids", f"token id {VOCAB + 5}"),
        ({"top_k": VOCAB + 1}, "top_k", f"top_k={VOCAB + 1}"),
        ({"min_tokens": 8, "max_tokens": 7}, "min_tokens", "min_tokens=8"),
        ({"min_tokens": 101}, "min_tokens", "max_tokens=100"),  # against the default
    ],
)
def test_sampling_params_errors_name_the_field(
    fields: dict[str, Any], param: str, needle: str
) -> None:
    with pytest.raises(APIError) as e:
        params(parse_completion(completion_body(**fields)))
    assert (e.value.status, e.value.param) == (400, param) and needle in e.value.message


def test_no_room_for_a_default_max_tokens_is_a_400() -> None:
    req = parse_completion(completion_body())
    with pytest.raises(APIError) as e:
        sampling_params(req, vocab_size=VOCAB, default_max_tokens=0)
    assert (e.value.status, e.value.param) == (400, "max_tokens")


def test_choice_params_keep_the_seed_and_name_the_choice() -> None:
    """Choice j draws stream j of the request's one seed, as the engine's sample j does."""
    p = params(parse_completion(completion_body(seed=42, n=3)))
    assert choice_params(p, 0) is p
    assert [(choice_params(p, j).seed, choice_params(p, j).choice) for j in range(3)] == [
        (42, 0),
        (42, 1),
        (42, 2),
    ]
    assert choice_params(p, 2) == SamplingParams(**{**p.__dict__, "choice": 2})


@pytest.mark.parametrize("seed", [None, -3])
def test_the_app_gives_every_choice_one_seed_and_reports_it(
    service: Service, seed: int | None
) -> None:
    """The seed asked for, else one drawn per request: every choice carries it with its own
    choice index, and the response reports it. Two unseeded requests draw different seeds."""

    def parse() -> Any:
        body = completion_body(prompt=["a", "b"], n=2, seed=seed)
        return service._parse(body, "completion", "tenant", 0.0, {})

    job = parse()
    drawn = job.meta.seed
    assert drawn is not None and (seed is None or drawn == seed)
    assert [(p.seed, p.choice) for p in job.params] == [(drawn, 0), (drawn, 1)] * 2
    assert (parse().meta.seed != drawn) == (seed is None)


def test_the_seed_is_a_top_level_field_of_every_response_object(bl_tok: Tokenizer) -> None:
    """With a seed in the meta every object carries it (the openai client keeps it as an extra
    field); without one no object has the field."""
    meta = ResponseMeta("cmpl-3", "demo", 3, seed=2**62)
    choices = [Choice(0, "ok", [5], FinishReason.MAX_TOKENS)]
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


# -- prompts --------------------------------------------------------------------------------------


def test_completion_prompts_encode_each_prompt(demo_tok: Tokenizer) -> None:
    one = parse_completion(completion_body(prompt="Hello world"))
    assert completion_prompts(one, demo_tok) == [demo_tok.encode("Hello world")]
    assert demo_tok.encode("Hello world")[0] == demo_tok.bos_token_id
    batch = parse_completion(completion_body(prompt=["a b", "c"]))
    assert completion_prompts(batch, demo_tok) == [demo_tok.encode("a b"), demo_tok.encode("c")]
    ids = parse_completion(completion_body(prompt=[5, 6, 7]))
    assert completion_prompts(ids, demo_tok) == [[5, 6, 7]]
    id_batch = parse_completion(completion_body(prompt=[[5], [6, VOCAB - 1]]))
    assert completion_prompts(id_batch, demo_tok) == [[5], [6, VOCAB - 1]]


def test_prompt_token_ids_outside_the_vocabulary(demo_tok: Tokenizer) -> None:
    req = parse_completion(completion_body(prompt=[[1], [2, VOCAB]]))
    with pytest.raises(APIError) as e:
        completion_prompts(req, demo_tok)
    assert (e.value.status, e.value.param) == (400, "prompt")
    assert f"token id {VOCAB}" in e.value.message


@pytest.mark.parametrize("tok_name", ["demo_tok", "bl_tok"])
def test_chat_prompt_uses_the_chat_template(request: pytest.FixtureRequest, tok_name: str) -> None:
    tok: Tokenizer = request.getfixturevalue(tok_name)
    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}],
        },
        {"role": "assistant", "content": "Hello", "name": "bot"},
        {"role": "user", "content": "Again"},
    ]
    req = parse_chat(json.dumps({"model": "demo", "messages": messages}).encode())
    plain = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi\nthere"},
        {"role": "assistant", "content": "Hello", "name": "bot"},
        {"role": "user", "content": "Again"},
    ]
    ids = chat_prompt(req, tok)
    assert ids == tok.encode_chat(plain, add_generation_prompt=True)
    text = tok.decode(ids, skip_special_tokens=False)
    assert text.endswith(tok.apply_chat_template(plain, add_generation_prompt=True)[-12:])
    assert "Be brief." in text and "Hi\nthere" in text
    assert ids != tok.encode_chat(plain, add_generation_prompt=False)


def test_chat_without_a_template_is_a_400(test_llama: Path, tmp_path: Path) -> None:
    shutil.copy(test_llama / "tokenizer.json", tmp_path / "tokenizer.json")
    with pytest.raises(APIError) as e:
        chat_prompt(parse_chat(chat_body()), Tokenizer(tmp_path))
    assert (e.value.status, e.value.param) == (400, "messages")
    assert "chat_template" in e.value.message


# -- logprobs -------------------------------------------------------------------------------------


@pytest.mark.parametrize("tok_name", ["demo_tok", "bl_tok"])
@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    text=st.text(
        st.characters(codec="utf-8", exclude_categories=["Cs", "Cc"]), min_size=1, max_size=12
    )
)
def test_token_bytes_rebuild_the_text(
    request: pytest.FixtureRequest, tok_name: str, text: str
) -> None:
    """Mid-stream, each token adds exactly its bytes: a token after the prompt is decoded the
    way the detokenizer sees it (leading spaces kept, split characters as their bytes). A
    special token (text like "<s>" parses to one) adds no text; its logprob entry still names
    it by its own piece, as OpenAI's and vLLM's do."""
    tok: Tokenizer = request.getfixturevalue(tok_name)
    prompt = tok.encode("x", add_special_tokens=False)
    ids = tok.encode("x" + text, add_special_tokens=False)
    if ids[: len(prompt)] != prompt:
        return  # "x" merged into the text's first token
    new = ids[len(prompt) :]
    joined = b"".join(token_bytes(tok, t) for t in new if t not in tok.special_token_ids)
    assert joined == tok.decode(ids).encode()[len(tok.decode(prompt).encode()) :]
    for t in new:
        if t in tok.special_token_ids:
            assert token_bytes(tok, t) == str(tok.id_to_token(t)).encode()


@pytest.mark.parametrize("tok_name", ["demo_tok", "bl_tok"])
def test_token_bytes_around_a_special_token(request: pytest.FixtureRequest, tok_name: str) -> None:
    """The case hypothesis found: "<s>" in the text is the special token, which adds no text."""
    tok: Tokenizer = request.getfixturevalue(tok_name)
    special = min(tok.special_token_ids)
    piece = str(tok.id_to_token(special))
    prompt = tok.encode("x", add_special_tokens=False)
    ids = tok.encode("x" + piece, add_special_tokens=False)
    assert ids == [*prompt, special]
    assert tok.decode(ids) == tok.decode(prompt)  # no text added
    assert token_bytes(tok, special) == piece.encode()


def test_token_strings_of_split_characters(demo_tok: Tokenizer, bl_tok: Tokenizer) -> None:
    ids = demo_tok.encode("日", add_special_tokens=False)
    raws = [token_bytes(demo_tok, t) for t in ids]
    assert b"".join(raws).strip() == "日".encode()
    assert token_string(b"\xe6\x97") == "bytes:\\xe6\\x97"
    assert token_string(" é".encode()) == " é"
    bl_ids = bl_tok.encode("🙂", add_special_tokens=False)
    assert b"".join(token_bytes(bl_tok, t) for t in bl_ids) == "🙂".encode()


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
        Choice(1, "b", [9], FinishReason.DEADLINE),
        Choice(
            0,
            " Hi there",
            ids,
            FinishReason.EOS,
            [TokenLogprobs(-1.0, [(ids[0], -1.0)], 1)] * len(ids),
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
        Choice(0, "ok", ids, FinishReason.MAX_TOKENS, [TokenLogprobs(-0.25, [], 1)] * len(ids))
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
            Choice(p * req.n + j, tok.decode(ids[1:4]), ids[1:4], FinishReason.MAX_TOKENS,
                   [TokenLogprobs(-1.0, [], 1)] * 3 if sp.logprobs is not None else None)
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


@pytest.mark.parametrize(
    ("fields", "max_tokens", "logprobs", "prompt_logprobs"),
    [
        ({"echo": True, "logprobs": 3}, 100, 3, 3),  # the echoed prompt shows 3 alternatives
        ({"echo": True}, 100, None, None),  # text only: nothing to score
        ({"logprobs": 3}, 100, 3, None),  # no echo: generated tokens only
        ({"prompt_logprobs": 0}, 100, None, 0),
        ({"echo": True, "logprobs": 1, "prompt_logprobs": 5}, 100, 1, 5),  # both fields' most
        ({"echo": True, "logprobs": 2, "prompt_logprobs": 0, "max_tokens": 0}, 1, 2, 2),
    ],
)
def test_scoring_fields_into_sampling_params(
    fields: dict[str, Any], max_tokens: int, logprobs: int | None, prompt_logprobs: int | None
) -> None:
    """The engine computes the alternatives both fields need; ``max_tokens: 0`` runs one token
    (the app drops it)."""
    p = params(parse_completion(completion_body(**fields)))
    assert (p.max_tokens, p.logprobs, p.prompt_logprobs) == (max_tokens, logprobs, prompt_logprobs)
    with pytest.raises(APIError) as e:
        params(parse_completion(completion_body(echo=True, max_tokens=0, min_tokens=1)))
    assert e.value.param == "min_tokens"


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
    choice = Choice(
        0,
        " again",
        gen,
        FinishReason.MAX_TOKENS,
        [TokenLogprobs(-0.25, [], 1)] * len(gen),
        Prompt("Hello world", prompt, lps(prompt, [5, 6, 8])),
    )
    report = PromptReport(echo=True, logprobs=1, prompt_logprobs=2)
    obj = completion_response(META, [choice], prompt_tokens=3, tokenizer=demo_tok, report=report)
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
def service(demo_tok: Tokenizer) -> Service:
    return Service(
        None,  # type: ignore[arg-type]  # parsing and rendering need no cluster
        None,  # type: ignore[arg-type]
        demo_tok,
        "demo",
        512,
        demo_tok.vocab_size,
        IngressGate(GateConfig()),
        Metrics(),
        None,
    )


def test_echo_with_max_tokens_0_scores_the_prompt_alone(
    service: Service, demo_tok: Tokenizer
) -> None:
    """lm-eval's scoring call with max_tokens 0: the engine samples one token, which the app
    drops (text, token, logprob); the choice ends ``length``. Streamed, a choice's first chunk
    holds the prompt and its logprobs; a later chunk's offsets continue after the prompt."""
    body = completion_body(prompt=[[5, 6, 7]], echo=True, logprobs=1, max_tokens=0, n=2)
    job = service._parse(body, "completion", "tenant", 0.0, {})
    assert job.score_only and [p.max_tokens for p in job.params] == [1, 1]
    assert job.prompt_texts == [demo_tok.decode([5, 6, 7])] * 2
    sampled = TokenLogprobs(-2.5, [(9, -1.0)], 3)
    last = ClientDelta([9], "x", True, FinishReason.EOS, [sampled], lps([5, 6, 7], [9]))
    [chunk] = service._chunks(job, _Choice(0), _no_tokens(last))
    (c,) = chunk["choices"]
    assert (c["text"], c["finish_reason"]) == (job.prompt_texts[0], "length")
    assert c["logprobs"]["token_logprobs"] == [None, -1.0, -2.0]
    assert "prompt_logprobs" not in c  # not asked
    [chunk] = service._chunks(
        job, _Choice(0, started=True), ClientDelta([9], "y", logprobs=[sampled])
    )
    assert chunk["choices"][0]["logprobs"]["text_offset"] == [len(job.prompt_texts[0])]
