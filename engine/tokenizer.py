"""The tokenizer of a checkpoint directory: ``tokenizers`` for text, jinja2 for chat templates.

Reads the files HF checkpoints ship (``tokenizer.json``, ``tokenizer_config.json``,
``generation_config.json``, optionally ``chat_template.jinja``) without importing transformers.
``decode`` is the ``tokenizers`` decode as is: no ``clean_up_tokenization_spaces``, because that
rewrite is not local (" ." -> ".") and streamed text must equal the final text exactly.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from engine.chat_templates import tools_template

_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


class Tokenizer:
    """Encode, decode and chat-format for one checkpoint; immutable after loading."""

    def __init__(self, model_dir: str | Path) -> None:
        """Raises: FileNotFoundError naming ``tokenizer.json`` when the directory lacks it."""
        root = Path(model_dir)
        path = root / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer.json at {path}")
        text = path.read_text(encoding="utf-8")
        spec = json.loads(text)
        self._tok = HFTokenizer.from_str(text)
        self.json = text  # tokenizer.json: the grammar engine builds its own tokenizer from it
        self.decoder: dict[str, Any] = spec.get("decoder") or {}  # its "decoder" section
        config = _read_json(root / "tokenizer_config.json")
        generation = _read_json(root / "generation_config.json")

        self.vocab_size: int = self._tok.get_vocab_size(with_added_tokens=True)
        added = self._tok.get_added_tokens_decoder()
        self.special_token_ids: frozenset[int] = frozenset(i for i, t in added.items() if t.special)
        # A byte-fallback decoder turns a whole run of <0xXX> tokens into text at once (and every
        # byte of an invalid run into U+FFFD), so the detokenizer must know which ids they are.
        self.byte_token_ids: frozenset[int] = frozenset()
        if _has_decoder(self.decoder, "ByteFallback"):
            vocab = self._tok.get_vocab(with_added_tokens=True)
            self.byte_token_ids = frozenset(i for t, i in vocab.items() if _BYTE_TOKEN.fullmatch(t))

        self._special_strings = {
            key: _token_content(config.get(key))
            for key in ("bos_token", "eos_token", "unk_token", "pad_token")
        }
        bos = self._special_strings["bos_token"]
        bos_id = self._tok.token_to_id(bos) if bos else None
        self.bos_token_id: int | None = (
            bos_id if bos_id is not None else generation.get("bos_token_id")
        )
        self.eos_token_ids: frozenset[int] = frozenset(self._eos_ids(generation))
        self.chat_template: str | None = _chat_template(root, config)
        self._templates: dict[str, jinja2.Template] = {}  # compiled, by text

    def _eos_ids(self, generation: Mapping[str, Any]) -> Iterable[int]:
        gen_eos = generation.get("eos_token_id")
        if isinstance(gen_eos, int):
            yield gen_eos
        elif isinstance(gen_eos, list):
            yield from (int(i) for i in gen_eos)
        eos = self._special_strings["eos_token"]
        if eos and (eos_id := self._tok.token_to_id(eos)) is not None:
            yield eos_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` runs the post-processor (adds BOS).

        Raises: ValueError for text that is not valid Unicode (JSON can carry a lone surrogate)."""
        try:
            return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)
        except TypeError as exc:
            raise ValueError("text must be a str of valid Unicode (no lone surrogates)") from exc

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; ids outside the vocabulary decode to nothing."""
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def decode_batch(
        self, batch: Sequence[Sequence[int]], skip_special_tokens: bool = True
    ) -> list[str]:
        """:meth:`decode` of each of ``batch`` (one call into the tokenizer library)."""
        texts = self._tok.decode_batch(
            [list(ids) for ids in batch], skip_special_tokens=skip_special_tokens
        )
        return [str(t) for t in texts]

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """Render ``messages`` (``[{"role": ..., "content": ...}, ...]``) as prompt text, with
        the function objects ``tools`` offered to the model when given (the checkpoint's
        template if it renders tools, else Tandem's for its family: engine/chat_templates.py).

        Raises: ValueError if there is no template (none for tools), messages are malformed,
        or rendering fails (including the template's own ``raise_exception``)."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat_template")
        template = self.chat_template
        extra: dict[str, Any] = {}
        if tools:
            with_tools = tools_template(template)
            if with_tools is None:
                raise ValueError("this model's chat template cannot render tools")
            template = with_tools
            extra["tools"] = [dict(t) for t in tools]
        if isinstance(messages, str | bytes) or not all(
            isinstance(m, Mapping) and "role" in m for m in messages
        ):
            raise ValueError("messages must be a list of mappings, each with a 'role'")
        try:
            return self._compiled(template).render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                **extra,
                **{k: v or "" for k, v in self._special_strings.items()},
            )
        except jinja2.TemplateError as exc:
            raise ValueError(f"chat template failed: {exc}") from exc

    def _compiled(self, template: str) -> jinja2.Template:
        if template not in self._templates:
            self._templates[template] = _jinja_env().from_string(template)
        return self._templates[template]

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """Token ids of the rendered chat; adds BOS unless the template already wrote it."""
        text = self.apply_chat_template(messages, add_generation_prompt, tools)
        bos = self._special_strings["bos_token"]
        return self.encode(text, add_special_tokens=not (bos and text.startswith(bos)))


# -- token bytes ----------------------------------------------------------------------------------
# What a token adds to the output's bytes, whatever the tokenizer's family: logprobs objects show
# it, and a grammar matching the output must see the same bytes.


def token_bytes(tokenizer: Tokenizer, token_id: int) -> bytes:
    """The bytes ``token_id`` adds to the output text (:func:`tokens_bytes` of one id)."""
    return tokens_bytes(tokenizer, [token_id])[0]


def tokens_bytes(tokenizer: Tokenizer, token_ids: Sequence[int]) -> list[bytes]:
    """The bytes each of ``token_ids`` adds to the output text, in one batched decode (the
    whole vocabulary's in tens of milliseconds: the detokenizer's table).

    A token alone may decode without its leading space (SentencePiece's Strip decoder) or to
    U+FFFD (part of a UTF-8 character), so: byte-fallback tokens are their byte; other tokens
    are decoded after an anchor token and the anchor's text cut off; byte-level BPE pieces of a
    character are mapped back through the GPT-2 byte alphabet."""
    anchor = min(tokenizer.special_token_ids, default=None)
    head = [] if anchor is None else [anchor]
    prefix = tokenizer.decode(head, skip_special_tokens=False)
    texts = tokenizer.decode_batch([[*head, t] for t in token_ids], skip_special_tokens=False)
    return [
        _bytes_of(tokenizer, t, text.removeprefix(prefix))
        for t, text in zip(token_ids, texts, strict=True)
    ]


def _bytes_of(tokenizer: Tokenizer, token_id: int, text: str) -> bytes:
    """:func:`tokens_bytes` of one id, given its text decoded after the anchor."""
    piece = tokenizer.id_to_token(token_id)
    if piece is None:
        return b""
    if token_id in tokenizer.byte_token_ids:
        return bytes([int(piece[3:5], 16)])
    if token_id in tokenizer.special_token_ids:
        return piece.encode()
    if "\ufffd" in text and "\ufffd" not in piece and all(ch in _UNICODE_TO_BYTE for ch in piece):
        return bytes(_UNICODE_TO_BYTE[ch] for ch in piece)
    return text.encode()


def token_string(raw: bytes) -> str:
    """A token's text for the ``token`` fields: its UTF-8 text, or ``bytes:\\xe6\\x97`` for
    part of a character (OpenAI's form)."""
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def _gpt2_byte_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte: printable Latin-1 as itself, the
    rest shifted to U+0100 onward in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in printable}
    shifted = (b for b in range(256) if b not in set(printable))
    for i, b in enumerate(shifted):
        table[chr(0x100 + i)] = b
    return table


_UNICODE_TO_BYTE = _gpt2_byte_alphabet()


class _TemplateError(jinja2.TemplateError):
    """What a template's ``raise_exception(...)`` raises; reported as ValueError."""


def _raise_exception(message: str) -> None:
    raise _TemplateError(message)


def _jinja_env() -> ImmutableSandboxedEnvironment:
    # The settings transformers renders chat templates with, so real templates behave the same.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_content(value: Any) -> str | None:
    """tokenizer_config stores a special token as a string or as a serialised AddedToken."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(root: Path, config: Mapping[str, Any]) -> str | None:
    jinja_file = root / "chat_template.jinja"  # newer transformers save it on its own
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # the older named-templates form
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _has_decoder(spec: Any, kind: str) -> bool:
    if not isinstance(spec, dict):
        return False
    return spec.get("type") == kind or any(_has_decoder(d, kind) for d in spec.get("decoders", []))
