"""An engine with int8 weights (``quantization: int8``, docs/design.md#quantization) keeps the
deterministic-serving guarantees: a request's tokens and every logprob are the same bits alone
and among random others with any chunking, and it is its own numerics class (never paired with a
bf16 engine). Where the kernel cannot run, the engine refuses to start, saying why."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from engine import kernels
from engine.config import EngineConfig
from engine.engine import CompletionOutput, LLMEngine
from engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
SEEDED = SamplingParams(
    temperature=0.9, top_p=0.95, seed=5, max_tokens=12, ignore_eos=True, logprobs=3
)


def int8_engine(path: Path, **kw: object) -> LLMEngine:
    base: dict[str, object] = {"dtype": "bfloat16", "kv_cache_bytes": 2**24, "max_num_seqs": 64}
    config = EngineConfig(**{**base, **kw, "quantization": "int8"})  # type: ignore[arg-type]
    return LLMEngine.from_checkpoint(path, config)


def key(out: CompletionOutput) -> tuple[object, ...]:
    assert out.logprobs is not None
    return (tuple(out.token_ids), tuple((lp.logprob, tuple(lp.top)) for lp in out.logprobs))


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_an_int8_request_is_the_same_bits_alone_and_among_others(
    bf16_llama: Path, params: SamplingParams
) -> None:
    target = [(37 * i + 11) % 2000 + 8 for i in range(90)]
    [[out]] = int8_engine(bf16_llama, enable_prefix_caching=False).generate([target], params)
    reference = key(out)
    rng = random.Random(3)
    for budget in (16, 512):
        engine = int8_engine(bf16_llama, max_num_batched_tokens=budget)
        others = [[rng.randrange(8, 2000) for _ in range(rng.randrange(1, 120))] for _ in range(12)]
        other = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
        for prompt in others[:6]:
            engine.add_request(engine.make_request(prompt, other))
        engine.step()
        rid = engine.add_request(engine.make_request(target, params))
        for prompt in others[6:]:
            engine.add_request(engine.make_request(prompt, other))
        while engine.has_unfinished():
            engine.step()
        done = {o.request_id: o for o in engine.finished_outputs()}
        assert key(done[rid]) == reference, budget


def test_int8_weights_are_their_own_numerics_class(bf16_llama: Path) -> None:
    quantized = int8_engine(bf16_llama).runner.model
    plain = LLMEngine.from_checkpoint(
        bf16_llama, EngineConfig(dtype="bfloat16", kv_cache_bytes=2**22)
    )
    layout = kernels.invariant_layouts()[0]
    assert quantized.numerics == f"bfloat16/int8/{layout}"
    assert plain.runner.model.numerics == f"bfloat16/invariant/{layout}"
    assert quantized.layers[0].qkv.mode == "int8" and quantized.lm_head.mode == "invariant"


def test_without_the_kernel_int8_is_refused(
    bf16_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = kernels.load
    monkeypatch.setattr(kernels, "load", lambda name: None if name == "int8_linear" else real(name))
    with pytest.raises(ValueError, match="quantization int8 needs the compiled int8_linear kernel"):
        int8_engine(bf16_llama)
