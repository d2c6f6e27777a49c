"""The ``tandem`` command line:

* ``demo-model`` -- write a deterministic demo checkpoint (Llama, Qwen2 or Mistral, with its
  tokenizer);
* ``generate`` -- one prompt through one engine in this process (no Ray; the demo model unless
  ``--model``);
* ``serve`` -- start a cluster and serve its OpenAI API on Ray Serve until Ctrl-C
  (tandem/serve.py);
* ``status`` -- a running server's view of its workers (``GET /v1/cluster``) as a table;
* ``testbed up`` / ``testbed down`` -- hosts in network namespaces on this machine
  (tandem/testbed.py; root);
* ``chaos run`` / ``chaos plans`` -- added by the ``chaos`` package through the
  ``tandem.commands`` entry point (pyproject.toml): this package imports nothing above it
  (docs/design.md#layers).

Heavy imports happen inside the commands, so ``tandem --help`` is quick."""

from __future__ import annotations

import argparse
import json
import sys
import time
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.request import SpecStats


def _add_sampling_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--min-tokens", type=int, default=0)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--typical-p", type=float, default=1.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--stop-token-id", action="append", type=int, default=[])
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--logprobs", type=int, default=None, help="return top-N logprobs")
    g.add_argument("-n", type=int, default=1, help="samples per prompt")


def _sampling_params(a: argparse.Namespace):  # -> SamplingParams
    from engine.sampling_params import SamplingParams

    return SamplingParams(
        n=a.n,
        max_tokens=a.max_tokens,
        min_tokens=a.min_tokens,
        temperature=a.temperature,
        top_k=a.top_k,
        top_p=a.top_p,
        min_p=a.min_p,
        typical_p=a.typical_p,
        repetition_penalty=a.repetition_penalty,
        frequency_penalty=a.frequency_penalty,
        presence_penalty=a.presence_penalty,
        seed=a.seed,
        stop=tuple(a.stop),
        stop_token_ids=tuple(a.stop_token_id),
        ignore_eos=a.ignore_eos,
        logprobs=a.logprobs,
    )


def cmd_demo_model(a: argparse.Namespace) -> int:
    from engine.demo_model import write_demo_checkpoint

    out = write_demo_checkpoint(a.out, size=a.size, architecture=a.arch, dtype=a.dtype, seed=a.seed)
    print(out)
    return 0


def cmd_generate(a: argparse.Namespace) -> int:
    t_start = time.time()
    from engine.config import EngineConfig
    from engine.engine import LLMEngine
    from tandem.demo import ensure_demo_model
    from tandem.gguf import ensure_gguf_checkpoint, is_gguf

    params = _sampling_params(a)
    model = Path(a.model) if a.model else ensure_demo_model()
    if is_gguf(model):
        model = ensure_gguf_checkpoint(model)
    config = EngineConfig.model_validate(
        {"dtype": a.dtype, "kv_cache_bytes": a.kv_cache_mb * 2**20, "device": a.device}
        | _engine_settings(a)
    )
    engine = LLMEngine.from_checkpoint(model, config)
    prompt: str = a.prompt
    if a.chat:
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    first_token_at: float | None = None
    for delta in engine.stream(prompt, params):
        if first_token_at is None and delta.token_ids:
            first_token_at = time.time()
        if not a.json and delta.text:
            sys.stdout.write(delta.text)
            sys.stdout.flush()
    if a.json:
        outs = []
        for r in engine.finished_outputs():
            outs.append(
                {
                    "index": r.index,
                    "token_ids": r.token_ids,
                    "text": r.text,
                    "finish_reason": r.finish_reason.value,
                    "logprobs": r.logprobs,
                    "timing": r.timing,
                    "speculation": _speculation(r.record.speculation),
                }
            )
        cold = (first_token_at - t_start) if first_token_at is not None else None
        doc = {
            "model": str(model),
            "outputs": outs,
            "first_token_at": first_token_at,  # time.time(), for process-start measurements
            "cold_start_s": cold,  # from CLI entry (after interpreter start) to first token
        }
        print(json.dumps(doc, indent=2))
    else:
        sys.stdout.write("\n")
    return 0


