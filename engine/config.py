"""Typed configuration objects: one per subsystem, validated when built, never mutated after."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

if TYPE_CHECKING:  # imported where used: the router and the ingress read configs without torch
    import torch

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
# The built-in demo checkpoints' sizes (engine/demo_model.py builds them; topologies name one).
DemoSize = Literal["test", "tiny", "small"]


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a decoder-only checkpoint, read from its ``config.json`` by the loader."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # e.g. Llama 3.x {"rope_type": "llama3", ...}
    attention_bias: bool  # Qwen2 has q/k/v bias
    mlp_bias: bool
    tie_word_embeddings: bool
    sliding_window: int | None  # Mistral; None means full attention
    dtype: torch.dtype  # the dtype the runner computes in (after --dtype resolution)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def kv_bytes_per_token(self, kv_cache_dtype: str = "auto") -> int:
        """KV cache bytes per token (docs/design.md#kv-paging): 2 * layers * kv_heads * the
        bytes of one head's row (``head_dim`` elements; int8: plus its 4-byte scale)."""
        from engine.kv_layout import KVLayout

        return KVLayout.for_model(self, 1, kv_cache_dtype).bytes_per_token


class ConfigSection(BaseModel):
    """Base of every section of a topology, plan or service config: frozen once built, and an
    unknown key (a typo in the file) or an inf / NaN is an error naming it."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class SpeculativeConfig(ConfigSection):
    """n-gram (prompt-lookup) speculative decoding (docs/design.md#speculative-decoding): drafts
    copied from the sequence's own context, verified in one forward, accepted while they are
    what the sampler draws -- the output is bitwise the output without speculation."""

    method: Literal["ngram"] = Field("ngram", description="where drafts come from: 'ngram' only")
    k: int = Field(8, ge=1, le=16, description="most draft tokens verified per step")
    min_n: int = Field(
        2,
        ge=1,
        description="shortest context suffix looked up: a one-token match is right too rarely "
        "to pay for its verification (bench/spec_bench.py)",
    )
    max_n: int = Field(4, ge=1, description="longest context suffix looked up (tried first)")
    threshold: float = Field(
        0.2,
        ge=0.0,
        le=1.0,
        description="draft d tokens only while the chance that all d are accepted, estimated "
        "from the request's own acceptance so far ((accepted + 1) / (drafted + 2), to the d-th "
        "power), is at least this: a request whose drafts keep failing (text with nothing to "
        "copy) stops paying for them",
    )
    max_batch: int = Field(
        8,
        ge=1,
        description="speculate only while a step runs at most this many sequences: verifying k "
        "drafts costs about one step where the step is weight-bound (small batches), and k more "
        "rows of compute where it is not",
    )

    @model_validator(mode="after")
    def _ordered(self) -> SpeculativeConfig:
        if self.min_n > self.max_n:
            raise ValueError(f"speculative: min_n={self.min_n} > max_n={self.max_n}")
        return self


class EngineConfig(BaseModel):
    """Limits of one engine instance (scheduler + KV cache + runner)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    block_size: int = Field(16, ge=1, le=256, description="tokens per KV block; 16 as vLLM")
    kv_cache_bytes: int = Field(
        512 * 2**20, ge=2**16, description="bytes of KV cache on the device; sets the block count"
    )
    swap_space_bytes: int = Field(
        256 * 2**20, ge=0, description="bytes of host memory for swapped-out KV blocks"
    )
    max_num_seqs: int = Field(64, ge=1, description="most sequences in one batch (batch slots)")
    max_num_batched_tokens: int = Field(
        2048, ge=1, description="token budget of one step, shared by prefill chunks and decodes"
    )
    max_model_len: int | None = Field(
        None, ge=1, description="context limit in tokens; None takes the model's maximum"
    )
    enable_chunked_prefill: bool = Field(True, description="split long prompts across steps")
    enable_prefix_caching: bool = Field(True, description="reuse KV of identical token prefixes")
    preemption_mode: Literal["recompute", "swap"] = Field(
        "recompute", description="how to free KV when blocks run out (docs/design.md#preemption)"
    )
    scheduling_policy: Literal["fcfs", "priority"] = Field("fcfs", description="admission order")
    admission_policy: Literal["queue", "reject", "degrade"] = Field(
        "queue",
        description="when a KV reservation does not fit: wait in QUEUED (until the deadline), "
        "REJECT at once, or admit DEGRADED with a reservation shrunk to what fits",
    )
    batching: Literal["continuous", "static"] = Field(
        "continuous", description="static refills only when the whole batch is done (baseline)"
    )
    admission_output_tokens: int | None = Field(
        None,
        ge=0,
        description="predicted output length reserved at admission; None reserves max_tokens",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="compute dtype; auto keeps the checkpoint's"
    )
    device: str = Field("auto", description="'auto' picks cuda when present, else cpu")
    attention_backend: Literal["auto", "sdpa", "cpu_kernel"] = Field(
        "auto",
        description="decode attention: 'cpu_kernel' is the compiled C++ paged kernel (reads K/V "
        "in place, 3-9x faster per call than gathering for SDPA; bf16 follows torch's "
        "flash-attention numerics), 'sdpa' gathers the blocks for PyTorch SDPA; 'auto' (and "
        "'cpu_kernel' where the kernel cannot run: CUDA, no compiler) means the kernel on CPU "
        "where it builds, else sdpa",
    )
    deterministic: bool = Field(
        True,
        description="batch-invariant numerics (docs/design.md#determinism): a request's tokens and "
        "logprobs are the same bits whatever shares its batch, however its prompt was chunked, "
        "cached or shipped, and after a migration. Every GEMM reduces in one order whatever the "
        "row count and every query's attention runs the same kernel in prefill and decode. "
        "Needs the compiled CPU kernels; the engine refuses to start without them (or on CUDA) "
        "unless this is false",
    )
    invariant_layout: Literal["auto", "tiles", "pairs", "columns"] = Field(
        "auto",
        description="the batch-invariant GEMM's reduction layout, which decides the bits "
        "(docs/design.md#numerics-classes): 'auto' is the fastest here -- AMX tiles on an "
        "AMX-BF16 CPU, bf16 pairs on an AVX512-BF16 one, 16-column FMA panels elsewhere; 'pairs' "
        "runs on AMX and AVX512-BF16 CPUs alike, for a cluster that mixes them; 'columns' is the "
        "portable one, one reduction order meant to give the same bits on AVX2 and AVX-512 CPUs "
        "(checked on AVX2 only so far; slower where the others run). A layout this CPU lacks is "
        "refused at start. Workers of different classes never share a request",
    )
    quantization: Literal["none", "int8"] = Field(
        "none",
        description="'int8': every linear layer but the LM head runs W8A8 (docs/design.md"
        "#quantization) -- weights quantized at load per output channel, activations per token "
        "at run time, products summed in int32: exact, so as batch-, thread- and CPU-invariant "
        "as the default; half the bf16 weight bytes. Needs the compiled int8 kernel; engines "
        "with and without it are different numerics classes (never paired)",
    )
    kv_cache_dtype: Literal["auto", "int8"] = Field(
        "auto",
        description="'int8': the KV cache holds int8 K and V with one fp32 scale per token and "
        "head, taken when the token's KV is written (docs/design.md#int8-kv) -- 1.88x the tokens "
        "of a bf16 cache in the same bytes (head_dim 64), read in place by the attention kernel, "
        "shipped as is; a token's bytes depend on that token alone, so the deterministic-"
        "serving guarantees hold. 'auto': the model's dtype. Needs the compiled attention "
        "kernel; engines with and without it are different numerics classes (never paired)",
    )
    speculative: SpeculativeConfig | None = Field(
        None,
        description="n-gram speculative decoding (docs/design.md#speculative-decoding); None: off. "
        "Exact: a request's tokens and logprobs are the same bits with it on",
    )
    num_threads: int | None = Field(
        None,
        ge=1,
        description="torch threads of an AsyncLLMEngine's steps; set, its engine thread holds "
        "the process's only multi-threaded OpenMP team (the checkpoint loads single-threaded: "
        "a second team, e.g. the loader's, makes libgomp throttle its spin-waits, and every "
        "step then pays futex wake-ups: 57 -> 84 ms per batch-64 step on 2 cores, measured). "
        "None: torch's default, nothing changed",
    )

    spare_threads: int = Field(
        0,
        ge=0,
        le=64,
        description="helper threads that compute part of a few-row (decode) GEMM only while a "
        "core is otherwise idle: the lowest priority (SCHED_IDLE), and the engine's thread takes "
        "back what a helper stalls on, so a lone request's step gets the cores other workers "
        "leave idle; an engine holding more than 8 requests (a busy machine) computes alone. "
        "The same bits either way. CPU "
        "with the native kernels (int8 and the invariant GEMM); one pool per process; 0: none "
        "(docs/design.md#spare-threads)",
    )

    def resolve_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)
