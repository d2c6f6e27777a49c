"""GGUF checkpoints: a ``.gguf`` file served as the bf16 Hugging Face checkpoint dir it holds.

The engine loads Hugging Face checkpoint dirs, so a GGUF file is converted once per machine:
its metadata is checked first (architecture, tokenizer, every tensor's type), then transformers'
GGUF loader dequantizes it, and the result is saved under Tandem's home as an ordinary bf16
checkpoint with the file's tokenizer and chat template. The dir is keyed by the file's size and
modification time, so an edited file is converted again; it appears whole or not at all (built
beside it, then renamed). The built-in SmolLM2 model is made by the same conversion.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

from tandem.demo import tandem_home

# The engine's architectures as GGUF names them. llama.cpp writes Mistral models as `llama`
# (transformers reads them back as Mistral when `general.name` says so); gguf-py has no
# `mistral` architecture, so a file naming one cannot be read (tests/tandem/test_gguf.py).
SUPPORTED_ARCHITECTURES = ("llama", "qwen2")
# `tokenizer.ggml.model` values transformers rebuilds a tokenizer from for these architectures:
# byte-level BPE and sentencepiece.
SUPPORTED_TOKENIZERS = ("gpt2", "llama")
# Exactly the tensor types transformers' loader dequantizes for these architectures (its legacy
# path, `gguf.quants.dequantize`): the floats, the classic and K-quants, the i-quants, the
# ternary and the FP4 ones. Not F64, the integer types, Q8_1, Q8_K (llama.cpp's intermediate
# types, never in a model file) or Q1_0. tests/tandem/test_gguf.py holds it equal to gguf's.
SUPPORTED_TYPES = (
    "F32", "F16", "BF16",
    "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
    "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS",
    "TQ1_0", "TQ2_0", "MXFP4", "NVFP4",
)  # fmt: skip
GGUF_MAGIC = b"GGUF"


class UnsupportedGGUF(ValueError):
    """A ``.gguf`` file Tandem cannot serve: not GGUF, or an architecture, tokenizer or tensor
    type outside the supported ones; the message names it and what is supported."""


def is_gguf(path: Path) -> bool:
    """Whether ``path`` names a GGUF file (by its suffix; a directory never does)."""
    return path.suffix.lower() == ".gguf" and not path.is_dir()


def served_name(path: Path) -> str:
    """The model id a checkpoint at ``path`` is served under: a dir's name, or a GGUF file's
    stem lowercased (``SmolLM2-135M-Instruct.Q4_1.gguf`` -> ``smollm2-135m-instruct.q4_1``)."""
    return path.stem.lower() if path.suffix.lower() == ".gguf" else path.name


def gguf_checkpoint_dir(path: Path) -> Path:
    """Where the converted checkpoint of the GGUF file at ``path`` lives: under Tandem's home,
    keyed by the file's size and modification time (hashing gigabytes each start costs more
    than it saves)."""
    stat = path.stat()
    key = hashlib.sha256(f"{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return tandem_home() / "gguf" / f"{path.stem}-{key}-bf16"


def ensure_gguf_checkpoint(path: Path) -> Path:
    """The bf16 Hugging Face checkpoint dir of the GGUF file at ``path``, converted on first
    use (checked first: :func:`check_gguf`).

    Raises:
        FileNotFoundError: no file at ``path``.
        UnsupportedGGUF: a file Tandem cannot serve, naming why.
    """
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such GGUF file")
    out = gguf_checkpoint_dir(path)
    if (out / "config.json").is_file():
        return out
    check_gguf(path)
    print(f"tandem: converting {path} into {out} (first use only)", file=sys.stderr)
    return convert_gguf(path, out)


def check_gguf(path: Path) -> None:
    """Read the file's metadata and refuse what the engine or the loader cannot take.

    Raises:
        UnsupportedGGUF: not a GGUF file, or its architecture, tokenizer or a tensor type is
            not among ``SUPPORTED_*``.
    """
    with path.open("rb") as f:
        magic = f.read(len(GGUF_MAGIC))
    if magic != GGUF_MAGIC:
        raise UnsupportedGGUF(f"{path} is not a GGUF file (it starts with {magic!r}, not b'GGUF')")
    from gguf import GGUFReader  # numpy; only a conversion needs it

    try:
        reader = GGUFReader(path)
    except Exception as e:  # a truncated file, a type id newer than this gguf knows, ...
        raise UnsupportedGGUF(f"{path} cannot be read as GGUF: {e}") from e

    def text(key: str) -> str | None:
        field = reader.get_field(key)  # a string's bytes are its last part
        return None if field is None else bytes(field.parts[field.data[0]]).decode("utf-8")

    arch = text("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedGGUF(
            f"{path}: architecture {arch!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    tokenizer = text("tokenizer.ggml.model")
    if tokenizer not in SUPPORTED_TOKENIZERS:
        raise UnsupportedGGUF(
            f"{path}: tokenizer.ggml.model {tokenizer!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_TOKENIZERS)})"
        )
    unsupported: dict[str, str] = {}  # type -> its first tensor
    for tensor in reader.tensors:
        if tensor.tensor_type.name not in SUPPORTED_TYPES:
            unsupported.setdefault(tensor.tensor_type.name, tensor.name)
    if unsupported:
        found = ", ".join(f"{t} (e.g. {name})" for t, name in unsupported.items())
        kind = "tensor type {} is" if len(unsupported) == 1 else "tensor types {} are"
        raise UnsupportedGGUF(
            f"{path}: {kind.format(found)} not supported (supported: {', '.join(SUPPORTED_TYPES)})"
        )


def convert_gguf(path: Path, out: Path) -> Path:
    """Dequantize the GGUF file at ``path`` into a bf16 Hugging Face checkpoint at ``out``
    (weights, config, tokenizer and chat template) with transformers' GGUF loader; unchecked
    (see :func:`check_gguf`). Built beside ``out`` and renamed: another process converting the
    same file at once costs time, never a half-written dir. Returns ``out``."""
    # Imported only to convert: an ingress finding the dir built stays without them.
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # Dense weights even where transformers (5 on) could keep them in GGUF blocks.
    gguf_config = getattr(transformers, "GgufConfig", None)
    dense = {"quantization_config": gguf_config(dequantize=True)} if gguf_config else {}

    if out.exists() and not (out / "config.json").is_file():
        shutil.rmtree(out, ignore_errors=True)  # left by an older, non-atomic build
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(
            path.parent,
            gguf_file=path.name,
            dtype=torch.bfloat16,
            **dense,
        )
        # Dequantized into plain tensors: saved as an ordinary checkpoint.
        model.hf_quantizer = None  # type: ignore[assignment]
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        built = Path(tmp, "hf")
        model.save_pretrained(built)
        tokenizer.save_pretrained(built)
        try:
            os.rename(built, out)  # atomic: fails when another process built it meanwhile
        except OSError:
            if not (out / "config.json").is_file():
                raise
    return out
