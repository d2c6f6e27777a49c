"""n-gram (prompt-lookup) drafts, and how many a request takes (docs/design.md
#speculative-decoding).

A draft is a guess at a sequence's next tokens, copied from its own context: find the latest
earlier place where the context's last ``n`` tokens occurred (longest ``n`` first) and propose
the tokens that followed there (:class:`NgramIndex`). Code edits, quoted documents and tool
results repeat their input, so the guesses there are often right. Drafts never decide a token: the engine verifies
them by sampling every position exactly as a plain decode would and keeps them only while they
equal what it drew (engine/engine.py), so a wrong guess costs compute, never a different output.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.request import SpecStats


class NgramIndex:
    """One sequence's n-grams, kept as it grows: for each length ``min_n`` .. ``max_n``, every
    n-gram of its tokens that has a token after it, mapped to the position after its latest
    occurrence. A lookup is then a few dictionary reads, not a scan of the context each step."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self._after: dict[tuple[int, ...], int] = {}

    def sync(self, prompt: Sequence[int], output: Sequence[int]) -> None:
        """Take in the tokens of ``prompt + output`` new since the last call (it only grows)."""
        tokens = self.tokens
        for i in range(len(tokens), len(prompt) + len(output)):
            tokens.append(prompt[i] if i < len(prompt) else output[i - len(prompt)])
            for n in range(self.min_n, min(self.max_n, i) + 1):
                self._after[tuple(tokens[i - n : i])] = i

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest suffix
        (``max_n`` .. ``min_n`` tokens) that occurred before; [] when none did."""
        tokens = self.tokens
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            at = self._after.get(tuple(tokens[len(tokens) - n :]))
            if at is not None:
                return tokens[at : at + k]
        return []


def drafts_worth(stats: SpecStats, k: int, threshold: float) -> int:
    """How many drafts (at most ``k``) a request should take: the largest d whose chance of all
    being accepted, ``rate ** d`` with the request's acceptance so far (``(accepted + 1) /
    (drafted + 2)``: 1/2 before its first draft), is still at least ``threshold``. A draft
    costs a row of the step's forward whether or not it is accepted."""
    rate = (stats.num_accepted + 1) / (stats.num_drafted + 2)
    d = 0
    while d < k and rate ** (d + 1) >= threshold:
        d += 1
    return d
