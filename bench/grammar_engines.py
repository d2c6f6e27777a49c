"""The grammar engines ``bench.grammar_engines_bench`` compares, behind one small interface
(:class:`Engine`): llguidance (Tandem's), and, where importable, xgrammar and outlines-core
(see that script's docstring for installing them beside the venv)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

MODEL_DIR = Path.home() / ".cache/tandem/smollm2-135m-instruct-bf16"
VOCAB = 49152
WORDS = (VOCAB + 31) // 32  # int32 words in one row's bitmask
SEPARATORS = (", ", ": ")  # Tandem's JSON style (engine/structured.py::JSON_STYLE)
COMPACT = (",", ":")  # outlines-core with whitespace pattern ""


def log(msg: str) -> None:
    print(f"[grammar-bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Engine:
    """What the bench needs of a grammar engine. ``compile`` returns the compiled artifact
    (cached by spec when ``cache``); masks are int32 bitmask rows of WORDS words."""

    name = ""
    package = ""
    separators = SEPARATORS

    def build_tokenizer(self, hf: Any) -> None:
        raise NotImplementedError

    def compile(self, kind: str, spec: str, cache: bool) -> Any:
        raise NotImplementedError

    def matcher(self, compiled: Any) -> Any:
        raise NotImplementedError

    def advance(self, m: Any, token: int) -> None:
        raise NotImplementedError

    def mask(self, m: Any, row: np.ndarray) -> None:
        raise NotImplementedError

    def reset(self, m: Any) -> None:
        raise NotImplementedError

    def batch_fill(self, ms_: Sequence[Any], out: np.ndarray, threads: int) -> None:
        """All rows of ``out`` at once; default: a loop of single-row masks."""
        for i, m in enumerate(ms_):
            self.mask(m, out[i])

    batch_api = "loop of single-row masks"


class LLGuidance(Engine):
    name = "llguidance"
    package = "llguidance"
    batch_api = "LLExecutor.unsafe_compute_mask_ptr"

    def __init__(self) -> None:
        import llguidance

        from engine.structured import JSON_STYLE  # compact: ", " and ": ", no free whitespace

        self.ll = llguidance
        self.style = JSON_STYLE
        self.cache: dict[tuple[str, str], str] = {}
        self.executors: dict[int, Any] = {}

    def build_tokenizer(self, hf: Any) -> None:
        text = (MODEL_DIR / "tokenizer.json").read_text()
        self.tok = self.ll.LLTokenizer(text, n_vocab=VOCAB, eos_token=hf.eos_token_id)

    def compile(self, kind: str, spec: str, cache: bool) -> str:
        """As engine/structured.py: the grammar from the spec, validated against the
        tokenizer; llguidance builds its lexer lazily, at the masks."""
        key = (kind, spec)
        if cache and key in self.cache:
            return self.cache[key]
        if kind == "json_schema":
            grammar = self.ll.LLMatcher.grammar_from_json_schema(spec, defaults=self.style)
        else:
            grammar = self.ll.LLMatcher.grammar_from_regex(spec)
        error = self.ll.LLMatcher.validate_grammar(grammar, self.tok)
        if error:
            raise ValueError(error)
        if cache:
            self.cache[key] = grammar
        return grammar

    def matcher(self, compiled: str) -> Any:
        m = self.ll.LLMatcher(self.tok, compiled)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def advance(self, m: Any, token: int) -> None:
        if not m.consume_token(token):
            raise RuntimeError(m.get_error())

    def mask(self, m: Any, row: np.ndarray) -> None:
        m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def reset(self, m: Any) -> None:
        m.reset()

    def batch_fill(self, ms_: Sequence[Any], out: np.ndarray, threads: int) -> None:
        if threads not in self.executors:
            self.executors[threads] = self.ll.LLExecutor(num_threads=threads)
        rows = [(m, i) for i, m in enumerate(ms_)]
        self.executors[threads].unsafe_compute_mask_ptr(
            rows, out.ctypes.data, out.shape[1] * 4, out.shape[0]
        )


class XGrammar(Engine):
    name = "xgrammar"
    package = "xgrammar"
    batch_api = "BatchGrammarMatcher.batch_fill_next_token_bitmask"

    def __init__(self, threads: int) -> None:
        import torch
        import xgrammar

        self.xgr = xgrammar
        self.torch = torch
        self.threads = threads
        self.batchers: dict[int, Any] = {}

    def build_tokenizer(self, hf: Any) -> None:
        self.info = self.xgr.TokenizerInfo.from_huggingface(hf, vocab_size=VOCAB)
        self.compiler = self.fresh_compiler()

    def fresh_compiler(self) -> Any:
        return self.xgr.GrammarCompiler(self.info, max_threads=self.threads)

    def compile(self, kind: str, spec: str, cache: bool) -> Any:
        """A cold compile uses a fresh compiler (an empty cache); a cached one the shared one."""
        compiler = self.compiler if cache else self.fresh_compiler()
        if kind == "json_schema":
            return compiler.compile_json_schema(spec, any_whitespace=False, separators=SEPARATORS)
        return compiler.compile_regex(spec)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def advance(self, m: Any, token: int) -> None:
        if not m.accept_token(token):
            raise RuntimeError(f"token {token} rejected")

    def mask(self, m: Any, row: np.ndarray) -> None:
        # The bitmask is a torch tensor sharing row's memory: allocate_token_bitmask's layout.
        m.fill_next_token_bitmask(self.torch.from_numpy(row.reshape(1, -1)))

    def reset(self, m: Any) -> None:
        m.reset()

    def batch_fill(self, ms_: Sequence[Any], out: np.ndarray, threads: int) -> None:
        if threads not in self.batchers:
            self.batchers[threads] = self.xgr.BatchGrammarMatcher(threads)
        self.batchers[threads].batch_fill_next_token_bitmask(list(ms_), self.torch.from_numpy(out))


def byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: a token's characters back to its bytes."""
    bs = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    cs = bs[:]
    extra = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


