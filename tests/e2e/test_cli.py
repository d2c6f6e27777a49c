"""The ``tandem`` console script, run as a user runs it (a subprocess of the installed script)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.sampling_params import SamplingParams

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


@pytest.mark.e2e
def test_serve_answers_then_stops_cleanly_on_ctrl_c(test_llama: Path) -> None:
    """The quick start's command: ``tandem serve`` starts its own loopback Ray cluster and the
    Serve app, prints the URL, answers the OpenAI API, and exits 0 on SIGINT."""
    import os
    import shutil
    import signal
    import tempfile
    import urllib.request

    from tandem.serve import free_port

    port = free_port("127.0.0.1")
    tmp = tempfile.mkdtemp(prefix="tandem-ray-")  # short: Ray's socket paths must fit 107 bytes
    env = {**os.environ, "RAY_TMPDIR": tmp}
    tandem = str(Path(sys.executable).with_name("tandem"))
    cmd = [tandem, "serve", "--model", str(test_llama), "--port", str(port)]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True
    )
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()  # printed once /health answers
        assert f"http://127.0.0.1:{port}/v1" in first, first
        assert f'"model": "{test_llama.name}"' in proc.stdout.readline()  # the example request
        # --model serves that checkpoint under its directory's name, as vLLM does.
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=60) as reply:
            assert [m["id"] for m in json.loads(reply.read())["data"]] == [test_llama.name]
        body = json.dumps({"model": test_llama.name, "prompt": "Hi", "max_tokens": 4}).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions",
            data=body,
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as reply:
            answer = json.loads(reply.read())
        assert answer["usage"]["completion_tokens"] == 4
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        shutil.rmtree(tmp, ignore_errors=True)


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
