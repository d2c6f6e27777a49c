"""Incremental detokenisation and stop strings (docs/design.md#streaming-text)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import detokenizer
from engine.detokenizer import (
    IncrementalDetokenizer,
    StopMatch,
    StopStringChecker,
    StreamDelta,
    TextStream,
)
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer, token_bytes

SETTINGS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def stream_pieces(tok: Tokenizer, ids: Sequence[int]) -> tuple[list[str], str]:
    """Feed ids one by one; return the per-id pieces and the final flush."""
    detok = IncrementalDetokenizer(tok)
    return [detok.push(i) for i in ids], detok.flush()


def byte_ids(tok: Tokenizer, data: bytes) -> list[int]:
    ids = [tok.token_to_id(f"<0x{b:02X}>") for b in data]
    assert all(i is not None for i in ids)
    return [i for i in ids if i is not None]


class CountingDecodes(Tokenizer):
    """A tokenizer counting its decode calls and the longest one."""

    calls = 0
    longest = 0

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.calls += 1
        self.longest = max(self.longest, len(ids))
        return super().decode(ids, skip_special_tokens)


# --- the stop-string example of docs/design.md#streaming-text
# -------------------------------------------------------


def test_d03_stop_split_across_three_chunks_is_detected() -> None:
    checker = StopStringChecker(["STOP"])
    assert checker.feed("abcS") == "abc"  # "S" could start "STOP": held
    assert checker.feed("TO") == ""  # "STO" still could
    assert checker.feed("Pxyz") == StopMatch("STOP", "")  # cut before the stop string
    assert checker.matched == "STOP"
    with pytest.raises(RuntimeError):
        checker.feed("more")


def test_d03_no_match_is_fully_recovered_by_flush() -> None:
    checker = StopStringChecker(["STOP"])
    emitted = [checker.feed("abcS"), checker.feed("TO")]
    assert emitted == ["abc", ""]
    assert checker.flush() == "STO"
    assert checker.matched is None


def test_include_stop_str_in_output() -> None:
    checker = StopStringChecker(["STOP"], include_stop_str_in_output=True)
    assert checker.feed("abcST") == "abc"
    assert checker.feed("OPxyz") == StopMatch("STOP", "STOP")


def test_first_match_is_the_earliest_end_then_the_longest() -> None:
    # "bc" ends (at 3) before "abcd" (at 4), whatever the chunking.
    assert StopStringChecker(["abcd", "bc"]).feed("abcd") == StopMatch("bc", "a")
    # Both end at 3: the longer one wins, so less text leaks.
    assert StopStringChecker(["c", "abc"]).feed("xabc") == StopMatch("abc", "x")


def reference_stop(text: str, stops: Sequence[str], include: bool) -> tuple[str | None, str]:
    """Read character by character; stop at the first position where a stop string ends."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if text[:end].endswith(s)]
        if ending:
            stop = max(ending, key=len)
            return stop, text[:end] if include else text[: end - len(stop)]
    return None, text