class OutlinesCore(Engine):
    name = "outlines-core"
    package = "outlines_core"
    separators = COMPACT

    def __init__(self) -> None:
        import outlines_core

        self.oc = outlines_core
        self.cache: dict[tuple[str, str], Any] = {}

    def build_tokenizer(self, hf: Any) -> None:
        """A Vocabulary of every token's bytes (no special tokens; EOS apart), as the HF
        byte-level BPE spells them -- outlines' own from_pretrained needs the Hub."""
        spec = json.loads((MODEL_DIR / "tokenizer.json").read_text())
        special = {t["id"] for t in spec["added_tokens"] if t["special"]}
        decode = byte_decoder()
        vocab: dict[bytes, list[int]] = {}
        for text, tid in spec["model"]["vocab"].items():
            if tid not in special:
                vocab.setdefault(bytes(decode[c] for c in text), []).append(tid)
        self.vocab = self.oc.Vocabulary(hf.eos_token_id, vocab)

    def compile(self, kind: str, spec: str, cache: bool) -> Any:
        """The regex (a JSON schema's via build_regex_from_schema), then its Index: the full
        automaton over the vocabulary, built eagerly."""
        key = (kind, spec)
        if cache and key in self.cache:
            return self.cache[key]
        regex = spec
        if kind == "json_schema":
            regex = self.oc.json_schema.build_regex_from_schema(spec, "")
        index = self.oc.Index(regex, self.vocab)
        if cache:
            self.cache[key] = index
        return index

    def matcher(self, compiled: Any) -> Any:
        return self.oc.Guide(compiled)

    def advance(self, m: Any, token: int) -> None:
        m.advance(token, return_tokens=False)

    def mask(self, m: Any, row: np.ndarray) -> None:
        m.write_mask_into(row.ctypes.data, row.size, 4)

    def reset(self, m: Any) -> None:
        m.reset()


def load_engines(threads: int) -> tuple[list[Engine], dict[str, str]]:
    """The engines that import; the others with why not."""
    makers: list[tuple[str, Callable[[], Engine]]] = [
        ("llguidance", LLGuidance),
        ("xgrammar", lambda: XGrammar(threads)),
        ("outlines-core", OutlinesCore),
    ]
    engines, skipped = [], {}
    for name, make in makers:
        try:
            engines.append(make())
        except Exception as e:  # ImportError, or a broken install's error at import
            skipped[name] = f"{type(e).__name__}: {e}"
            log(f"skipping {name}: {skipped[name]}")
    return engines, skipped


# --- measurements ---------------------------------------------------------------------------
