"""Steps 1–2 of the sampling pipeline (docs/design.md#sampling-order): hard constraints, then
penalties.

Each step touches only the rows that ask for it, so a batch of plain requests pays nothing here.
Masking a token means setting its logit to ``-inf`` (docs/design.md#sampling-order); the later
softmax gives it zero probability and argmax never picks it while any finite logit remains.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from engine.sampling_params import SamplingParams

_NEG_INF = float("-inf")


class TokenHistory:
    """A sequence's prompt and output ids, plus caches the processors update incrementally.

    ``output_token_ids`` is the request's own list, read each step. It must only grow, or be
    truncated (a rollback); a shorter list than last time makes the caches rebuild.
    """

    def __init__(
        self,
        prompt_token_ids: Sequence[int],
        output_token_ids: Sequence[int],
        *,
        ngram_size: int = 0,
    ) -> None:
        self.prompt = prompt_token_ids
        self.output = output_token_ids
        self._ngram_size = ngram_size
        self._prompt_ids: Tensor | None = None
        self._out_buf = torch.empty(0, dtype=torch.long)
        self._out_len = 0  # output tokens copied into _out_buf
        self._ngrams: dict[tuple[int, ...], set[int]] = {}
        self._window: list[int] = []  # the last ngram_size - 1 tokens
        self._ngram_len = 0  # tokens (prompt + output) folded into _ngrams

    def prompt_ids(self) -> Tensor:
        """The prompt as a CPU int64 tensor, built once (the prompt never changes)."""
        if self._prompt_ids is None:
            self._prompt_ids = torch.tensor(list(self.prompt), dtype=torch.long)
        return self._prompt_ids

    def output_ids(self) -> Tensor:
        """The output as a CPU int64 tensor; only tokens new since the last call are copied."""
        n = len(self.output)
        if n < self._out_len:
            self._out_len = 0
        if n > self._out_len:
            if n > self._out_buf.numel():
                grown = torch.empty(max(2 * n, 64), dtype=torch.long)
                grown[: self._out_len] = self._out_buf[: self._out_len]
                self._out_buf = grown
            new = list(self.output[self._out_len : n])
            self._out_buf[self._out_len : n] = torch.tensor(new, dtype=torch.long)
            self._out_len = n
        return self._out_buf[:n]

    def ngram_bans(self) -> set[int]:
        """Tokens that would complete an n-gram already present in prompt + output (HF
        ``no_repeat_ngram_size``): the (n-1)-token suffix followed by the token occurred before."""
        n = self._ngram_size
        num_prompt = len(self.prompt)
        total = num_prompt + len(self.output)
        if total < self._ngram_len:
            self._ngrams.clear()
            self._window.clear()
            self._ngram_len = 0
        for i in range(self._ngram_len, total):
            tok = self.prompt[i] if i < num_prompt else self.output[i - num_prompt]
            if len(self._window) == n - 1:
                self._ngrams.setdefault(tuple(self._window), set()).add(tok)
            self._window.append(tok)
            if len(self._window) > n - 1:
                del self._window[0]
        self._ngram_len = total
        if len(self._window) < n - 1:
            return set()
        return self._ngrams.get(tuple(self._window), set())


def needs_processing(params: SamplingParams, history: TokenHistory, eos: frozenset[int]) -> bool:
    """Whether any step-1/2 processor would change this row's logits now."""
    return bool(
        params.logit_bias
        or params.allowed_token_ids is not None
        or params.bad_words_ids
        or params.no_repeat_ngram_size
        or (params.min_tokens and _min_tokens_bans(params, history, eos))
        or params.repetition_penalty != 1.0
        or params.frequency_penalty
        or params.presence_penalty
    )


def process_logits(
    logits: Tensor,
    raw: Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[TokenHistory],
    eos: Sequence[frozenset[int]],
) -> None:
    """Apply hard constraints then penalties, in place, to float32 ``logits`` [B, V].

    ``raw`` is the unprocessed copy: a row whose hard constraints leave no legal token (e.g.
    ``allowed_token_ids`` all banned) is a contradiction; rather than sample from NaN, that row
    drops its hard constraints for this step and keeps only its penalties.
    """
    _apply_logit_bias(logits, params)
    _apply_masks(logits, raw, params, histories, eos)
    _apply_repetition_penalty(logits, params, histories)
    _apply_frequency_presence(logits, params, histories)


def _min_tokens_bans(
    params: SamplingParams, history: TokenHistory, eos: frozenset[int]
) -> set[int]:
    """EOS (unless ignore_eos) and stop tokens may not end a sequence shorter than min_tokens."""
    if len(history.output) >= params.min_tokens:
        return set()
    return set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos))


def _bad_word_bans(bad_words: Sequence[tuple[int, ...]], output: Sequence[int]) -> set[int]:
    """The last token of each bad word whose other tokens end the generated output; a length-1
    bad word has an empty prefix, so it is banned at every step."""
    bans = set()
    for word in bad_words:
        k = len(word) - 1
        if tuple(output[len(output) - k :]) == word[:-1]:
            bans.add(word[-1])
    return bans


