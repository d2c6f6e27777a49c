"""Deterministic demo checkpoints: real Llama / Qwen2 / Mistral architectures with seeded weights.

Nothing can be downloaded where Tandem is tested, so tests and demos build small HF checkpoints
here: the same arguments give byte-identical weights and ``tokenizer.json`` on every machine.
The tokenizer is a SentencePiece-style BPE (``▁`` word marker, ``<0x00>``..``<0xFF>`` byte
fallback) trained with ``tokenizers`` on a fixed corpus, padded to exactly the model vocab size
(a random model samples any id, so every id must decode).
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from engine.config import DemoSize as Size

Architecture = Literal["llama", "qwen2", "mistral"]

UNK, BOS, EOS = "<unk>", "<s>", "</s>"
END_OF_TURN = "<|end|>"
SPECIAL_TOKENS = (UNK, BOS, EOS, "<|system|>", "<|user|>", "<|assistant|>", END_OF_TURN)
BYTE_TOKENS = tuple(f"<0x{b:02X}>" for b in range(256))

# Turns are "<|role|>\n{content}<|end|>\n"; the assistant's reply ends with <|end|>, which is why
# <|end|> is an EOS id. The BOS is not written here: encode(add_special_tokens=True) adds it.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{ raise_exception('unknown role: ' ~ message['role']) }}"
    "{%- endif -%}"
    "{{ '<|' ~ message['role'] ~ '|>\\n' ~ message['content'] ~ '<|end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>\\n' }}{%- endif -%}"
)

# Std of the random weights. With HF's default (0.02) greedy decoding collapses onto one token
# repeated (measured on 8 prompts x 48 greedy tokens: ~1 distinct token on `test`, ~6 on `tiny`);
# such output cannot tell a correct engine from one that mixes up positions or sequences. At 0.2: ~45-48 distinct
# tokens, the median top-2 logit gap is ~5% of the top logit and ~1% of positions have a gap
# under 1e-3 relative, so fp32 greedy runs compare exactly (bf16 noise is larger: use fp32 there).
INITIALIZER_RANGE = 0.2
# Norm weights and biases get random values too (HF uses ones / zeros), so that a runner that
# forgets to load them produces different tokens instead of passing by luck.
NORM_WEIGHT_STD = 0.1


@dataclass(frozen=True)
class _Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tie_embeddings: bool


SIZES: dict[str, _Shape] = {
    # Fast unit tests; tied embeddings so the tied path is covered somewhere.
    "test": _Shape(64, 2, 4, 2, 192, 2048, tie_embeddings=True),
    "tiny": _Shape(256, 4, 8, 4, 704, 8192, tie_embeddings=False),
    # 88.1M parameters (the ~90M asked for); untied, so the lm_head is its own tensor.
    "small": _Shape(768, 12, 12, 4, 2048, 8192, tie_embeddings=False),
}


def write_demo_checkpoint(
    out_dir: str | Path,
    size: Size = "tiny",
    architecture: Architecture = "llama",
    dtype: Literal["float32", "bfloat16"] = "bfloat16",
    seed: int = 0,
    rope_scaling: dict[str, Any] | None = None,
    max_shard_size: str | None = None,
    sliding_window: int | None = None,
) -> Path:
    """Write a complete HF checkpoint directory and return its path.

    Args: ``rope_scaling`` is the HF dict (e.g. ``{"rope_type": "llama3", "factor": 8.0, ...}``);
    ``max_shard_size`` (e.g. ``"2MB"``) writes shards plus ``model.safetensors.index.json``;
    ``sliding_window`` applies to Mistral only (None = full attention).
    Raises: ValueError for an unknown size/architecture or a sliding window on another arch.
    """
    if size not in SIZES:
        raise ValueError(f"size={size!r}: expected one of {sorted(SIZES)}")
    if architecture not in ("llama", "qwen2", "mistral"):
        raise ValueError(f"architecture={architecture!r}: expected llama, qwen2 or mistral")
    if sliding_window is not None and architecture != "mistral":
        raise ValueError(f"sliding_window={sliding_window}: only the mistral demo has one")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window={sliding_window}: must be >= 1 tokens")
    shape = SIZES[size]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = build_demo_tokenizer(shape.vocab)
    (out / "tokenizer.json").write_text(tokenizer.to_str(pretty=True), encoding="utf-8")
    ids = {t: i for i, t in enumerate(SPECIAL_TOKENS)}  # build_demo_tokenizer's layout
    eos_ids = [ids[EOS], ids[END_OF_TURN]]
    _write_json(out / "tokenizer_config.json", _tokenizer_config(ids))
    _write_json(
        out / "special_tokens_map.json", {"bos_token": BOS, "eos_token": EOS, "unk_token": UNK}
    )

    model = _build_model(shape, architecture, seed, rope_scaling, sliding_window, ids, eos_ids)
    model = model.to(getattr(torch, dtype))
    save_kwargs: dict[str, Any] = {"safe_serialization": True}
    if max_shard_size is not None:
        save_kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(out, **save_kwargs)
    _write_json(
        out / "generation_config.json",
        {"bos_token_id": ids[BOS], "eos_token_id": eos_ids, "do_sample": False},
    )
    _add_classic_rope_keys(out / "config.json")
    return out


def _build_model(
    shape: _Shape,
    architecture: Architecture,
    seed: int,
    rope_scaling: dict[str, Any] | None,
    sliding_window: int | None,
    ids: dict[str, int],
    eos_ids: list[int],
) -> Any:
    import transformers  # slow import (~5 s): only when a checkpoint is actually built

    rope_theta = 1_000_000.0 if architecture == "qwen2" else 10_000.0
    rope = {"rope_type": "default", **(rope_scaling or {}), "rope_theta": rope_theta}
    common: dict[str, Any] = dict(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        rope_parameters=rope,
        tie_word_embeddings=shape.tie_embeddings,
        initializer_range=INITIALIZER_RANGE,
        bos_token_id=ids[BOS],
        eos_token_id=eos_ids,
        pad_token_id=None,
    )
    config: Any
    if architecture == "llama":
        config = transformers.LlamaConfig(**common)
        model_cls: Any = transformers.LlamaForCausalLM
    elif architecture == "qwen2":
        config = transformers.Qwen2Config(**common, use_sliding_window=False)
        model_cls = transformers.Qwen2ForCausalLM
    else:
        config = transformers.MistralConfig(**common, sliding_window=sliding_window)
        model_cls = transformers.MistralForCausalLM
    with torch.device("cpu"):
        model = model_cls(config).float()
    _seed_weights(model, seed, shape)
    return model


def _seed_weights(model: torch.nn.Module, seed: int, shape: _Shape) -> None:
    """Overwrite every parameter from a generator seeded by (seed, name).

    Seeding per name keeps each tensor independent of transformers' init order and of which
    other tensors exist (e.g. tied vs untied embeddings). NumPy's PCG64 normals are used, not
    ``torch.randn``, because torch's CPU normal kernel takes a SIMD path with approximate
    log/cos on x86 and a scalar one elsewhere, so its values depend on the machine."""
    from tqdm import tqdm

    params = sorted(model.named_parameters(remove_duplicate=True))
    for name, param in tqdm(params, desc="seeding weights", disable=shape.hidden < 512):
        digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
        rng = np.random.Generator(np.random.PCG64(int.from_bytes(digest[:16], "little")))
        noise = torch.from_numpy(rng.standard_normal(tuple(param.shape)).astype(np.float32))
        with torch.no_grad():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + NORM_WEIGHT_STD * noise)
            else:
                param.copy_(INITIALIZER_RANGE * noise)


def _add_classic_rope_keys(config_path: Path) -> None:
    """transformers 5 writes ``rope_parameters``; real checkpoints (and loaders written for them)
    use ``rope_theta`` + ``rope_scaling``. Write both so either reader works."""
    config = json.loads(config_path.read_text(encoding="utf-8"))
    rope = dict(config["rope_parameters"])
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = None if rope.get("rope_type") == "default" else rope
    _write_json(config_path, config)


def _tokenizer_config(ids: dict[str, int]) -> dict[str, Any]:
    added = {
        str(ids[t]): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    return {
        "add_bos_token": True,
        "add_eos_token": False,
        "added_tokens_decoder": added,
        "bos_token": BOS,
        "eos_token": EOS,
        "unk_token": UNK,
        "pad_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "legacy": False,
        "model_max_length": 4096,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def build_demo_tokenizer(vocab_size: int) -> Tokenizer:
    """Train the demo BPE and pad it to exactly ``vocab_size`` ids.

    Layout (Llama-2 style): ids 0..6 the special tokens, 7..262 the byte tokens, then characters
    and merges in training order, then filler tokens if training stopped short. Like the
    Llama / Mistral Metaspace tokenizers, decode(encode(s)) == s except that one leading space
    of ``s`` is lost.
    Raises: ValueError if ``vocab_size`` cannot hold the special and byte tokens."""
    reserved = len(SPECIAL_TOKENS) + len(BYTE_TOKENS)
    if vocab_size <= reserved + 128:
        raise ValueError(f"vocab_size={vocab_size}: need more than {reserved + 128}")

    trainee = Tokenizer(models.BPE())
    trainee.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - reserved, show_progress=False)
    trainee.train_from_iterator(_corpus_lines(), trainer=trainer)
    trained = json.loads(trainee.to_str())["model"]

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + BYTE_TOKENS)}
    for tok, _ in sorted(trained["vocab"].items(), key=lambda kv: kv[1]):
        assert tok not in vocab, f"trained token {tok!r} collides with a reserved token"
        vocab[tok] = len(vocab)
    # Fillers are never produced by encode (no merge builds them) but decode like any token.
    filler = 0
    while len(vocab) < vocab_size:
        vocab[f"▁filler{filler}"] = len(vocab)
        filler += 1
    merges = [tuple(m) for m in trained["merges"]]

    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token=UNK, fuse_unk=True, byte_fallback=True)
    )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, vocab[BOS])]
    )
    assert tok.get_vocab_size(with_added_tokens=True) == vocab_size
    return tok


def _corpus_lines() -> list[str]:
    """English text from ``engine/data`` plus seeded pseudo-words (enough pairs for 8k merges).

    ``random.Random(int)`` is specified to give the same stream on every platform and version."""
    text = (Path(__file__).parent / "data" / "demo_corpus.txt").read_text(encoding="utf-8")
    rng = random.Random(1234)
    onsets = "b c d f g h j k l m n p r s t v w z br ch st tr sh pl gr th".split() + [""]
    nuclei = "a e i o u ai ou ee y".split()
    codas = "n r s l t m ck nd st".split() + ["", ""]

    def pseudo_word() -> str:
        return "".join(
            rng.choice(onsets) + rng.choice(nuclei) + rng.choice(codas)
            for _ in range(rng.randint(1, 4))
        )

    words = sorted({pseudo_word() for _ in range(6000)})
    lines = text.splitlines() * 20  # weight real English over pseudo-words
    for _ in range(3000):
        picks = []
        for _ in range(rng.randint(5, 15)):
            if rng.random() < 0.5:  # a Zipf-like head of frequent words
                picks.append(words[min(int(rng.paretovariate(1.0)) - 1, len(words) - 1)])
            else:
                picks.append(rng.choice(words))
        lines.append(" ".join(picks).capitalize() + ".")
    return lines


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
