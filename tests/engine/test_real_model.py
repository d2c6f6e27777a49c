"""A real trained model, SmolLM2-135M-Instruct (Llama architecture, 30 layers, tied embeddings,
a real chat template), besides the random checkpoints: Tandem's engine generates what
transformers generates, token for token (fp32, greedy), and in bf16 it answers a question."""

from __future__ import annotations

from pathlib import Path

import torch
from helpers import assert_engine_clean

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.request import FinishReason
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer

OUT = 24
PROMPTS = ["The three primary colours are", "def fibonacci(n):\n    "]


def chat(tokenizer: Tokenizer, question: str) -> list[int]:
    return tokenizer.encode_chat([{"role": "user", "content": question}])


def test_the_checkpoint_is_smollm2(smollm2: Path) -> None:
    config = LLMEngine.from_checkpoint(smollm2, EngineConfig(kv_cache_bytes=2**22)).model_config
    assert (config.architecture, config.num_hidden_layers, config.hidden_size) == (
        "LlamaForCausalLM",
        30,
        576,
    )
    assert (config.num_attention_heads, config.num_key_value_heads) == (9, 3)
    assert config.tie_word_embeddings and config.vocab_size == 49152


def test_greedy_equals_transformers_in_fp32(smollm2: Path) -> None:
    from transformers import AutoModelForCausalLM

    tokenizer = Tokenizer(smollm2)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    prompts.append(chat(tokenizer, "What is the capital of France?"))
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # ignore_eos, as the engine runs below
    refs = []
    with torch.inference_mode():
        for p in prompts:
            out = model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=OUT)
            refs.append(out[0, len(p) :].tolist())
    engine = LLMEngine.from_checkpoint(smollm2, EngineConfig(dtype="float32", kv_cache_bytes=2**24))
    params = SamplingParams(temperature=0.0, max_tokens=OUT, ignore_eos=True)
    got = [out.token_ids for [out] in engine.generate(prompts, params)]
    assert got == refs
    assert_engine_clean(engine)


def test_it_answers_a_question_in_bf16(smollm2: Path) -> None:
    engine = LLMEngine.from_checkpoint(
        smollm2, EngineConfig(dtype="bfloat16", kv_cache_bytes=2**24)
    )
    tokenizer = Tokenizer(smollm2)
    [[out]] = engine.generate(
        [chat(tokenizer, "What is the capital of France?")],
        SamplingParams(temperature=0.0, max_tokens=32),
    )
    assert "Paris" in out.text and out.finish_reason is FinishReason.EOS
    assert_engine_clean(engine)
