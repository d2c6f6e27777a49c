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

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from engine.batch import ScheduledChunk
from engine.config import SpeculativeConfig
from engine.request import Request, SpecStats
from engine.structured import GrammarState

# A step's drafts to verify: request id -> its drafts and their logits rows, in order.
DraftRows = dict[str, tuple[list[int], Tensor]]


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


class Speculator:
    """One engine's speculation: the drafts the scheduler asks for, and the verification of a
    step's drafts. The engine owns the sequences; this holds the rules."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config

    def index(self) -> NgramIndex:
        return NgramIndex(self.config.min_n, self.config.max_n)

    def draft(
        self, req: Request, index: NgramIndex, grammar: GrammarState | None, most: int
    ) -> list[int]:
        """At most ``most`` n-gram drafts from the request's own context (``index``), as many
        as its acceptance so far makes worth it, cut where its grammar would reject one."""
        most = min(most, drafts_worth(req.speculation, self.config.k, self.config.threshold))
        if most < 1:
            return []
        index.sync(req.prompt_token_ids, req.output_token_ids)
        drafts = index.propose(most)
        if drafts and grammar is not None:
            grammar.sync(req.output_token_ids)
            drafts = drafts[: grammar.matcher.validate_tokens(drafts)]
        return drafts

    @staticmethod
    def verify(
        rows: DraftRows,
        takes: Callable[[str, int], bool],
        sample: Callable[[list[str], Tensor], dict[str, int]],
        commit: Callable[[str, int], bool],
    ) -> dict[str, int]:
        """Accept drafts position by position, exactly as plain decoding would have gone: while
        a request ``takes`` the draft at that place (it decodes on and its last token is the
        draft, so the draft's KV, computed by the step, is that token's own), ``sample`` the
        draft's row with the request's state as it now stands -- the same state, position-keyed
        draw and logits (deterministic numerics) as the decode step that would have computed
        it -- and ``commit`` the token (every stop check). The first token that differs from
        its draft ends the request's verification. Returns the drafts accepted per request."""
        accepted = dict.fromkeys(rows, 0)
        for j in range(max(len(drafts) for drafts, _ in rows.values())):
            ready = [
                rid
                for rid, (drafts, _) in rows.items()
                if accepted[rid] == j and j < len(drafts) and takes(rid, drafts[j])
            ]
            if not ready:
                break
            stacked = torch.stack([rows[rid][1][j] for rid in ready])
            for rid, token in sample(ready, stacked).items():
                accepted[rid] += commit(rid, token)
        return accepted


def draft_rows(chunks: list[ScheduledChunk], logits: Tensor) -> tuple[Tensor, DraftRows]:
    """Split a step's sampling rows: each chunk's own row (what ``sampled_ids`` samples), and per
    chunk with drafts, its drafts and their rows (what verification samples)."""
    if not any(c.num_drafts for c in chunks):
        return logits, {}
    first: list[int] = []
    rows: DraftRows = {}
    row = 0
    for c in chunks:
        if c.sample:
            first.append(row)
            if c.num_drafts:
                rows[c.request_id] = (c.drafts, logits[row + 1 : row + 1 + c.num_drafts])
            row += 1 + c.num_drafts
    return logits[torch.tensor(first, device=logits.device)], rows