def _apply_logit_bias(logits: Tensor, params: Sequence[SamplingParams]) -> None:
    vocab = logits.shape[1]
    flat = [row * vocab + tok for row, p in enumerate(params) for tok in p.logit_bias]
    if not flat:
        return
    bias = [b for p in params for b in p.logit_bias.values()]
    index = torch.tensor(flat, device=logits.device)
    logits.view(-1).index_add_(0, index, torch.tensor(bias, device=logits.device))


def _apply_masks(
    logits: Tensor,
    raw: Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[TokenHistory],
    eos: Sequence[frozenset[int]],
) -> None:
    vocab, device = logits.shape[1], logits.device
    touched: list[int] = []
    banned: list[int] = []  # flat indices row * V + token
    allowed_rows: list[int] = []
    allowed_flat: list[int] = []  # flat indices into the allowed rows' sub-batch
    for row, (p, hist, row_eos) in enumerate(zip(params, histories, eos, strict=True)):
        bans = _min_tokens_bans(p, hist, row_eos)
        if p.bad_words_ids:
            bans |= _bad_word_bans(p.bad_words_ids, hist.output)
        if p.no_repeat_ngram_size:
            bans |= hist.ngram_bans()
        if p.allowed_token_ids is not None:
            base = len(allowed_rows) * vocab
            allowed_flat.extend(base + tok for tok in p.allowed_token_ids)
            allowed_rows.append(row)
        if bans:
            banned.extend(row * vocab + tok for tok in bans)
        if bans or p.allowed_token_ids is not None:
            touched.append(row)
    if not touched:
        return
    if allowed_rows:
        keep = torch.zeros(len(allowed_rows) * vocab, dtype=torch.bool, device=device)
        keep[torch.tensor(allowed_flat, device=device)] = True
        index = torch.tensor(allowed_rows, device=device)
        logits[index] = logits[index].masked_fill(~keep.view(-1, vocab), _NEG_INF)
    if banned:
        logits.view(-1)[torch.tensor(banned, device=device)] = _NEG_INF
    index = torch.tensor(touched, device=device)
    dead = torch.isneginf(logits[index]).all(-1)
    if bool(dead.any()):
        rows = index[dead]
        logits[rows] = raw[rows].float()
        _apply_logit_bias_rows(logits, params, rows.tolist())


def _apply_logit_bias_rows(
    logits: Tensor, params: Sequence[SamplingParams], rows: list[int]
) -> None:
    """Re-add the bias of rows restored from the raw logits (bias is not a hard constraint)."""
    for row in rows:
        for tok, b in params[row].logit_bias.items():
            logits[row, tok] += b


def _token_counts(ids: Sequence[Tensor], vocab: int, device: torch.device) -> Tensor:
    """Occurrences of each token id per row, as float32 [len(ids), V], from one bincount."""
    lengths = torch.tensor([t.numel() for t in ids])
    offsets = torch.repeat_interleave(torch.arange(len(ids)) * vocab, lengths)
    flat = (torch.cat(list(ids)) + offsets).to(device)
    counts = torch.bincount(flat, minlength=len(ids) * vocab)
    return counts.view(len(ids), vocab).float()


def _apply_repetition_penalty(
    logits: Tensor, params: Sequence[SamplingParams], histories: Sequence[TokenHistory]
) -> None:
    """Sign-aware (docs/design.md#sampling-order) on every token seen in prompt + output: z/r if z
    > 0, else z*r. A finite logit stays finite (clamped to float32's range): an extreme r (any r
    > 0 is valid, 5e-324 too) ranks tokens as its limit does, where an infinite logit would make
    the softmax NaN; a masked token (-inf) stays masked."""
    rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    if not rows:
        return
    device = logits.device
    ids = [torch.cat((histories[i].prompt_ids(), histories[i].output_ids())) for i in rows]
    seen = _token_counts(ids, logits.shape[1], device) > 0
    r = torch.tensor([params[i].repetition_penalty for i in rows], device=device)[:, None]
    index = torch.tensor(rows, device=device)
    sub = logits[index]
    most = torch.finfo(logits.dtype).max
    scaled = torch.where(sub > 0, sub / r, sub * r)
    penalised = torch.where(sub.isneginf(), sub, scaled.clamp(-most, most))
    logits[index] = torch.where(seen, penalised, sub)


def _apply_frequency_presence(
    logits: Tensor, params: Sequence[SamplingParams], histories: Sequence[TokenHistory]
) -> None:
    """z - a_f * c - a_p * 1[c > 0], with c counted over output tokens only (OpenAI)."""
    rows = [i for i, p in enumerate(params) if p.frequency_penalty or p.presence_penalty]
    if not rows:
        return
    device = logits.device
    counts = _token_counts([histories[i].output_ids() for i in rows], logits.shape[1], device)
    freq = torch.tensor([params[i].frequency_penalty for i in rows], device=device)[:, None]
    pres = torch.tensor([params[i].presence_penalty for i in rows], device=device)[:, None]
    index = torch.tensor(rows, device=device)
    logits[index] = logits[index] - freq * counts - pres * (counts > 0).float()
