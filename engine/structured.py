"""Structured outputs (docs/design.md#structured-outputs): a request's output held to a grammar
-- a JSON schema, a regex, a choice of strings or a Lark/GBNF grammar -- by masking, at every
step, the tokens that cannot continue a match. llguidance (the grammar engine) computes the masks.

A constraint is one field of the request (``SamplingParams.constraint``), so it travels with every
attempt. Its matcher is never shipped: it is a pure function of the grammar and the token ids
emitted so far, so a state is rebuilt by replaying those ids -- a prefill worker masks the first
token, the decode worker replays it; a migrated request replays its output, and the grammar
continues where it was, never restarted at the root.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import llguidance
import numpy as np
from numpy.typing import NDArray

from engine.config import ModelConfig
from engine.sampling_params import Constraint
from engine.tokenizer import Tokenizer

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

GRAMMARS_CACHED = 256  # compiled grammars kept per engine (by constraint)
# How a JSON output is written: on one line, items and keys separated as Python's json.dumps
# does. llguidance's default allows any whitespace between tokens, and a small model sampling
# at T > 0 can spend its whole budget on newlines; a schema's own "x-guidance" options win.
JSON_STYLE: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


class InvalidConstraint(ValueError):
    """A schema, regex or grammar the grammar engine cannot use; the message says why."""


def compile_grammar(constraint: Constraint, tokenizer: llguidance.LLTokenizer | None = None) -> str:
    """The llguidance grammar of ``constraint``, checked (against ``tokenizer`` when given:
    an engine's; without one, as the HTTP edge checks a request); InvalidConstraint when it
    cannot be used."""
    try:
        if constraint.kind == "json_schema":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                constraint.spec, defaults=JSON_STYLE
            )
        else:
            grammar = llguidance.grammar_from(constraint.kind, constraint.spec)
    except ValueError as e:
        raise InvalidConstraint(f"invalid {constraint.kind}: {e}") from None
    error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
    if error:
        raise InvalidConstraint(f"invalid {constraint.kind}: {error}")
    return grammar


class Grammars:
    """One engine's grammar side: the tokenizer as llguidance sees it (built at the first use,
    ~0.35 s for SmolLM2's 49k tokens) and, cached by constraint, each grammar compiled into a
    fresh matcher that a request's state copies (5 us; a new matcher re-parses: ~1.2 ms)."""

    def __init__(self, tokenizer: Tokenizer, model: ModelConfig) -> None:
        self.vocab_size = model.vocab_size  # the logits' width
        self._tokenizer_json = tokenizer.json
        # The one EOS a finished grammar allows: the model's first, else the tokenizer's.
        self._eos = next(iter([*model.eos_token_ids, *sorted(tokenizer.eos_token_ids)]), None)
        self.compile = functools.lru_cache(maxsize=GRAMMARS_CACHED)(self._compile)

    @functools.cached_property
    def tokenizer(self) -> llguidance.LLTokenizer:
        return llguidance.LLTokenizer(
            self._tokenizer_json, n_vocab=self.vocab_size, eos_token=self._eos
        )

    def _compile(self, constraint: Constraint) -> llguidance.LLMatcher:
        return llguidance.LLMatcher(self.tokenizer, compile_grammar(constraint, self.tokenizer))

    def state(self, constraint: Constraint) -> GrammarState:
        """A matcher at the grammar's start for one sequence (InvalidConstraint when the
        grammar cannot be used)."""
        return GrammarState(self.compile(constraint).deep_copy())


class GrammarState:
    """One sequence's matcher, kept in step with its output ids: tokens new since the last step
    are consumed; an output that shrank (a rollback) is replayed from the start."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher
        self.consumed = 0

    def sync(self, output: Sequence[int]) -> None:
        """Consume what ``output`` gained since the last call; raises RuntimeError when a token
        breaks the grammar (only a bug can: every sampled token was allowed)."""
        if len(output) < self.consumed:
            self.matcher.reset()
            self.consumed = 0
        if len(output) > self.consumed:
            self.matcher.consume_tokens(list(output[self.consumed :]))
            self.consumed = len(output)
        if self.matcher.is_error():
            raise RuntimeError(f"grammar state: {self.matcher.get_error()}")


def token_bitmask(states: Sequence[GrammarState], vocab_size: int) -> NDArray[np.int32]:
    """Row i: the tokens ``states[i]`` allows next, one bit per token (bit t % 32 of word
    t // 32, 1 = allowed) [len(states), ceil(vocab_size / 32)]. The masks are computed together
    by llguidance's thread pool (the GIL released)."""
    words = (vocab_size + 31) // 32
    bitmask = np.zeros((len(states), words), dtype=np.int32)
    rows = [(state.matcher, i) for i, state in enumerate(states)]
    _executor().unsafe_compute_mask_ptr(rows, bitmask.ctypes.data, words * 4, len(states))
    return bitmask


def allowed_tokens(bitmask: NDArray[np.int32], vocab_size: int) -> NDArray[np.bool_]:
    """``bitmask`` (:func:`token_bitmask`) unpacked: bools [rows, vocab_size]."""
    bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")
    return bits[:, :vocab_size].view(np.bool_)


@functools.cache
def _executor() -> llguidance.LLExecutor:
    """llguidance's mask thread pool, one per process (made at the first mask)."""
    return llguidance.LLExecutor()
