"""Streaming text for one request: incremental detokenisation, then stop-string holdback.

Two boundary problems sit between sampled ids and the client (docs/design.md#streaming-text):

1. A character may span several tokens (UTF-8 split over byte-fallback or byte-level tokens),
   and SentencePiece decoders strip the leading space of the whole text. The
   :class:`IncrementalDetokenizer` decodes a small window of recent ids and releases only text
   that later tokens cannot change, so the pieces always add up to ``tokenizer.decode(ids)``.
   For the two decoder families whose text is the concatenation of the tokens' bytes (byte-level
   BPE; Llama's SentencePiece: Replace, ByteFallback, Fuse, Strip) it joins memoised bytes
   instead of calling the tokenizer, while the stream stays valid UTF-8 (a tokenizer call per
   token was most of a 64-sequence step's output cost).
2. A stop string may span several tokens' text. The :class:`StopStringChecker` holds back any
   tail that could still grow into a stop string and cuts the output at the first match.

::

    ids ──> IncrementalDetokenizer ──stable text──> StopStringChecker ──safe text──> client
            (window prefix:read:end)                (held tail <= longest stop - 1)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple
from weakref import WeakKeyDictionary

from engine.tokenizer import Tokenizer, tokens_bytes

_REPLACEMENT = "\ufffd"


class _TokenMemo:
    """Per-tokenizer facts about single ids, computed once for the whole vocabulary (at engine
    load, :func:`prepare`, or on the tokenizer's first stream; one batched decode): the bytes each
    id adds to the text and whether the detokenizer drops it (special, or outside the
    vocabulary); and each id's text on its own, as asked. Every stream of a tokenizer shares
    one memo, so a token costs list lookups, not a tokenizer call."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        ids = range(tokenizer.vocab_size)
        self._bytes = tokens_bytes(tokenizer, ids)
        special = tokenizer.special_token_ids
        self._dropped = [i in special or tokenizer.id_to_token(i) is None for i in ids]
        self._text: dict[int, str] = {}
        # decode(ids) == the ids' bytes joined, decoded (if valid), a leading " " stripped when
        # ``strips_space``: then the detokenizer may join bytes instead of decoding.
        self.joins_bytes, self.strips_space = _joins_bytes(tokenizer)
        # Where bytes join: each id's text when it arrives with nothing pending (None: dropped,
        # a byte token, or bytes that are no whole characters on their own), so the common
        # token is one list lookup (IncrementalDetokenizer.push).
        self.alone: list[str | None] = (
            [self._alone(i) for i in ids] if self.joins_bytes else [None] * len(ids)
        )

    def _alone(self, token_id: int) -> str | None:
        if self._dropped[token_id] or token_id in self._tok.byte_token_ids:
            return None
        try:
            return self._bytes[token_id].decode()
        except UnicodeDecodeError:
            return None

    def piece(self, token_id: int) -> bytes:
        """The bytes a kept id adds to the text (:func:`engine.tokenizer.tokens_bytes`)."""
        return self._bytes[token_id]

    def dropped(self, token_id: int) -> bool:
        return not 0 <= token_id < len(self._dropped) or self._dropped[token_id]

    def decode(self, ids: list[int]) -> str:
        """``tokenizer.decode(ids, skip_special_tokens=False)``, memoised for one id."""
        if len(ids) != 1:
            return self._tok.decode(ids, skip_special_tokens=False)
        text = self._text.get(ids[0])
        if text is None:
            text = self._text[ids[0]] = self._tok.decode(ids, skip_special_tokens=False)
        return text


def _joins_bytes(tokenizer: Tokenizer) -> tuple[bool, bool]:
    """(whether the tokenizer's decode joins its tokens' bytes, whether it then strips one
    leading space): true of a byte-level decoder, and of Llama's SentencePiece sequence --
    given a special token, which :func:`tokens_bytes` decodes a token after to keep its space."""
    decoder = tokenizer.decoder
    if decoder.get("type") == "ByteLevel":
        return True, False
    steps = decoder.get("decoders") if decoder.get("type") == "Sequence" else None
    llama = [
        {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
        {"type": "Strip", "content": " ", "start": 1, "stop": 0},
    ]
    if steps == llama and tokenizer.special_token_ids:
        return True, True
    return False, False


_MEMOS: WeakKeyDictionary[Tokenizer, _TokenMemo] = WeakKeyDictionary()


def prepare(tokenizer: Tokenizer) -> None:
    """Build ``tokenizer``'s token table now (an engine at load), not on its first stream."""
    _memo(tokenizer)


def _memo(tokenizer: Tokenizer) -> _TokenMemo:
    memo = _MEMOS.get(tokenizer)
    if memo is None:
        memo = _MEMOS[tokenizer] = _TokenMemo(tokenizer)
    return memo


class IncrementalDetokenizer:
    """Turns one id at a time into text; O(window) work per id, not a full decode.

    Ids are kept without special tokens (``decode(skip_special_tokens=True)`` drops them before
    decoding, so dropping them on arrival is the same). ``ids[prefix:read]`` is the last text
    already released, decoded again as context; ``ids[read:]`` is pending. Text is released
    when the window's decode no longer ends in U+FFFD (an unfinished UTF-8 sequence) and the
    newest id is not a byte-fallback token: a byte-fallback decoder decodes a whole run of byte
    tokens at once (an invalid run turns *every* byte into U+FFFD), so a run is final only once
    a non-byte token ends it.

    Where the tokenizer's decode joins its tokens' bytes (``_TokenMemo.joins_bytes``), the
    pending ids' memoised bytes are decoded instead, under the same rule (release when they end
    a character and the newest id is no byte token), so the window state stays the one above;
    invalid UTF-8 (where decoders differ: U+FFFD per byte or per sequence) goes to the
    tokenizer's own decode, whose release leaves nothing pending, so joining resumes after it.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._memo = _memo(tokenizer)
        self._strip = self._memo.strips_space  # until the first text: then it is stripped
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0
        self.num_tokens = 0  # ids pushed, special ones included
        self.num_stable_tokens = 0  # leading pushed ids whose text is all released

    def push(self, token_id: int) -> str:
        """Add one sampled id; return the text that became final ("" while held back)."""
        self.num_tokens += 1
        alone = self._memo.alone
        text = alone[token_id] if 0 <= token_id < len(alone) else None
        if text is not None and self._read == len(self._ids) and not self._strip:
            # Nothing pending and whole characters: what _join releases, without the join.
            self._ids.append(token_id)
            self._prefix, self._read = self._read, self._read + 1
            self.num_stable_tokens = self.num_tokens
            return text
        if self._memo.dropped(token_id):
            if self._read == len(self._ids):
                self.num_stable_tokens = self.num_tokens
            return ""
        self._ids.append(token_id)
        if token_id in self._tok.byte_token_ids:
            return ""
        if self._memo.joins_bytes:
            text = self._join()
            if text is not None:
                return text
        text = self._release(final=False)
        if text:
            self._strip = False  # the tokenizer stripped it (its window started the text)
        return text

    def _join(self) -> str | None:
        """The release by joined bytes: the text, "" while a character is unfinished, None
        on invalid UTF-8 (the tokenizer's decode releases it, and past it joining goes on)."""
        ids, piece = self._ids, self._memo.piece
        pending = ids[self._read :]
        data = piece(pending[0]) if len(pending) == 1 else b"".join(map(piece, pending))
        try:
            text = data.decode()
        except UnicodeDecodeError as exc:
            if exc.reason == "unexpected end of data":  # the first error is the end: unfinished
                return ""
            return None
        if self._strip and text:
            self._strip = False
            text = text.removeprefix(" ")
        self._prefix, self._read = self._read, len(ids)
        self.num_stable_tokens = self.num_tokens
        return text

    def flush(self) -> str:
        """Release whatever is held (the request ended): broken UTF-8 comes out as U+FFFD."""
        return self._release(final=True) if self._read < len(self._ids) else ""

    def _release(self, final: bool) -> str:
        window = self._ids[self._prefix :]
        text = self._memo.decode(window)
        if text.endswith(_REPLACEMENT) and not final:
            return ""
        # No byte run or unfinished character crosses ``read``, so the window's text is the text
        # of ids[prefix:read] followed by exactly that of the new ids. A leading space the
        # decoder strips at the window start is stripped from both decodes; only the very first
        # window (prefix == read == 0) starts the output, where the strip is real.
        done = self._memo.decode(window[: self._read - self._prefix])
        self._prefix, self._read = self._read, len(self._ids)
        self.num_stable_tokens = self.num_tokens
        return text[len(done) :]


@dataclass(frozen=True)
class StopMatch:
    stop: str  # the stop string that matched
    text: str  # the last safe text (cut before the stop, or after it when it is included)


class StopStringChecker:
    """Holds back text that could still become a stop string; cuts at the first match.

    The first match is the one whose end comes first in the text (the point at which a reader
    going character by character would stop); of matches ending there, the longest. So the
    output does not depend on how the text was split into pieces.
    """

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        if any(s == "" for s in stop):
            raise ValueError("stop strings must not be empty")
        self._stops = tuple(dict.fromkeys(stop))
        self._include = include_stop_str_in_output
        self._longest = max((len(s) for s in self._stops), default=0)
        self._held = ""
        self.matched: str | None = None
        self.num_released_chars = 0  # input characters released (emitted or cut) so far

    def feed(self, text: str) -> str | StopMatch:
        """Add text; return what is now safe to emit, or a StopMatch (then feed no more)."""
        if self.matched is not None:
            raise RuntimeError(f"stop string {self.matched!r} already matched")
        if not self._stops:  # nothing can match or be held back
            self.num_released_chars += len(text)
            return text
        buf = self._held + text
        best: tuple[tuple[int, int], str] | None = None  # ((end, start), stop)
        for stop in self._stops:
            start = buf.find(stop)  # first occurrence: this stop's earliest end
            if start >= 0 and (best is None or (start + len(stop), start) < best[0]):
                best = ((start + len(stop), start), stop)
        if best is not None:
            (end, start), stop = best
            self.matched = stop
            self._held = ""
            self.num_released_chars += len(buf)
            return StopMatch(stop, buf[: end if self._include else start])
        keep = self._holdback(buf)
        self._held = buf[len(buf) - keep :]
        self.num_released_chars += len(buf) - keep
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """Release the held tail: the text ended, so it can no longer become a stop string."""
        held, self._held = self._held, ""
        self.num_released_chars += len(held)
        return held

    def _holdback(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of a stop string."""
        for n in range(min(len(buf), self._longest - 1), 0, -1):
            tail = buf[-n:]
            if any(s.startswith(tail) for s in self._stops):
                return n
        return 0


class StreamDelta(NamedTuple):
    """One fed id's result (a named tuple: immutable, and built per token at a third of a
    frozen dataclass's cost)."""

    text: str  # new text for the client ("" while held back)
    stop_matched: str | None = None  # set on the step whose token completed a stop string


class TextStream:
    """The per-request object the engine feeds each sampled id.

    Counts (for the terminal record): ``num_tokens`` ids fed; ``num_emitted`` ids whose text has
    fully reached the client; ``num_committed`` ids kept in the output — all of them, or on a
    stop-string match those up to and including the id that completed it.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._detok = IncrementalDetokenizer(tokenizer)
        self._stop = StopStringChecker(stop, include_stop_str_in_output)
        self._plain = not stop  # no stop strings: all stable text is emitted as it comes
        # (characters fed to the stop checker, ids fully detokenised by then), oldest first:
        # once the checker has released that many characters, those ids are fully emitted.
        self._marks: deque[tuple[int, int]] = deque()
        self._chars_fed = 0
        self._finished = False
        self._pieces: list[str] = []
        self.num_emitted = 0

    @property
    def num_tokens(self) -> int:
        return self._detok.num_tokens

    @property
    def num_committed(self) -> int:
        """Ids kept in the output. A stop match ends the stream, so after one this counts the
        ids up to and including the one that completed it; ids sampled later are not committed."""
        return self.num_tokens

    @property
    def stop_matched(self) -> str | None:
        return self._stop.matched

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._pieces)

    def step(self, token_id: int) -> StreamDelta:
        """Feed one sampled id. Raises RuntimeError after a stop match or ``finish``."""
        if self._finished or self._stop.matched is not None:
            raise RuntimeError("stream already ended")
        delta = self._feed(self._detok.push(token_id))
        return StreamDelta(delta, self._stop.matched)

    def finish(self) -> str:
        """The request ended: release held text (cut at a stop string it completes).
        Calling it again, or after a stop match, returns ""."""
        if self._finished or self._stop.matched is not None:
            self._finished = True
            return ""
        self._finished = True
        out = self._feed(self._detok.flush())
        if self._stop.matched is None:
            tail = self._stop.flush()
            self._pieces.append(tail)
            out += tail
        self.num_emitted = self.num_tokens
        return out

    def _feed(self, text: str) -> str:
        if self._plain:  # what the marks below come to when the checker holds nothing back
            self.num_emitted = self._detok.num_stable_tokens
            self._pieces.append(text)
            return text
        self._chars_fed += len(text)
        stable = self._detok.num_stable_tokens
        if stable > (self._marks[-1][1] if self._marks else self.num_emitted):
            self._marks.append((self._chars_fed, stable))
        result = self._stop.feed(text) if text else ""
        if isinstance(result, StopMatch):
            self.num_emitted = self.num_tokens
            self._marks.clear()
            result = result.text
        while self._marks and self._marks[0][0] <= self._stop.num_released_chars:
            self.num_emitted = self._marks.popleft()[1]
        self._pieces.append(result)
        return result