def _speculation(stats: SpecStats | None) -> dict[str, float] | None:
    """A request's drafts, as ``--json`` prints them (None: it never drafted)."""
    if stats is None:
        return None
    return {
        "drafts": stats.num_steps,
        "draft_tokens": stats.num_drafted,
        "accepted_tokens": stats.num_accepted,
        "acceptance_rate": stats.acceptance_rate,
        "mean_acceptance_length": stats.mean_acceptance_length,
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem", description="Tandem LLM serving")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser(
        "demo-model", help="write a deterministic demo checkpoint (model + tokenizer)"
    )
    d.add_argument("--size", choices=["test", "tiny", "small"], default="tiny")
    d.add_argument("--arch", choices=["llama", "qwen2", "mistral"], default="llama")
    d.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--out", required=True)
    d.set_defaults(func=cmd_demo_model)

    g = sub.add_parser("generate", help="generate text for one prompt")
    g.add_argument(
        "--model", default=None, help="local HF checkpoint dir or .gguf file (default: demo model)"
    )
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    g.add_argument("--json", action="store_true", help="print ids, text, finish reason, timing")
    g.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto")
    _add_engine_flags(g)
    g.add_argument("--device", default="auto")
    g.add_argument("--kv-cache-mb", type=int, default=256)
    _add_sampling_flags(g)
    g.set_defaults(func=cmd_generate)

    s = sub.add_parser("serve", help="serve the OpenAI API on Ray Serve (Ctrl-C stops)")
    s.add_argument(
        "--model", default=None, help="local HF checkpoint dir or .gguf file (default: topology's)"
    )
    s.add_argument("--topology", default=None, help="topology YAML (default: local.yaml)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--address", default=None, help="join this Ray cluster (default: start one)")
    _add_engine_flags(s)
    s.set_defaults(func=cmd_serve)

    st = sub.add_parser("status", help="the cluster as its router sees it (GET /v1/cluster)")
    st.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    st.add_argument("--json", action="store_true", help="print the raw JSON")
    st.set_defaults(func=cmd_status)

    tb = sub.add_parser("testbed", help="hosts in network namespaces on this machine (root)")
    tb_sub = tb.add_subparsers(dest="testbed_command", required=True)
    tb_up = tb_sub.add_parser("up", help="start the hosts (keeps a running bed of this shape)")
    tb_up.add_argument("--nodes", type=int, default=3)
    tb_up.add_argument("--domains", default=None, help="failure domains, comma-separated")
    tb_up.add_argument("--subnet", default=None, help="the bed's private subnet (10.213.0.0/24)")
    tb_up.set_defaults(func=cmd_testbed_up)
    tb_down = tb_sub.add_parser("down", help="remove every host, link, process and key")
    tb_down.set_defaults(func=cmd_testbed_down)
    # Commands of the packages above this one (`tandem chaos`): they add themselves through
    # the `tandem.commands` entry point, so this package imports none of them.
    for command in entry_points(group="tandem.commands"):
        command.load()(sub)
    return p


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    """Engine settings (on ``serve``: over every pool's; unset: the topology's own)."""
    p.add_argument(
        "--quantization",
        choices=["none", "int8"],
        default=None,
        help="int8: W8A8 linear layers (docs/design.md#quantization)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        choices=["auto", "int8"],
        default=None,
        help="int8: int8 KV cache, one scale per token and head (docs/design.md#int8-kv)",
    )
    p.add_argument(
        "--speculative",
        choices=["ngram"],
        default=None,
        help="ngram: prompt-lookup speculative decoding, exact (docs/design.md"
        "#speculative-decoding)",
    )
    p.add_argument(
        "--speculative-k", type=int, default=None, help="most draft tokens per step (default 4)"
    )
    p.add_argument(
        "--spare-threads",
        type=int,
        default=None,
        help="helpers per engine that compute part of a decode step's GEMMs on idle cores only "
        "(docs/design.md#spare-threads)",
    )


