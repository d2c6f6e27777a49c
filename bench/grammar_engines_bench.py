"""The grammar engines for structured outputs, side by side on the CPU (issue 27: "each grammar
engine tried, and why the chosen one won"): llguidance (what Tandem uses), xgrammar and
outlines-core, on the real tokenizer (SmolLM2-135M-Instruct, 49,152 tokens).

    .venv/bin/python -m bench.grammar_engines_bench [--threads 2] [--repeats 3] [--batch-steps 16]

xgrammar and outlines-core are not Tandem dependencies; install them outside the venv and put
them on the path (the venv still provides torch, transformers, pydantic and numpy)::

    .venv/bin/python -m pip install --target /tmp/xg --no-deps xgrammar==0.2.8 apache-tvm-ffi
    .venv/bin/python -m pip install --target /tmp/oc --no-deps outlines-core==0.2.14
    PYTHONPATH=/tmp/xg:/tmp/oc .venv/bin/python -m bench.grammar_engines_bench

(xgrammar's triton dependency is only for its GPU logits kernel and is not needed here.) An
engine that cannot be imported is skipped with the reason printed.

Three grammars: the 20-field JSON schema of bench/structured_bench.py (written on one line with
", " and ": " where the engine allows it; outlines-core's whitespace pattern applies on both
sides of every separator, so it gets ``""``: "," and ":"), the regex ``[a-z]{256}`` and a date
regex. Per engine and grammar:

- **tokenizer**: building the engine's tokenizer view once (the HF tokenizer already loaded);
- **compile**: the grammar compiled cold (median of ``--repeats``; xgrammar: a fresh compiler
  each time, so its cache is empty), and **first mask**, cold and cached: compile (or cache
  hit) + a new matcher + its first mask -- what a request pays before its first token;
- **mask**: the single-row next-token mask at every position of one valid output (a fixed
  valid instance, tokenized by the HF tokenizer, fed one token at a time), median and p90 in
  microseconds; once on a fresh matcher (what one request sees) and again after a reset (warm);
- **batch**: 64 matchers spread over that output, then ``--batch-steps`` decode steps, each
  filling all 64 masks at once and advancing every matcher one token (new states each step: no
  engine can reuse a mask); the batched fill is llguidance's
  ``LLExecutor.unsafe_compute_mask_ptr`` (as engine/structured.py), xgrammar's
  ``BatchGrammarMatcher``; outlines-core has none (a loop). Median and p90 ms per step, at 1
  and ``--threads`` threads.

Every mask is checked to allow the output's next token (EOS at the end). Also a JSON-schema
feature probe (per keyword, a valid and an invalid value: "enforced", "IGNORED" when the invalid
one passes, or the engine's refusal), each engine's error for a bad schema or regex, its import
time in a fresh interpreter and its declared dependencies. Prints tables, writes
``bench/results/grammar_engines.json``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.grammar_engines import (
    MODEL_DIR,
    WORDS,
    Engine,
    load_engines,
    log,
)
from bench.machine import cpu_name
from bench.structured_bench import SCHEMA

RESULTS = Path(__file__).resolve().parent / "results"
BATCH = 64
DATE_RE = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
LETTERS_RE = "[a-z]{256}"

# The same schema without its strings' maxLength: what a bounded string costs an engine.
PROPERTIES: dict[str, dict[str, Any]] = SCHEMA["properties"]  # type: ignore[assignment]
SCHEMA_NO_MAXLEN = {
    **SCHEMA,
    "properties": {
        k: {f: v for f, v in p.items() if f != "maxLength"} for k, p in PROPERTIES.items()
    },
}

# (name, grammar kind, spec)
GRAMMARS: list[tuple[str, str, str]] = [
    ("json", "json_schema", json.dumps(SCHEMA)),
    ("json-nomax", "json_schema", json.dumps(SCHEMA_NO_MAXLEN)),
    ("regex", "regex", LETTERS_RE),
    ("date", "regex", DATE_RE),
]

# Schema features probed per engine: (name, schema, a valid value, an invalid one). An engine
# "enforces" a feature when it accepts the first and refuses the second; one that accepts both
# ignores the keyword silently.
OBJ_AB = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
FEATURES: list[tuple[str, dict[str, Any], Any, Any]] = [
    ("pattern", {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}, "ABC-1234", "abc-1234"),
    ("minLength/maxLength", {"type": "string", "minLength": 2, "maxLength": 8}, "abcd", "a"),
    ("enum (mixed types)", {"enum": ["a", 1, None, True]}, 1, 2),
    ("const", {"const": "fixed"}, "fixed", "other"),
    (
        "format: date-time",
        {"type": "string", "format": "date-time"},
        "2024-06-15T10:00:00Z",
        "yesterday",
    ),
    ("format: email", {"type": "string", "format": "email"}, "a.b@example.com", "not an email"),
    (
        "format: uuid",
        {"type": "string", "format": "uuid"},
        "123e4567-e89b-12d3-a456-426614174000",
        "1234",
    ),
    ("integer minimum/maximum", {"type": "integer", "minimum": 1, "maximum": 12}, 7, 13),
    ("number exclusiveMinimum", {"type": "number", "exclusiveMinimum": 0}, 1.5, -1),
    ("multipleOf", {"type": "integer", "multipleOf": 5}, 15, 7),
    (
        "array minItems/maxItems",
        {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
        [1, 2],
        [1, 2, 3, 4],
    ),
    (
        "uniqueItems",
        {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
        [1, 2],
        [1, 1],
    ),
    (
        "prefixItems",
        {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}], "items": False},
        ["a", 1],
        [1, "a"],
    ),
    ("anyOf", {"anyOf": [{"type": "string"}, {"type": "integer"}]}, 3, True),
    ("oneOf", {"oneOf": [{"type": "string"}, {"type": "integer"}]}, "x", True),
    ("allOf", {"allOf": [OBJ_AB, {"required": ["a"]}]}, {"a": 1}, {"b": 1}),
    ("optional properties", {**OBJ_AB, "required": ["a"]}, {"a": 1, "b": 2}, {"b": 2}),
    (
        "additionalProperties: schema",
        {"type": "object", "additionalProperties": {"type": "integer"}},
        {"k": 1},
        {"k": "v"},
    ),
    (
        "patternProperties",
        {
            "type": "object",
            "patternProperties": {"^x_": {"type": "integer"}},
            "additionalProperties": False,
        },
        {"x_a": 1},
        {"x_a": "s"},
    ),
    (
        "minProperties/maxProperties",
        {"type": "object", "minProperties": 1, "maxProperties": 2},
        {"a": 1},
        {},
    ),
    (
        "recursive $ref",
        {
            "$defs": {
                "node": {
                    "type": "object",
                    "properties": {
                        "v": {"type": "integer"},
                        "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}},
                    },
                    "required": ["v"],
                }
            },
            "$ref": "#/$defs/node",
        },
        {"v": 1, "kids": [{"v": 2}]},
        {"kids": []},
    ),
    (
        "if/then/else",
        {
            **OBJ_AB,
            "if": {"properties": {"a": {"const": 1}}, "required": ["a"]},
            "then": {"required": ["b"]},
        },
        {"a": 2},
        {"a": 1},
    ),
    ("not", {"not": {"type": "string"}}, 1, "s"),
]
BAD_INPUTS: list[tuple[str, str, str]] = [
    ("unknown type", "json_schema", json.dumps({"type": "strng"})),
    ("dangling $ref", "json_schema", json.dumps({"$ref": "#/$defs/missing"})),
    (
        "unsatisfiable (min > max)",
        "json_schema",
        json.dumps({"type": "integer", "minimum": 5, "maximum": 1}),
    ),
    ("bad regex", "regex", "[a-z"),
]


def ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3


# --- the outputs fed through each grammar ---------------------------------------------------


def json_instance(separators: tuple[str, str]) -> str:
    """One valid output for SCHEMA: each field by its type (string, integer, enum, boolean)."""
    values: list[Any] = []
    for i in range(20):
        values.append(
            [f"value number {i}", 1000 + 37 * i, ["red", "green", "blue"][i % 3], i % 8 == 3][i % 4]
        )
    return json.dumps({f"field_{i}": v for i, v in enumerate(values)}, separators=separators)


def output_text(grammar: str, separators: tuple[str, str]) -> str:
    if grammar.startswith("json"):
        return json_instance(separators)
    if grammar == "regex":
        return ("thequickbrownfoxjumpsoverthelazydog" * 8)[:256]
    return "2024-06-15"


# --- the engines: one adapter each ----------------------------------------------------------


def stats_us(samples_ns: Sequence[int]) -> dict[str, float]:
    a = np.asarray(samples_ns, dtype=np.float64) / 1e3
    return {
        "median": float(np.median(a)),
        "p90": float(np.percentile(a, 90)),
        "max": float(a.max()),
    }


def allowed(row: np.ndarray, token: int) -> bool:
    return bool((int(row[token // 32]) >> (token % 32)) & 1)


def walk(engine: Engine, m: Any, tokens: Sequence[int], eos: int) -> dict[str, Any]:
    """Mask, check, advance at every position of ``tokens`` (and the mask after the last: EOS
    must be allowed); the mask and advance times, the allowed-token counts."""
    row = np.zeros(WORDS, dtype=np.int32)
    mask_ns, adv_ns, counts = [], [], []
    for pos in range(len(tokens) + 1):
        t0 = time.perf_counter_ns()
        engine.mask(m, row)
        mask_ns.append(time.perf_counter_ns() - t0)
        counts.append(int(np.unpackbits(row.view(np.uint8)).sum()))
        want = tokens[pos] if pos < len(tokens) else eos
        if not allowed(row, want):
            raise RuntimeError(f"position {pos}: token {want} masked out")
        if pos < len(tokens):
            t0 = time.perf_counter_ns()
            engine.advance(m, tokens[pos])
            adv_ns.append(time.perf_counter_ns() - t0)
    return {
        "mask_us": stats_us(mask_ns),
        "advance_us": stats_us(adv_ns),
        "allowed_first": counts[0],
        "allowed_mean": float(np.mean(counts)),
        "allowed_last": counts[-1],
    }


def first_mask_ms(engine: Engine, kind: str, spec: str, cache: bool) -> float:
    """Compile (or hit the cache) + a new matcher + its first mask, in ms."""
    row = np.zeros(WORDS, dtype=np.int32)
    t0 = time.perf_counter()
    engine.mask(engine.matcher(engine.compile(kind, spec, cache)), row)
    return ms(t0)


def batch_ms(
    engine: Engine, compiled: Any, tokens: Sequence[int], eos: int, threads: int, steps: int
) -> dict[str, float]:
    """BATCH fresh matchers spread over the output (matcher i advanced through i/BATCH of it),
    then ``steps`` decode steps: fill all their masks at once (timed; every row checked to allow
    its next token), advance every matcher one token. The first fill, and the median and p90 of
    the fills after it (each at new states: no engine can reuse a mask)."""
    steps = min(steps, len(tokens))
    span = len(tokens) + 1 - steps
    starts = [i * span // BATCH for i in range(BATCH)]
    matchers = []
    for start in starts:
        m = engine.matcher(compiled)
        for t in tokens[:start]:
            engine.advance(m, t)
        matchers.append(m)
    out = np.zeros((BATCH, WORDS), dtype=np.int32)
    times = []
    for step in range(steps + 1):
        t0 = time.perf_counter()
        engine.batch_fill(matchers, out, threads)
        times.append(ms(t0))
        for i, (m, start) in enumerate(zip(matchers, starts, strict=True)):
            pos = start + step
            want = tokens[pos] if pos < len(tokens) else eos
            if not allowed(out[i], want):
                raise RuntimeError(f"batch row {i}, position {pos}: token {want} masked out")
            if step < steps:
                engine.advance(m, want)
    rest = np.asarray(times[1:])
    return {
        "first_ms": times[0],
        "median_ms": float(np.median(rest)),
        "p90_ms": float(np.percentile(rest, 90)),
    }


def bench_grammar(
    engine: Engine, hf: Any, grammar: str, kind: str, spec: str, args: argparse.Namespace
) -> dict[str, Any]:
    text = output_text(grammar, engine.separators)
    tokens = hf.encode(text, add_special_tokens=False)
    compile_ms = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        engine.compile(kind, spec, cache=False)
        compile_ms.append(ms(t0))
    cold = [first_mask_ms(engine, kind, spec, cache=False) for _ in range(args.repeats)]
    engine.compile(kind, spec, cache=True)  # warm the cache
    cached = [first_mask_ms(engine, kind, spec, cache=True) for _ in range(args.repeats)]
    compiled = engine.compile(kind, spec, cache=True)
    m = engine.matcher(compiled)
    fresh = walk(engine, m, tokens, hf.eos_token_id)
    engine.reset(m)
    warm = walk(engine, m, tokens, hf.eos_token_id)
    batches = {
        str(t): batch_ms(engine, compiled, tokens, hf.eos_token_id, t, args.batch_steps)
        for t in sorted({1, args.threads})
    }
    return {
        "output_chars": len(text),
        "output_tokens": len(tokens),
        "compile_ms": {"first": compile_ms[0], "median": float(np.median(compile_ms))},
        "first_mask_cold_ms": float(np.median(cold)),
        "first_mask_cached_ms": float(np.median(cached)),
        "fresh": fresh,
        "warm": {"mask_us": warm["mask_us"]},
        "batch64": batches,
    }


def accepts(engine: Engine, compiled: Any, hf: Any, value: Any) -> bool:
    """Whether a fresh matcher takes ``value`` (JSON, in the engine's separators) to the end."""
    text = json.dumps(value, separators=engine.separators)
    m = engine.matcher(compiled)
    row = np.zeros(WORDS, dtype=np.int32)
    for token in hf.encode(text, add_special_tokens=False):
        engine.mask(m, row)
        if not allowed(row, token):
            return False
        try:
            engine.advance(m, token)
        except Exception:
            return False
    engine.mask(m, row)
    return allowed(row, hf.eos_token_id)


def error_text(e: Exception) -> str:
    lines = str(e).strip().splitlines() or [""]
    return f"{type(e).__name__}: {lines[0][:200]}"


def probe_feature(engine: Engine, hf: Any, schema: dict[str, Any], good: Any, bad: Any) -> str:
    """'enforced', 'IGNORED' (the invalid value passes), 'REJECTS VALID' or 'refused: why'."""
    try:
        compiled = engine.compile("json_schema", json.dumps(schema), cache=False)
        engine.matcher(compiled)
    except Exception as e:
        return f"refused: {error_text(e)}"
    if not accepts(engine, compiled, hf, good):
        return "REJECTS VALID"
    return "IGNORED" if accepts(engine, compiled, hf, bad) else "enforced"


def probe_error(engine: Engine, kind: str, spec: str) -> str:
    """The engine's error for a bad grammar (its first line), or 'accepted'."""
    try:
        engine.matcher(engine.compile(kind, spec, cache=False))
        return "accepted"
    except Exception as e:
        return error_text(e)


def import_seconds(module: str) -> float | None:
    """Seconds to import ``module`` in a fresh interpreter (its dependencies included)."""
    code = f"import time; t = time.perf_counter(); import {module}; print(time.perf_counter() - t)"
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=os.environ.copy(),
        check=False,
    )
    return float(done.stdout.strip()) if done.returncode == 0 else None


