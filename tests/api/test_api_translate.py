"""A body's translation for the cluster: requests translate into exact SamplingParams (one per
choice, one seed per request), prompts into token ids through the tokenizer and its chat
template, and whatever a body holds either makes it through or is an APIError(400) naming the
field."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers import VOCAB, chat_body, completion_body, params
from hypothesis import given, settings
from hypothesis import strategies as st

from api import translate
from api.errors import APIError
from api.gate import GateConfig
from api.protocol import ChatCompletionRequest, CompletionRequest, parse_chat, parse_completion
from api.translate import (
    Translator,
    chat_prompt,
    check_model,
    choice_params,
    completion_prompts,
    sampling_params,
)
from engine.sampling_params import InvalidSamplingParams, SamplingParams
from engine.tokenizer import Tokenizer


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


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_p": 0.0}, "top_p"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),  # messages without "field=" too
        ({"logit_bias": {-3: 1.0}}, "logit_bias"),
        ({"allowed_token_ids": [4, -1]}, "allowed_token_ids"),
    ],
)
def test_the_engine_names_the_field_it_refuses(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidSamplingParams) as e:
        SamplingParams(**kwargs)
    assert e.value.field == field


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"stop_token_ids": [VOCAB]}, "stop_token_ids"),
        ({"logit_bias": {VOCAB: 1.0}}, "logit_bias"),
        ({"allowed_token_ids": [VOCAB]}, "allowed_token_ids"),
        ({"bad_words_ids": [[1, VOCAB]]}, "bad_words_ids"),
        ({"top_k": VOCAB + 1}, "top_k"),
    ],
)
def test_the_engine_names_the_field_outside_the_vocabulary(
    kwargs: dict[str, Any], field: str
) -> None:
    with pytest.raises(InvalidSamplingParams) as e:
        SamplingParams(**kwargs).validate_vocab(VOCAB)
    assert e.value.field == field


def test_an_engine_refusal_is_a_400_naming_its_field(monkeypatch: pytest.MonkeyPatch) -> None:
    """The 400's ``param`` is the engine's ``field``, whatever its message says."""

    def refuse(**kwargs: Any) -> SamplingParams:
        raise InvalidSamplingParams("min_p", "a message that names no field")

    monkeypatch.setattr(translate, "SamplingParams", refuse)
    with pytest.raises(APIError) as e:
        params(parse_completion(completion_body()))
    assert (e.value.status, e.value.param) == (400, "min_p")
    assert e.value.message == "a message that names no field"


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
    translator: Translator, seed: int | None
) -> None:
    """The seed asked for, else one drawn per request: every choice carries it with its own
    choice index, and the response reports it. Two unseeded requests draw different seeds."""

    def parse() -> Any:
        body = completion_body(prompt=["a", "b"], n=2, seed=seed)
        return translator.job("cmpl-1", body, "completion", "tenant", 0.0, {})

    job = parse()
    drawn = job.meta.seed
    assert drawn is not None and (seed is None or drawn == seed)
    assert [(p.seed, p.choice) for p in job.params] == [(drawn, 0), (drawn, 1)] * 2
    assert (parse().meta.seed != drawn) == (seed is None)


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


@pytest.fixture
def translator(demo_tok: Tokenizer) -> Translator:
    return Translator(demo_tok, "demo", 512, demo_tok.vocab_size, GateConfig().max_choices, None)