def split_at(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted(c % (len(text) + 1) for c in cuts), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


@SETTINGS
@given(
    text=st.text(alphabet="abST", max_size=40),
    stops=st.lists(st.text(alphabet="abST", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(0, 100), max_size=12),
    include=st.booleans(),
)
def test_stop_checker_matches_reference_and_never_leaks(
    text: str, stops: list[str], cuts: list[int], include: bool
) -> None:
    ref_stop, ref_out = reference_stop(text, stops, include)
    checker = StopStringChecker(stops, include)
    emitted = ""
    for piece in split_at(text, cuts):
        result = checker.feed(piece)
        if isinstance(result, StopMatch):
            assert result.stop == ref_stop
            emitted += result.text
            break
        emitted += result
        # Nothing that a later stop string cuts off has been emitted.
        assert ref_out.startswith(emitted)
    else:
        assert ref_stop is None
        emitted += checker.flush()
    assert emitted == ref_out


# --- incremental detokenisation ---------------------------------------------------------------


def test_multibyte_char_over_byte_tokens_is_held_until_the_run_ends(demo_tok: Tokenizer) -> None:
    euro = byte_ids(demo_tok, "€".encode())  # 3 byte-fallback tokens
    word = demo_tok.encode(" the", add_special_tokens=False)
    assert [demo_tok.id_to_token(i) for i in word] == ["▁the"]
    pieces, tail = stream_pieces(demo_tok, [*euro, *word])
    assert pieces == ["", "", "", "€ the"]
    assert tail == ""


def test_special_token_inside_a_byte_run_is_skipped(demo_tok: Tokenizer) -> None:
    e2, x82, xac = byte_ids(demo_tok, "€".encode())
    eos = demo_tok.token_to_id("</s>")
    assert eos is not None
    ids = [e2, eos, x82, xac, *demo_tok.encode(" a", add_special_tokens=False)]
    pieces, tail = stream_pieces(demo_tok, ids)
    assert "".join(pieces) + tail == demo_tok.decode(ids) == "€ a"


def test_invalid_byte_run_decodes_like_the_tokenizer(demo_tok: Tokenizer) -> None:
    # The byte-fallback decoder turns every byte of an invalid run into U+FFFD, even the valid
    # "A": releasing "A" early would have been wrong.
    ids = [*byte_ids(demo_tok, b"A\xe2"), *demo_tok.encode(" the", add_special_tokens=False)]
    pieces, tail = stream_pieces(demo_tok, ids)
    assert pieces == ["", "", "\ufffd\ufffd the"]
    assert demo_tok.decode(ids) == "\ufffd\ufffd the"
    # At the end of the stream a broken run comes out through flush.
    pieces, tail = stream_pieces(demo_tok, byte_ids(demo_tok, b"\xe2\x82"))
    assert pieces == ["", ""] and tail == "\ufffd\ufffd"


def test_leading_space_is_stripped_once(demo_tok: Tokenizer) -> None:
    ids = demo_tok.encode("the server must wait", add_special_tokens=False)
    assert [demo_tok.id_to_token(i) for i in ids] == ["▁the", "▁server", "▁must", "▁wait"]
    pieces, tail = stream_pieces(demo_tok, ids)
    assert pieces == ["the", " server", " must", " wait"] and tail == ""


@pytest.mark.parametrize("joined", [True, False])
def test_byte_level_multibyte_char_is_held(
    joined: bool, byte_level_tokenizer_dir: Path, unjoined_bl_dir: Path
) -> None:
    tok = CountingDecodes(byte_level_tokenizer_dir if joined else unjoined_bl_dir)
    ids = tok.encode("🙂", add_special_tokens=False)
    assert len(ids) >= 2  # the emoji spans several byte-level tokens
    stream_pieces(tok, ids)  # memoises the ids' bytes
    tok.calls = 0
    pieces, tail = stream_pieces(tok, ids)
    assert (tok.calls == 0) is joined  # the path under test is the one taken
    assert pieces == [""] * (len(ids) - 1) + ["🙂"] and tail == ""


@pytest.fixture(scope="module")
def unjoined_dir(test_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo tokenizer with a decoder outside the two joined shapes (its Strip takes two
    leading spaces): the detokenizer decodes windows through it."""
    spec = json.loads((test_llama / "tokenizer.json").read_text())
    spec["decoder"]["decoders"][-1]["start"] = 2
    path = tmp_path_factory.mktemp("unjoined")
    (path / "tokenizer.json").write_text(json.dumps(spec))
    return path


@pytest.fixture(scope="module")
def unjoined_bl_dir(
    byte_level_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """The byte-level tokenizer with its decoder wrapped in a Sequence (the same text, not the
    joined shape): its partial characters go through the windows' U+FFFD hold."""
    spec = json.loads((byte_level_tokenizer_dir / "tokenizer.json").read_text())
    spec["decoder"] = {"type": "Sequence", "decoders": [spec["decoder"]]}
    path = tmp_path_factory.mktemp("unjoined_bl")
    (path / "tokenizer.json").write_text(json.dumps(spec))
    return path


def test_window_stays_small(unjoined_dir: Path) -> None:
    """Each id costs a decode of a few ids, not of the whole output."""
    tok = CountingDecodes(unjoined_dir)
    text = "Bees visit flowers, carry pollen from one to the next, and make honey. " * 20
    ids = tok.encode(text, add_special_tokens=False)
    pieces, tail = stream_pieces(tok, ids)
    assert "".join(pieces) + tail == text
    assert len(ids) > 250 and tok.calls >= len(ids) and tok.longest <= 2


@pytest.mark.parametrize("family", ["byte_fallback", "byte_level"])
def test_known_decoders_join_bytes_without_calling_the_tokenizer(
    family: str, test_llama: Path, byte_level_tokenizer_dir: Path
) -> None:
    """The token table is built once, at load (detokenizer.prepare): from the first stream on,
    joining calls no decode."""
    tok = CountingDecodes(test_llama if family == "byte_fallback" else byte_level_tokenizer_dir)
    text = "Bees visit flowers; the 🙂 stays, and € too. " * 3
    ids = tok.encode(text, add_special_tokens=False)
    detokenizer.prepare(tok)
    tok.calls = 0
    pieces, tail = stream_pieces(tok, ids)
    assert "".join(pieces) + tail == text
    assert tok.calls == 0


def test_other_decoders_keep_the_tokenizers_decode(unjoined_dir: Path) -> None:
    """A decoder outside the two known shapes (here: a Strip of two leading spaces) is never
    joined: joining would strip one space where it strips two."""
    tok = CountingDecodes(unjoined_dir)
    ids = tok.encode("  two spaces lead", add_special_tokens=False)
    full = tok.decode(ids)
    assert not full.startswith(" ")
    stream_pieces(tok, ids)
    tok.calls = 0
    pieces, tail = stream_pieces(tok, ids)
    assert "".join(pieces) + tail == full and tok.calls > 0


def test_joining_resumes_after_invalid_utf8(
    test_llama: Path, byte_level_tokenizer_dir: Path
) -> None:
    """Invalid UTF-8 goes to the tokenizer's decode (each decoder has its own U+FFFD rule);
    the text after it is joined again: a couple of tokenizer calls, not one per token."""
    bl, sp = CountingDecodes(byte_level_tokenizer_dir), CountingDecodes(test_llama)
    lead = next(i for i in range(bl.vocab_size) if token_bytes(bl, i) == b"\xe6")
    words = " three four five six seven eight nine ten"
    # Byte fallback turns every byte of an invalid run into U+FFFD, the valid "A" too.
    cases = ((bl, [lead], "\ufffd"), (sp, byte_ids(sp, b"A\xe2"), "\ufffd\ufffd"))
    for tok, bad_ids, replaced in cases:
        ids = [*tok.encode("one two", add_special_tokens=False), *bad_ids]
        ids += tok.encode(words, add_special_tokens=False)
        stream_pieces(tok, ids)
        tok.calls = 0
        pieces, tail = stream_pieces(tok, ids)
        assert tok.calls <= 2  # the release of the invalid bytes (window, context): not per token
        assert "".join(pieces) + tail == tok.decode(ids) == "one two" + replaced + words


def id_sequences(tok: Tokenizer, byte_fallback: bool) -> st.SearchStrategy[list[int]]:
    """Ids mixing text, specials, any vocab id, and (with byte fallback) byte runs that form
    valid multi-byte characters or broken UTF-8."""
    specials = sorted(tok.special_token_ids)
    chunks = [
        st.text(max_size=4).map(lambda s: tok.encode(s, add_special_tokens=False)),
        st.sampled_from(specials).map(lambda i: [i]),
        st.integers(0, tok.vocab_size - 1).map(lambda i: [i]),
    ]
    if byte_fallback:
        chunks += [
            st.text(min_size=1, max_size=2).map(lambda s: byte_ids(tok, s.encode())),
            st.binary(min_size=1, max_size=3).map(lambda b: byte_ids(tok, b)),
        ]
    return st.lists(st.one_of(chunks), max_size=10).map(lambda cs: [i for c in cs for i in c])


def check_pieces(tok: Tokenizer, ids: list[int]) -> None:
    full = tok.decode(ids)
    detok = IncrementalDetokenizer(tok)
    emitted = ""
    for i in ids:
        emitted += detok.push(i)
        assert full.startswith(emitted)  # never a premature U+FFFD or a wrong space
    assert emitted + detok.flush() == full


@SETTINGS
@given(data=st.data())
def test_pieces_concatenate_to_decode_byte_fallback(
    demo_tok: Tokenizer, data: st.DataObject
) -> None:
    check_pieces(demo_tok, data.draw(id_sequences(demo_tok, byte_fallback=True)))


@SETTINGS
@given(data=st.data(), byte_level=st.booleans())
def test_pieces_concatenate_to_decode_by_windows(
    unjoined_dir: Path, unjoined_bl_dir: Path, data: st.DataObject, byte_level: bool
) -> None:
    tok = Tokenizer(unjoined_bl_dir if byte_level else unjoined_dir)
    check_pieces(tok, data.draw(id_sequences(tok, byte_fallback=not byte_level)))


@SETTINGS
@given(data=st.data())
def test_pieces_concatenate_to_decode_byte_level(bl_tok: Tokenizer, data: st.DataObject) -> None:
    check_pieces(bl_tok, data.draw(id_sequences(bl_tok, byte_fallback=False)))


# --- the per-request stream -------------------------------------------------------------------


def test_stream_stops_at_stop_string_and_counts_tokens(demo_tok: Tokenizer) -> None:
    params = SamplingParams(stop=("must",))
    ids = demo_tok.encode("the server must wait", add_special_tokens=False)
    stream = TextStream(demo_tok, params.stop, params.include_stop_str_in_output)
    assert stream.step(ids[0]) == StreamDelta("the", None)
    assert (stream.num_emitted, stream.num_committed) == (1, 1)
    delta = stream.step(ids[1])
    assert (delta.text, delta.stop_matched) == (" server", None)
    delta = stream.step(ids[2])  # "▁must" completes the stop string
    assert (delta.text, delta.stop_matched) == (" ", "must")
    assert stream.text == "the server "
    assert (stream.num_tokens, stream.num_committed, stream.num_emitted) == (3, 3, 3)
    with pytest.raises(RuntimeError):
        stream.step(ids[3])
    assert stream.finish() == ""


def test_stream_holds_possible_stop_prefix_and_num_emitted_lags(demo_tok: Tokenizer) -> None:
    ids = demo_tok.encode("the server must wait", add_special_tokens=False)
    stream = TextStream(demo_tok, stop=("server!",))
    texts = [stream.step(i).text for i in ids[:2]]
    assert texts == ["the", " "]  # "server" could still become "server!"
    assert stream.num_emitted == 1  # "▁server"'s text is not all out
    assert stream.step(ids[2]).text == "server must"
    assert stream.num_emitted == 3
    assert stream.step(ids[3]).text == " wait"
    assert stream.finish() == ""
    assert stream.text == "the server must wait"
    assert stream.stop_matched is None and stream.num_emitted == stream.num_committed == 4


@SETTINGS
@given(data=st.data(), byte_level=st.booleans())
def test_a_stream_without_stop_strings_reports_what_the_checker_would(
    demo_tok: Tokenizer, bl_tok: Tokenizer, data: st.DataObject, byte_level: bool
) -> None:
    """The plain stream's short path (no stop strings) against the full one: a stop string no
    text can contain (a lone surrogate) holds nothing back, so every delta and every
    ``num_emitted`` must agree, through ``finish``."""
    tok = bl_tok if byte_level else demo_tok
    ids = data.draw(id_sequences(tok, byte_fallback=not byte_level))
    plain, checked = TextStream(tok), TextStream(tok, stop=("\ud800",))
    for i in ids:
        assert plain.step(i) == checked.step(i)
        assert plain.num_emitted == checked.num_emitted
    assert plain.finish() == checked.finish()
    assert (plain.num_emitted, plain.text) == (checked.num_emitted, checked.text)


def test_stream_finish_flushes_held_text_and_bytes(demo_tok: Tokenizer) -> None:
    ids = [*demo_tok.encode("the", add_special_tokens=False), *byte_ids(demo_tok, "€".encode())]
    stream = TextStream(demo_tok, stop=("€!",))
    assert [stream.step(i).text for i in ids] == ["the", "", "", ""]
    assert stream.num_emitted == 1
    assert stream.finish() == "€"
    assert stream.num_emitted == 4 and stream.stop_matched is None


@SETTINGS
@given(data=st.data(), include=st.booleans())
def test_stream_matches_reference(demo_tok: Tokenizer, data: st.DataObject, include: bool) -> None:
    ids = data.draw(id_sequences(demo_tok, byte_fallback=True))
    full = demo_tok.decode(ids)
    # Stop strings that often occur: substrings of the text itself, plus a random one.
    subs = st.tuples(st.integers(0, len(full)), st.integers(1, 4)).map(
        lambda t: full[t[0] : t[0] + t[1]]
    )
    stops = data.draw(st.lists(st.one_of(subs, st.text(min_size=1, max_size=3)), max_size=3))
    stops = [s for s in stops if s]
    ref_stop, ref_out = reference_stop(full, stops, include)

    stream = TextStream(demo_tok, stops, include)
    emitted, emitted_ids = "", 0
    for i in ids:
        delta = stream.step(i)
        emitted += delta.text
        assert ref_out.startswith(emitted)
        assert emitted_ids <= stream.num_emitted <= stream.num_tokens
        emitted_ids = stream.num_emitted
        if delta.stop_matched is not None:
            break
        assert emitted.startswith(demo_tok.decode(ids[:emitted_ids]))  # their text really is out
    emitted += stream.finish()
    assert emitted == ref_out == stream.text
    assert stream.stop_matched == ref_stop
    assert stream.num_emitted == stream.num_committed == stream.num_tokens
    if ref_stop is not None:  # the committed ids' text reaches past the stop string
        stop_end = len(ref_out) if include else len(ref_out) + len(ref_stop)
        assert len(demo_tok.decode(ids[: stream.num_committed])) >= stop_end