def _engine_settings(a: argparse.Namespace) -> dict[str, Any]:
    """The engine settings the flags set (none unset)."""
    settings: dict[str, Any] = {}
    if a.quantization:
        settings["quantization"] = a.quantization
    if a.kv_cache_dtype:
        settings["kv_cache_dtype"] = a.kv_cache_dtype
    if a.spare_threads is not None:
        settings["spare_threads"] = a.spare_threads
    if a.speculative_k is not None and not a.speculative:
        raise ValueError("--speculative-k needs --speculative")
    if a.speculative:
        spec = {"method": a.speculative}
        settings["speculative"] = spec if a.speculative_k is None else spec | {"k": a.speculative_k}
    return settings


def cmd_testbed_up(a: argparse.Namespace) -> int:
    """Start the bed; print its hosts as JSON (name, address, domain) and the key's path, and
    the ``ray up`` line for the cluster file it wrote for them."""
    from tandem import testbed

    domains = a.domains.split(",") if a.domains else None
    try:
        bed = testbed.up(a.nodes, domains, subnet=a.subnet or testbed.SUBNET)
    except testbed.TestbedUnavailable as e:
        print(f"tandem: testbed unavailable: {e}", file=sys.stderr)
        return 1
    print(json.dumps(testbed.to_json(bed), indent=2))
    print(f"ray up {bed.cluster_file}   # this bed's cluster", file=sys.stderr)
    return 0


def cmd_testbed_down(a: argparse.Namespace) -> int:
    from tandem import testbed

    testbed.down()
    return 0


STATUS_COLUMNS = (
    ("name", "worker"),
    ("role", "role"),
    ("domain", "domain"),
    ("state", "state"),
    ("running", "running"),
    ("queue_depth", "queued"),
    ("kv_usage", "kv used"),
    ("cached_blocks", "cached blocks"),
)


def cmd_status(a: argparse.Namespace) -> int:
    """Print the router's view of the workers; 1 if the server does not answer it."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"{a.url.rstrip('/')}/v1/cluster", timeout=10) as reply:
            doc = json.load(reply)
    except urllib.error.HTTPError as e:
        print(
            f"tandem: {a.url}: HTTP {e.code}: {e.read().decode(errors='replace')}", file=sys.stderr
        )
        return 1
    except (urllib.error.URLError, OSError) as e:
        print(f"tandem: {a.url}: {e}", file=sys.stderr)
        return 1
    if a.json:
        print(json.dumps(doc, indent=2))
        return 0
    rows = [[_cell(w[key]) for key, _ in STATUS_COLUMNS] for w in doc["workers"]]
    heads = [head for _, head in STATUS_COLUMNS]
    widths = [max(len(x) for x in col) for col in zip(heads, *rows, strict=False)]
    for row in [heads, *rows]:
        print("  ".join(x.ljust(w) for x, w in zip(row, widths, strict=True)).rstrip())
    queue = doc["admission_queue"]
    print(
        f"status: {doc['status']}; admission queue: {queue['waiting']} waiting "
        f"(most: {queue['most_waiting']}); retry budget: {doc['retry_budget_tokens']:.1f}"
    )
    return 0


def _cell(value: object) -> str:
    return f"{value:.0%}" if isinstance(value, float) else str(value)


def cmd_serve(a: argparse.Namespace) -> int:
    from tandem.deployment import DEFAULT_TOPOLOGY
    from tandem.serve import serve_forever

    topology = Path(a.topology) if a.topology else DEFAULT_TOPOLOGY
    model = Path(a.model) if a.model else None
    return serve_forever(topology, model, a.host, a.port, a.address, _engine_settings(a))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from tandem.testbed import RemoteCommandFailed, TestbedUnavailable

    try:
        return int(args.func(args))
    except (ValueError, FileNotFoundError) as e:
        print(f"tandem: error: {e}", file=sys.stderr)
        return 2
    except TestbedUnavailable as e:  # one line: what is missing and how to get it
        print(f"tandem: the test bed cannot run here: {e}", file=sys.stderr)
        return 2
    except RemoteCommandFailed as e:
        print(f"tandem: error on the test bed: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
