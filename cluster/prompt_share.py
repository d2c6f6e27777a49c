"""One prefill for the n choices of a prompt (cheatsheet §4.2; docs/design.md#n-choices).

The cluster runs each choice as its own n=1 request (its own stream, retries and record), so
that a fault moves one choice without touching the others. Run side by side, the n choices
would each prefill the prompt and each hold its KV on a decode worker. Instead the first
choice (the *lead*) runs alone until its prompt's KV is on its decode worker -- imported from
the prefill worker, or computed there -- and then the others prefill on that worker, locally,
on the lead's cached prompt blocks: only the last, partial block is computed again, and the
full blocks are held once by all n (the engine claims them once too). A later choice's first
token comes from the same logits a prefill worker would give it (P13), so sharing changes no
token: a choice is the same whether it shared the prompt or, after a fault, prefilled alone.

Sharing is a route hint, never a wait on a worker: a later choice whose lead ended before its
prompt reached a decode worker (a first-token finish, a failure) is routed as any request, and
one whose shared worker is not eligible (FAILED, full, excluded) too (``router/policy.py``).
"""

from __future__ import annotations

import asyncio


class PromptShare:
    """Where the prompt of a group of choices is: set once by the lead's coordinator run (the
    decode worker, or None: nowhere to share), awaited by the others' first attempts."""

    def __init__(self, lead: int) -> None:
        self.lead = lead  # the choice index that prefills the prompt
        self._where: str | None = None
        self._known = asyncio.Event()

    def leads(self, choice: int) -> bool:
        return choice == self.lead

    def found(self, worker: str | None) -> None:
        """The lead's prompt KV is on ``worker`` (None: it will not be anywhere). First wins."""
        if not self._known.is_set():
            self._where = worker
            self._known.set()

    async def where(self) -> str | None:
        """The decode worker to prefill on, once the lead knows (None: route as any request)."""
        await self._known.wait()
        return self._where


def prompt_shares(prompts: list[tuple[int, ...]]) -> list[PromptShare | None]:
    """For each choice, the share of the choices with its prompt (the first of them leads);
    None for a prompt only one choice has."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for index, prompt in enumerate(prompts):
        groups.setdefault(prompt, []).append(index)
    shares: list[PromptShare | None] = [None] * len(prompts)
    for members in groups.values():
        if len(members) > 1:
            share = PromptShare(lead=members[0])
            for index in members:
                shares[index] = share
    return shares