def environment(engines: Sequence[Engine]) -> dict[str, Any]:
    cpu = cpu_name()
    versions: dict[str, str | None] = {}
    deps: dict[str, list[str]] = {}
    for dist in (
        "llguidance",
        "xgrammar",
        "outlines-core",
        "apache-tvm-ffi",
        "torch",
        "transformers",
        "numpy",
    ):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    for e in engines:
        requires = importlib.metadata.requires(e.package.replace("_", "-")) or []
        deps[e.name] = [r.split(";")[0].strip() for r in requires if "extra ==" not in r]
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "load_avg": os.getloadavg(),
        "python": platform.python_version(),
        "versions": versions,
        "dependencies": deps,
    }


# --- report ---------------------------------------------------------------------------------


def table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def report(out: dict[str, Any], threads: int) -> None:
    env = out["environment"]
    print(
        f"\nCPU: {env['cpu']} ({env['cores']} cores, load {env['load_avg'][0]:.2f}), "
        f"python {env['python']}"
    )
    print("versions: " + ", ".join(f"{k} {v}" for k, v in env["versions"].items() if v))
    print("\ntokenizer view built once (ms); import (s, fresh interpreter):")
    for name, r in out["engines"].items():
        print(f"  {name:14s} {r['tokenizer_ms']:8.1f} ms   import {r['import_s'] or 0:.2f} s")
    head = [
        "engine",
        "grammar",
        "toks",
        "compile ms",
        "1st mask cold ms",
        "1st mask cached ms",
        "mask us med/p90",
        "warm us med/p90",
        "advance us med",
        "allowed@0",
        "batch64 ms/step 1 thr med/p90",
        f"batch64 ms/step {threads} thr med/p90",
    ]
    rows = [head]
    for name, r in out["engines"].items():
        for g, x in r["grammars"].items():
            if "error" in x:
                rows.append([name, g, "-", x["error"][:60]] + [""] * (len(head) - 4))
                continue
            b = x["batch64"]
            rows.append(
                [
                    name,
                    g,
                    str(x["output_tokens"]),
                    f"{x['compile_ms']['median']:.1f}",
                    f"{x['first_mask_cold_ms']:.1f}",
                    f"{x['first_mask_cached_ms']:.2f}",
                    f"{x['fresh']['mask_us']['median']:.1f}/{x['fresh']['mask_us']['p90']:.1f}",
                    f"{x['warm']['mask_us']['median']:.1f}/{x['warm']['mask_us']['p90']:.1f}",
                    f"{x['fresh']['advance_us']['median']:.1f}",
                    str(x["fresh"]["allowed_first"]),
                    f"{b['1']['median_ms']:.2f}/{b['1']['p90_ms']:.2f}",
                    f"{b[str(threads)]['median_ms']:.2f}/{b[str(threads)]['p90_ms']:.2f}",
                ]
            )
    print("\n" + table(rows))
    names = list(out["engines"])
    print("\nJSON-schema features (a valid and an invalid value each):")
    rows = [["feature", *names]]
    for feat, *_ in FEATURES:
        rows.append([feat, *(out["engines"][n]["features"][feat][:90] for n in names)])
    print(table(rows))
    print("\nerrors for bad grammars:")
    for bad, _, _ in BAD_INPUTS:
        print(f"  {bad}:")
        for n in names:
            print(f"    {n:14s} {out['engines'][n]['bad_inputs'][bad]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 1,
        help="threads of the batched fills and of xgrammar's compiler",
    )
    ap.add_argument("--repeats", type=int, default=3, help="cold compiles per grammar")
    ap.add_argument("--batch-steps", type=int, default=16, help="timed batched fills")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    t0 = time.perf_counter()
    hf = AutoTokenizer.from_pretrained(MODEL_DIR)
    log(f"HF tokenizer loaded in {ms(t0):.0f} ms ({len(hf)} tokens, eos {hf.eos_token_id})")
    engines, skipped = load_engines(args.threads)
    out: dict[str, Any] = {
        "environment": environment(engines),
        "skipped": skipped,
        "threads": args.threads,
        "engines": {},
    }
    for engine in engines:
        t0 = time.perf_counter()
        engine.build_tokenizer(hf)
        r: dict[str, Any] = {
            "tokenizer_ms": ms(t0),
            "batch_api": engine.batch_api,
            "json_separators": list(engine.separators),
            "import_s": import_seconds(engine.package),
            "grammars": {},
        }
        log(f"{engine.name}: tokenizer view in {r['tokenizer_ms']:.0f} ms")
        for grammar, kind, spec in GRAMMARS:
            try:
                r["grammars"][grammar] = bench_grammar(engine, hf, grammar, kind, spec, args)
            except Exception as e:
                r["grammars"][grammar] = {"error": f"{type(e).__name__}: {e}"}
            log(f"{engine.name}/{grammar}: done")
        r["features"] = {f: probe_feature(engine, hf, s, good, bad) for f, s, good, bad in FEATURES}
        r["bad_inputs"] = {b: probe_error(engine, k, s) for b, k, s in BAD_INPUTS}
        log(f"{engine.name}: feature probes done")
        out["engines"][engine.name] = r
    report(out, args.threads)
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / "grammar_engines.json"
    path.write_text(json.dumps(out, indent=2))
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
