"""What a planted sabotage (``contracts.faults.SABOTAGE``) does to the delta it fires on: the
stream-spoiling ones as pure functions, so the worker's hook stays one line and each is tested
on its own. Only ``tandem chaos run --sabotage`` arms them (a self-test of the fault verdict,
docs/design.md#chaos); a served request never meets one otherwise."""

from __future__ import annotations

from dataclasses import replace

from contracts.faults import FaultAction
from engine.outputs import TokenDelta

LOGPROB_SHIFT = 0.25  # what SPOIL_LOGPROB takes from the last alternative's logprob


def spoil(delta: TokenDelta, action: FaultAction, vocab_size: int) -> TokenDelta:
    """``delta`` with its first token changed (SPOIL_TOKEN), dropped (DROP_TOKEN) or sent twice
    (REPEAT), or its first token's last top-k alternative given another logprob
    (SPOIL_LOGPROB); unchanged for the other actions. Its text is left as it was: the verdict
    must see the tokens differ, not the text."""
    ids, lps = delta.token_ids, delta.logprobs
    if action is FaultAction.SPOIL_TOKEN:
        return replace(delta, token_ids=[(ids[0] + 1) % vocab_size, *ids[1:]])
    if action is FaultAction.DROP_TOKEN:
        return replace(delta, token_ids=ids[1:], logprobs=None if lps is None else lps[1:])
    if action is FaultAction.REPEAT:
        return replace(
            delta, token_ids=[ids[0], *ids], logprobs=None if lps is None else [lps[0], *lps]
        )
    if action is FaultAction.SPOIL_LOGPROB and lps:
        first = lps[0]
        *rest, (token, value) = first.top or [(ids[0], first.logprob)]
        top = [*rest, (token, value - LOGPROB_SHIFT)]
        logprob = top[-1][1] if token == ids[0] else first.logprob
        return replace(delta, logprobs=[replace(first, top=top, logprob=logprob), *lps[1:]])
    return delta
