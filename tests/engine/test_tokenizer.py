"""The checkpoint tokenizer: demo (SentencePiece-style byte fallback) and Llama-3-style files."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.demo_model import BYTE_TOKENS, CHAT_TEMPLATE, SPECIAL_TOKENS
from engine.tokenizer import Tokenizer, token_bytes, token_string, tokens_bytes

SETTINGS = settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
# Any text without "<", which could spell a special token ("<s>") that encode maps to its id.
TEXT = st.text(
    alphabet=st.characters(exclude_characters="<", exclude_categories=["Cs"]), max_size=30
)


def tokens_of(tok: Tokenizer, ids: Iterable[int]) -> list[str | None]:
    """Vocabulary strings of ``ids`` (None for an id outside the vocabulary)."""
    return [tok.id_to_token(i) for i in ids]


CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there"},
]


def test_demo_ids_and_vocab_size_match_the_model(demo_tok: Tokenizer, test_llama: Path) -> None:
    config = json.loads((test_llama / "config.json").read_text())
    assert demo_tok.vocab_size == config["vocab_size"] == 2048
    # Every id decodes to a vocabulary string: a random model may sample any of them.
    tokens = tokens_of(demo_tok, range(demo_tok.vocab_size))
    assert None not in tokens and len(set(tokens)) == 2048
    assert tokens[:7] == list(SPECIAL_TOKENS) and tokens[7:263] == list(BYTE_TOKENS)
    assert demo_tok.special_token_ids == frozenset(range(7))
    assert demo_tok.byte_token_ids == frozenset(range(7, 263))
    assert demo_tok.bos_token_id == 1
    assert demo_tok.eos_token_ids == frozenset({2, 6})  # </s> and <|end|>


def test_demo_encode_words_bytes_and_bos(demo_tok: Tokenizer) -> None:
    ids = demo_tok.encode("the server 日")
    assert tokens_of(demo_tok, ids) == [
        "<s>", "▁the", "▁server", "▁", "<0xE6>", "<0x97>", "<0xA5>"
    ]  # fmt: skip
    assert demo_tok.encode("the server 日", add_special_tokens=False) == ids[1:]
    assert demo_tok.decode(ids) == "the server 日"
    assert demo_tok.decode(ids, skip_special_tokens=False) == "<s> the server 日"


@SETTINGS
@given(text=TEXT)
def test_demo_roundtrip(demo_tok: Tokenizer, text: str) -> None:
    ids = demo_tok.encode(text)
    # Characters outside the vocabulary survive through byte fallback. Metaspace adds a "▁" to
    # text that lacks one and the decoder strips one space, so a single leading space is lost;
    # a literal "▁" in the text is the word marker, so it decodes as a space (both as with the
    # Llama / Mistral Metaspace tokenizers).
    spaced = text.replace("\u2581", " ")
    assert demo_tok.decode(ids) == (spaced[1:] if spaced.startswith(" ") else spaced)
    assert 0 not in ids  # never <unk>


@SETTINGS
@given(text=TEXT)
def test_byte_level_roundtrip(bl_tok: Tokenizer, text: str) -> None:
    assert bl_tok.decode(bl_tok.encode(text)) == text


def test_byte_level_special_ids(bl_tok: Tokenizer) -> None:
    ids = {t: bl_tok.token_to_id(t) for t in ("<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>")}
    assert bl_tok.bos_token_id == ids["<|begin_of_text|>"]
    # generation_config's list and tokenizer_config's (serialised AddedToken) eos together.
    assert bl_tok.eos_token_ids == frozenset({ids["<|end_of_text|>"], ids["<|eot_id|>"]})
    assert bl_tok.byte_token_ids == frozenset()  # a byte-level BPE has no byte-fallback tokens
    assert bl_tok.special_token_ids == frozenset(range(5))
    assert bl_tok.encode("hi")[0] == ids["<|begin_of_text|>"]


def test_demo_chat_template(demo_tok: Tokenizer) -> None:
    assert demo_tok.chat_template == CHAT_TEMPLATE
    text = demo_tok.apply_chat_template(CHAT)
    assert text == "<|system|>\nBe brief.<|end|>\n<|user|>\nHi there<|end|>\n<|assistant|>\n"
    no_prompt = demo_tok.apply_chat_template(CHAT, add_generation_prompt=False)
    assert no_prompt == "<|system|>\nBe brief.<|end|>\n<|user|>\nHi there<|end|>\n"
    ids = demo_tok.encode_chat(CHAT)
    assert ids[0] == demo_tok.bos_token_id and ids.count(demo_tok.bos_token_id) == 1
    assert ids[1] == demo_tok.token_to_id("<|system|>")
    assert ids[-2:] == [demo_tok.token_to_id("<|assistant|>"), demo_tok.token_to_id("<0x0A>")]
    assert demo_tok.decode(ids, skip_special_tokens=False) == "<s>" + text


def test_byte_level_template_writes_its_own_bos(bl_tok: Tokenizer) -> None:
    text = bl_tok.apply_chat_template(CHAT[1:])
    assert text == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    ids, bos = bl_tok.encode_chat(CHAT[1:]), bl_tok.bos_token_id
    assert bos is not None and ids.count(bos) == 1 and ids[0] == bos


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "robot", "content": "beep"}],  # the template's raise_exception
        [{"content": "no role"}],
        "just a string",
    ],
)
def test_bad_messages_are_value_errors(demo_tok: Tokenizer, messages: object) -> None:
    with pytest.raises(ValueError):
        demo_tok.apply_chat_template(messages)  # type: ignore[arg-type]


def test_template_errors_are_value_errors(test_llama: Path, tmp_path: Path) -> None:
    for name in ("tokenizer.json", "generation_config.json"):
        shutil.copy(test_llama / name, tmp_path / name)
    config = json.loads((test_llama / "tokenizer_config.json").read_text())

    config["chat_template"] = "{% for m in messages %}{{ m.content }"  # unclosed tag
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="chat template failed"):
        Tokenizer(tmp_path).apply_chat_template(CHAT)

    # The sandbox refuses attribute access to Python internals.
    config["chat_template"] = "{{ messages.__class__.__mro__ }}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="chat template failed"):
        Tokenizer(tmp_path).apply_chat_template(CHAT)

    del config["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no chat_template"):
        Tokenizer(tmp_path).apply_chat_template(CHAT)


def test_invalid_unicode_is_a_value_error(demo_tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match="lone surrogate"):
        demo_tok.encode("ok \ud800")


def test_missing_tokenizer_json_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "tokenizer.json")):
        Tokenizer(tmp_path)


def test_ids_outside_the_vocabulary_decode_to_nothing(demo_tok: Tokenizer) -> None:
    ids = demo_tok.encode("the", add_special_tokens=False)
    assert demo_tok.decode([*ids, demo_tok.vocab_size, 10**6]) == "the"
    assert tokens_of(demo_tok, [demo_tok.vocab_size]) == [None]


# -- token bytes -----------------------------------------------------------------------------------


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


@pytest.mark.parametrize("tok_name", ["demo_tok", "bl_tok"])
def test_the_vocabularys_bytes_in_one_batch_are_each_tokens_own(
    request: pytest.FixtureRequest, tok_name: str
) -> None:
    """tokens_bytes decodes the whole vocabulary in one batch (the detokenizer's table): each
    id gets its own bytes, in order, as decoded after the anchor token on its own; an id past
    the vocabulary adds nothing."""
    tok: Tokenizer = request.getfixturevalue(tok_name)
    ids = [*range(tok.vocab_size), tok.vocab_size + 3]
    table = tokens_bytes(tok, ids)
    assert table == [token_bytes(tok, i) for i in ids] and table[-1] == b""
    anchor = min(tok.special_token_ids)
    prefix = tok.decode([anchor], skip_special_tokens=False)
    plain = 0
    for i in range(0, tok.vocab_size, 7):
        text = tok.decode([anchor, i], skip_special_tokens=False).removeprefix(prefix)
        if i in tok.special_token_ids or i in tok.byte_token_ids or "\ufffd" in text:
            continue
        assert table[i] == text.encode(), i
        plain += 1
    assert plain > tok.vocab_size // 14
