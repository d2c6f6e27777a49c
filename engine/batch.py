"""What one scheduler tick hands the model runner: plain dataclasses, no behaviour.

Positions and slots: token at absolute position ``p`` of a sequence lives in physical slot
``block_table[p // block_size] * block_size + p % block_size`` of every layer's KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ScheduledChunk:
    """A run of consecutive tokens of one sequence whose KV this step computes."""

    request_id: str
    token_ids: list[int]  # input ids, positions start_pos .. start_pos + len - 1
    start_pos: int  # num_computed_tokens before this step
    block_table: list[int]  # physical blocks covering positions [0, start_pos + len)
    sample: bool  # chunk ends at the sequence's last token: the runner returns its logits
    # Prompt logprobs asked: the runner returns every row's logits, not only the last one's.
    all_logits: bool = False
    # Speculation: the last num_drafts token ids are guesses to verify, each row sampled
    # (docs/design.md#speculative-decoding).
    num_drafts: int = 0

    @property
    def num_logit_rows(self) -> int:
        """How many of the chunk's rows, its last ones, the runner returns logits for."""
        if self.all_logits:
            return len(self.token_ids)
        return self.num_drafts + 1 if self.sample else 0

    @property
    def drafts(self) -> list[int]:
        return self.token_ids[len(self.token_ids) - self.num_drafts :]


@dataclass
class SchedulerOutput:
    """One step's work. Copies and swaps run before the forward, in this order:
    swap_out, swap_in, copy_blocks."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    copy_blocks: list[tuple[int, int]] = field(default_factory=list)  # (src, dst): copy-on-write
    preempted_ids: list[str] = field(default_factory=list)

    @property
    def sampled_ids(self) -> list[str]:
        """Request ids that sample a token this step, in row order."""
        return [c.request_id for c in self.chunks if c.sample]
