"""A chaos plan: the load to send, the faults to inject while it runs, and the thresholds the
run is judged by. One YAML file, validated here; every error names the file and the field.

    name: smoke
    load:
      arrivals: {process: poisson, rate: 4, duration_s: 60}
      sampling: [{weight: 1}, {weight: 1, temperature: 0.8, top_p: 0.95, seed: true}]
    faults:
      - {kind: kill_worker, at_s: 15, target: {role: decode}}
      - {kind: kv_fault, at_s: 30, action: corrupt, target: {role: prefill}}
    checks: {max_hung: 0}

Times are seconds from the first request's scheduled send. Where a fault names a request
phase (``phase``) rather than only a time, it is armed at ``at_s`` and fires when the next
request on its worker reaches that phase.
"""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Annotated, Literal, get_args

from pydantic import Field, field_validator, model_validator

from contracts.faults import FaultAction
from contracts.roles import Role
from engine.config import ConfigSection
from tandem.topology import parse_yaml

PLANS_DIR = Path(__file__).resolve().parents[1] / "deploy" / "chaos"


class PlanError(ValueError):
    """A plan file that cannot be read or does not validate; the message names the field."""


# -- the load ----------------------------------------------------------------------------------


class Arrivals(ConfigSection):
    process: Literal["poisson", "gamma", "trace", "closed"] = Field(
        "poisson",
        description="open-loop inter-arrival times: exponential (poisson), gamma with shape "
        "`burstiness` (bursty below 1), or a trace's timestamps; or closed: `concurrency` "
        "clients, each sending its next request when the last one ended (a fleet of "
        "clients; a dropped one comes back at once)",
    )
    concurrency: int = Field(8, ge=1, le=1024, description="clients of a closed loop")
    rate: float = Field(2.0, gt=0, description="mean requests per second (poisson, gamma)")
    burstiness: float = Field(1.0, gt=0, description="gamma shape; 1 is a Poisson process")
    duration_s: float = Field(60.0, gt=0, le=24 * 3600, description="how long requests are sent")
    trace: Path | None = Field(
        None,
        description="JSONL of {timestamp (ms), input_length, output_length} (the Mooncake "
        "format): send times and lengths replayed, lengths capped by `prompts`",
    )
    trace_speedup: float = Field(1.0, gt=0, description="trace time divided by this")
    max_requests: int = Field(10_000, ge=1, description="a bound on the requests of one run")

    @model_validator(mode="after")
    def _trace_named(self) -> Arrivals:
        if (self.process == "trace") != (self.trace is not None):
            raise ValueError("process: trace needs a trace file, and a trace file needs it")
        return self


