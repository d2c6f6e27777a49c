"""SamplingParams validation: bad values are a named error that names the field and the value."""

from __future__ import annotations

import pytest

from engine.sampling_params import InvalidSamplingParams, SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"n": 0}, "n=0"),
        ({"max_tokens": 0}, "max_tokens=0"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens=5"),
        ({"temperature": -0.1}, "temperature=-0.1"),
        ({"temperature": float("nan")}, "temperature=nan"),
        ({"top_k": -1}, "top_k=-1"),
        ({"top_p": 0.0}, "top_p=0.0"),
        ({"top_p": 1.5}, "top_p=1.5"),
        ({"min_p": 1.1}, "min_p=1.1"),
        ({"typical_p": 0.0}, "typical_p=0.0"),
        ({"repetition_penalty": 0.0}, "repetition_penalty=0.0"),
        ({"frequency_penalty": 2.5}, "frequency_penalty=2.5"),
        ({"presence_penalty": -3.0}, "presence_penalty=-3.0"),
        ({"seed": 2**63}, f"seed={2**63}"),
        ({"seed": -(2**63) - 1}, "seed=-"),
        ({"choice": -1}, "choice=-1"),
        ({"no_repeat_ngram_size": -1}, "no_repeat_ngram_size=-1"),
        ({"logprobs": 21}, "logprobs=21"),
        ({"prompt_logprobs": -1}, "prompt_logprobs=-1"),
        ({"prompt_logprobs": 21}, "prompt_logprobs=21"),
        ({"allowed_token_ids": []}, "allowed_token_ids=()"),
        ({"bad_words_ids": [[]]}, "bad_words_ids"),
        ({"stop": ["ok", ""]}, "stop="),
        ({"stop_token_ids": [-1]}, "token id -1"),
        ({"allowed_token_ids": [3, 4], "bad_words_ids": [[3], [4], [5, 6]]}, "every allowed"),
    ],
)
def test_out_of_range_values_are_named(kwargs: dict, needle: str) -> None:
    with pytest.raises(InvalidSamplingParams) as e:
        SamplingParams(**kwargs)
    assert needle in str(e.value)


def test_vocabulary_checks() -> None:
    SamplingParams(stop_token_ids=[9], logit_bias={9: 1.0}).validate_vocab(10)
    for kw in ({"stop_token_ids": [10]}, {"logit_bias": {10: 1.0}}, {"bad_words_ids": [[1, 10]]}):
        with pytest.raises(InvalidSamplingParams, match="token id 10"):
            SamplingParams(**kw).validate_vocab(10)  # type: ignore[arg-type]
    with pytest.raises(InvalidSamplingParams, match="top_k=11"):
        SamplingParams(top_k=11).validate_vocab(10)


def test_lists_normalised_and_greedy_flag() -> None:
    p = SamplingParams(stop="x", stop_token_ids=[1], bad_words_ids=[[2, 3]], temperature=0.0)
    assert p.stop == ("x",) and p.stop_token_ids == (1,) and p.bad_words_ids == ((2, 3),)
    assert p.greedy and not SamplingParams().greedy
    # A partially banned allowed set is fine: only a total contradiction is refused.
    SamplingParams(allowed_token_ids=[3, 4], bad_words_ids=[[3]])
