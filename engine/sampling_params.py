"""Per-request sampling parameters (docs/design.md#sampling) — one validated, immutable object.

Penalty conventions (declared here, as docs/design.md#sampling-order asks):
- ``repetition_penalty`` applies to every token seen so far, prompt *and* output (HF convention);
- ``frequency_penalty`` / ``presence_penalty`` count output tokens only (OpenAI convention).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal, get_args


class InvalidSamplingParams(ValueError):
    """A sampling parameter is out of range. ``field`` is the parameter's name (an API maps it to
    its own field without reading the message); the message names the field and the value."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


# What a constraint's ``spec`` is (docs/design.md#structured-outputs): a JSON schema's text, a
# regex, a JSON list of strings, or a Lark / GBNF grammar.
ConstraintKind = Literal["json_schema", "regex", "choice", "grammar"]
CONSTRAINT_KINDS: tuple[ConstraintKind, ...] = get_args(ConstraintKind)


@dataclass(frozen=True)
class Constraint:
    """What a request's output must match: ``kind`` and its text. Compiled, and checked, by the
    engine's grammar side (engine/structured.py)."""

    kind: ConstraintKind
    spec: str

    def __post_init__(self) -> None:
        if self.kind not in CONSTRAINT_KINDS:
            raise InvalidSamplingParams(
                "constraint", f"constraint kind {self.kind!r}: one of {', '.join(CONSTRAINT_KINDS)}"
            )

    @classmethod
    def json_object(cls) -> Constraint:
        """Any JSON object (OpenAI's ``response_format: {"type": "json_object"}``)."""
        return cls("json_schema", '{"type": "object"}')

    @classmethod
    def choice(cls, options: Sequence[str]) -> Constraint:
        return cls("choice", json.dumps(list(options)))


@dataclass(frozen=True)
class SamplingParams:
    """What a request asks of the sampler and of the stop checker.

    Disabled values: ``top_k <= 0``, ``top_p == 1``, ``min_p == 0``, ``typical_p == 1``,
    ``repetition_penalty == 1``, penalties ``== 0``. ``temperature == 0`` is greedy (its own
    branch; the lowest token id wins a tie).
    """

    n: int = 1
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    typical_p: float = 1.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    no_repeat_ngram_size: int = 0
    seed: int | None = None  # None: the request draws one at arrival (design.md#sampling-seeds)
    choice: int = 0  # the first sample's stream of ``seed``; sample j of n draws choice + j
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    # Logprobs of every prompt token (the first has none) with this many alternatives: the
    # whole prompt is computed, never taken from the prefix cache (docs/design.md#logprobs).
    prompt_logprobs: int | None = None
    # The grammar the output must match (structured outputs); None: free text.
    constraint: Constraint | None = None

    def __post_init__(self) -> None:
        # Normalise list inputs so the object stays hashable-ish and immutable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "bad_words_ids", tuple(tuple(w) for w in self.bad_words_ids))
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        object.__setattr__(
            self, "logit_bias", {int(k): float(v) for k, v in self.logit_bias.items()}
        )
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, why: str) -> InvalidSamplingParams:
            return InvalidSamplingParams(name, f"{name}={getattr(self, name)!r}: {why}")

        if self.n < 1:
            raise bad("n", "must be >= 1")
        if self.max_tokens < 1:
            raise bad("max_tokens", "must be >= 1")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise bad("min_tokens", "must be in [0, max_tokens]")
        if not self.temperature >= 0.0 or self.temperature != self.temperature:
            raise bad("temperature", "must be >= 0")
        if self.top_k < 0:
            raise bad("top_k", "must be >= 0 (0 disables)")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if not 0.0 < self.typical_p <= 1.0:
            raise bad("typical_p", "must be in (0, 1]")
        if not self.repetition_penalty > 0.0:
            raise bad("repetition_penalty", "must be > 0")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            raise bad("seed", "must fit a signed 64-bit integer")
        if self.choice < 0:
            raise bad("choice", "must be >= 0")
        if self.no_repeat_ngram_size < 0:
            raise bad("no_repeat_ngram_size", "must be >= 0")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise bad("logprobs", "must be in [0, 20]")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise bad("prompt_logprobs", "must be in [0, 20]")
        if self.allowed_token_ids is not None and len(self.allowed_token_ids) == 0:
            raise bad("allowed_token_ids", "must not be empty")
        if any(len(w) == 0 for w in self.bad_words_ids):
            raise bad("bad_words_ids", "sequences must not be empty")
        banned = {w[0] for w in self.bad_words_ids if len(w) == 1}
        if self.allowed_token_ids is not None and set(self.allowed_token_ids) <= banned:
            raise bad("allowed_token_ids", "every allowed token is also a banned word")
        if any(s == "" for s in self.stop):
            raise bad("stop", "stop strings must not be empty")
        for name, ids in self._token_id_fields():
            for tid in ids:
                if tid < 0:
                    raise InvalidSamplingParams(name, f"token id {tid} is negative")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate_vocab(self, vocab_size: int) -> None:
        """Raise InvalidSamplingParams if a token id falls outside the model's vocabulary."""
        words = ("bad_words_ids", [t for w in self.bad_words_ids for t in w])
        for name, ids in (*self._token_id_fields(), words):
            for tid in ids:
                if tid >= vocab_size:
                    raise InvalidSamplingParams(
                        name, f"token id {tid} is outside the vocabulary (size {vocab_size})"
                    )
        if self.top_k > vocab_size:
            raise InvalidSamplingParams(
                "top_k", f"top_k={self.top_k}: larger than the vocabulary ({vocab_size})"
            )

    def _token_id_fields(self) -> tuple[tuple[str, Iterable[int]], ...]:
        """The fields that hold single token ids, by name."""
        return (
            ("stop_token_ids", self.stop_token_ids),
            ("logit_bias", self.logit_bias),
            ("allowed_token_ids", self.allowed_token_ids or ()),
        )