class Prompts(ConfigSection):
    words: tuple[int, int] = Field(
        (8, 48), description="prompt length in words (min, max), uniform; one word ~1-2 tokens"
    )
    output_tokens: tuple[int, int] = Field((16, 48), description="max_tokens (min, max), uniform")
    shared_prefix_groups: int = Field(
        0, ge=0, description="requests draw one of this many shared prefixes (0: none)"
    )
    shared_prefix_words: int = Field(24, ge=1, description="length of each shared prefix")
    tenants: int = Field(1, ge=1, description="requests spread over this many tenants (API keys)")

    @model_validator(mode="after")
    def _ranges(self) -> Prompts:
        for name in ("words", "output_tokens"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise ValueError(f"{name}: ({low}, {high}) must be 1 <= min <= max")
        return self


# A structured request's grammar: one of chaos.structured's fixed ones, by kind (a JSON
# schema, a regex, a choice of words, or a forced call of one of two tools).
Structured = Literal["json_schema", "regex", "choice", "tool"]


class Sampling(ConfigSection):
    """One kind of request in the mix."""

    weight: float = Field(1.0, gt=0, description="relative share of requests of this kind")
    temperature: float = Field(0.0, ge=0, description="0: greedy")
    top_p: float = Field(1.0, gt=0, le=1)
    seed: bool = Field(False, description="send a per-request seed (reproducible sampling)")
    stop: list[str] = Field(default_factory=list, description="stop strings")
    n: int = Field(1, ge=1, le=8, description="choices per request")
    structured: Structured | None = Field(
        None,
        description="hold the output to this kind's fixed grammar (chaos.structured), sent as "
        "vLLM's `structured_outputs`; None: free text",
    )
    output_tokens: tuple[int, int] | None = Field(
        None,
        description="max_tokens (min, max) of this kind, uniform (None: the prompts' range); "
        "a structured output needs room to end by itself",
    )

    @model_validator(mode="after")
    def _checked(self) -> Sampling:
        if (
            self.output_tokens is not None
            and not 1 <= self.output_tokens[0] <= self.output_tokens[1]
        ):
            raise ValueError(f"output_tokens: {self.output_tokens} must be 1 <= min <= max")
        if self.structured is not None and self.stop:
            # A stop string would end a structured output before its grammar does.
            raise ValueError(
                f"stop: {self.stop} beside structured: {self.structured} (one or the other)"
            )
        return self


class Cancel(ConfigSection):
    fraction: float = Field(0.0, ge=0, le=1, description="share of streams the client drops")
    after_tokens: tuple[int, int] = Field(
        (1, 8), description="the client hangs up after this many tokens (min, max), uniform"
    )


class Load(ConfigSection):
    arrivals: Arrivals = Field(default_factory=Arrivals)
    prompts: Prompts = Field(default_factory=Prompts)
    sampling: list[Sampling] = Field(default_factory=lambda: [Sampling()], min_length=1)
    stream_fraction: float = Field(1.0, ge=0, le=1, description="share of streaming requests")
    cancel: Cancel = Field(default_factory=Cancel)
    deadline_s: float | None = Field(
        None, gt=0, description="each request's X-Request-Timeout; None: no deadline"
    )
    seed: int = Field(0, description="seeds the schedule, the prompts and the fault targets")


# -- the faults --------------------------------------------------------------------------------


class Target(ConfigSection):
    """Which worker a fault hits: by name, else one (drawn with the plan's seed) of those
    matching role and domain."""

    name: str | None = Field(None, description="a worker name, e.g. decode-0")
    role: Role | None = Field(None, description="prefill, decode or colocated")
    domain: str | None = Field(None, description="a failure domain of the topology")


class Phase(StrEnum):
    """Where in a request's life a worker fault fires (armed at ``at_s``; the next request
    on the worker to get there meets it)."""

    QUEUED = "queued"  # the worker a request has just reached, before any of it is computed
    MID_PREFILL = "mid_prefill"  # the prefill worker, half-way through a prompt's layers
    MID_TRANSFER = "mid_transfer"  # the prefill worker, between KV chunks it sends
    FIRST_TOKEN = "first_token"  # the decode worker, at a request's first decode token
    MID_DECODE = "mid_decode"  # the decode worker, eight tokens into a request


class _Timed(ConfigSection):
    at_s: float = Field(ge=0, description="seconds after the first request's send time")


class KillWorker(_Timed):
    kind: Literal["kill_worker"]
    target: Target = Field(default_factory=Target)
    phase: Phase | None = Field(None, description="fire at this request phase (else at once)")


class HangWorker(_Timed):
    kind: Literal["hang_worker"]
    target: Target = Field(default_factory=Target)
    duration_s: float = Field(8.0, gt=0, description="SIGSTOP, then SIGCONT after this long")


class SlowWorker(_Timed):
    """A worker on a starved machine: its process is stopped for ``stopped_share`` of every
    ``period_s`` (SIGSTOP / SIGCONT), so its steps and heartbeats run that much slower."""

    kind: Literal["slow_worker"]
    target: Target = Field(default_factory=Target)
    duration_s: float = Field(10.0, gt=0)
    stopped_share: float = Field(0.5, gt=0, lt=1)
    period_s: float = Field(0.1, gt=0, le=1)


class HangRouter(_Timed):
    """The router process paused (SIGSTOP, then SIGCONT): a long GC pause, a frozen VM. No
    worker is down; a request must not fail for it, nor a worker be marked FAILED (P16)."""

    kind: Literal["hang_router"]
    duration_s: float = Field(10.0, gt=0, description="SIGSTOP, then SIGCONT after this long")


class SlowRouter(_Timed):
    """The router on a starved machine: stopped ``stopped_share`` of every ``period_s``."""

    kind: Literal["slow_router"]
    duration_s: float = Field(10.0, gt=0)
    stopped_share: float = Field(0.5, gt=0, lt=1)
    period_s: float = Field(0.1, gt=0, le=2)


# What a kv_fault may do to a KV stream: contracts.faults' vocabulary, the sender's data faults.
KV_ACTIONS = (FaultAction.CORRUPT, FaultAction.TRUNCATE, FaultAction.DROP, FaultAction.STALL)


class KVFault(_Timed):
    kind: Literal["kv_fault"]
    action: FaultAction = Field(description="corrupt, truncate, drop or stall (contracts.faults)")
    target: Target = Field(default_factory=lambda: Target(role=Role.PREFILL))
    transfers: int = Field(1, ge=1, le=100, description="how many transfers it spoils")
    stall_s: float = Field(2.0, gt=0)

    @field_validator("action")
    @classmethod
    def _a_data_fault(cls, action: FaultAction) -> FaultAction:
        if action not in KV_ACTIONS:
            raise ValueError(f"{action} is not one of {', '.join(KV_ACTIONS)}")
        return action


class KillRouter(_Timed):
    kind: Literal["kill_router"]


class KillIngress(_Timed):
    kind: Literal["kill_ingress"]


class AbortStorm(_Timed):
    kind: Literal["abort_storm"]
    fraction: float = Field(0.5, gt=0, le=1, description="share of open streams dropped at once")
    min_open: int = Field(
        0, ge=0, description="wait (up to 30 s) until at least this many streams are open"
    )


class CancelRace(_Timed):
    """A client hangs up while its decode worker dies: both ends race to free its KV."""

    kind: Literal["cancel_race"]
    target: Target = Field(default_factory=lambda: Target(role=Role.DECODE))
    streams: int = Field(2, ge=1, description="streams on the worker dropped as it is killed")


class Churn(_Timed):
    kind: Literal["churn"]
    every_s: float = Field(30.0, gt=0, description="one random worker killed this often")
    for_s: float = Field(600.0, gt=0, description="from at_s, for this long")
    roles: list[Role] = Field(default_factory=lambda: [Role.PREFILL, Role.DECODE])


_BUSY = (
    "from at_s, wait up to this long until a request runs on a worker of the host(s), so the "
    "fault strikes streams in flight (0: strike at at_s)"
)


class HostFault(_Timed):
    """Test bed only (``--testbed``): a whole host."""

    kind: Literal["kill_host", "partition_host"]
    host: int = Field(ge=1, description="the bed host's index (0 is the head: never a target)")
    duration_s: float = Field(8.0, gt=0, description="until healed / booted again")
    busy_s: float = Field(0.0, ge=0, le=120, description=_BUSY)


class LoseDomain(_Timed):
    """Test bed only: every host of a failure domain dies at once."""

    kind: Literal["lose_domain"]
    domain: str
    duration_s: float = Field(20.0, gt=0, description="until its hosts boot again")
    busy_s: float = Field(0.0, ge=0, le=120, description=_BUSY)


Fault = Annotated[
    KillWorker
    | HangWorker
    | SlowWorker
    | KVFault
    | KillRouter
    | HangRouter
    | SlowRouter
    | KillIngress
    | AbortStorm
    | CancelRace
    | Churn
    | HostFault
    | LoseDomain,
    Field(discriminator="kind"),
]


# -- the verdict -------------------------------------------------------------------------------


class Checks(ConfigSection):
    max_hung: int = Field(0, ge=0, description="requests still open after deadline + hang_bound")
    hang_bound_s: float = Field(
        60.0, gt=0, description="a request must end within its deadline (else its send) + this"
    )
    max_mismatches: int = Field(0, ge=0, description="outputs unequal to the reference engine's")
    min_non_targeted_success: float = Field(
        0.999, ge=0, le=1, description="success share of requests no fault touched"
    )
    max_failed: int | None = Field(
        None,
        ge=0,
        description="requests that may end in an error, touched by a fault or not (None: only "
        "the non-targeted success share is checked); 0 for faults no request may fail for",
    )
    max_detect_kill_s: float = Field(1.0, gt=0, description="a killed process marked FAILED")
    max_detect_hang_margin_s: float = Field(
        1.0, gt=0, description="a hung worker marked FAILED within heartbeat timeout + this"
    )
    max_stranded_s: float = Field(
        1.0,
        gt=0,
        description="the longest a survivor may hold an attempt's KV after its peer died "
        "(stranded block-seconds <= this x the attempt's blocks)",
    )
    max_recovery_s: float | None = Field(
        None, gt=0, description="throughput and p99 TTFT back within 10% of the steady window"
    )
    settle_s: float = Field(
        60.0, gt=0, description="after the load: how long pools may take to return to baseline"
    )
    max_dispatch_delay_s: float = Field(
        5.0,
        gt=0,
        description="the latest a request may leave this client after its scheduled send: a "
        "client that stalls longer did not send the load (nor time the faults) the plan says",
    )
    load_only: bool = Field(
        False,
        description="a plan without faults: also no KV lease may expire, no transfer be "
        "aborted, no attempt be retried or migrated (load alone costs no prompt twice; P9)",
    )
    transformers_greedy: bool = Field(
        False,
        description="also check each greedy request's token ids against transformers' greedy "
        "generation on the same checkpoint (a reference outside Tandem's engine; exact only in "
        "float32: the run refuses another dtype)",
    )


class ChaosPlan(ConfigSection):
    name: str = Field(min_length=1)
    description: str = ""
    load: Load = Field(default_factory=Load)
    faults: list[Fault] = Field(default_factory=list)
    checks: Checks = Field(default_factory=Checks)
    testbed: bool = Field(False, description="needs a test bed (host faults): run with --testbed")
    topology: str | None = Field(
        None,
        description="the shipped topology (deploy/topologies/NAME.yaml) a run starts when no "
        "--topology is given (default: local-demo.yaml; testbed.yaml with --testbed)",
    )

    @model_validator(mode="after")
    def _host_faults_need_a_bed(self) -> ChaosPlan:
        for i, fault in enumerate(self.faults):
            if isinstance(fault, HostFault | LoseDomain) and not self.testbed:
                raise ValueError(f"faults.{i}: {fault.kind} needs `testbed: true`")
        return self


def fault_kinds() -> list[str]:
    """Every ``kind`` a plan's fault may have (a class may have several: HostFault)."""
    [members, _] = get_args(Fault)
    return [
        kind for cls in get_args(members) for kind in get_args(cls.model_fields["kind"].annotation)
    ]


def load_plan(path: str | Path) -> ChaosPlan:
    """Read and validate a plan file; a name without a path is a shipped plan
    (``deploy/chaos/NAME.yaml``). Raises PlanError naming the file and field."""
    file = Path(path)
    if not file.exists() and (PLANS_DIR / f"{path}.yaml").exists():
        file = PLANS_DIR / f"{path}.yaml"
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        raise PlanError(f"{path}: cannot read plan file: {exc.strerror}") from exc
    return parse_yaml(ChaosPlan, text, str(file), PlanError)


def shipped_plans() -> list[tuple[str, ChaosPlan]]:
    """The plans in ``deploy/chaos/``, by name."""
    return [(f.stem, load_plan(f)) for f in sorted(PLANS_DIR.glob("*.yaml"))]
