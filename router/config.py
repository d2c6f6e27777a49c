"""The router's configuration: one pydantic model, the topology's ``router`` section."""

from __future__ import annotations

from pydantic import Field

from contracts.routing import HOLD_RENEW_S
from engine.config import ConfigSection


class RouterWeights(ConfigSection):
    """Weights of the router's cost terms (router/policy.py); the lowest weighted sum wins. One
    unit of cost is one request ahead in a replica's queue."""

    queue_depth: float = Field(1.0, ge=0, description="per queued+running request")
    uncached_prefill_tokens: float = Field(
        0.01,
        ge=0,
        description="per prompt token the worker's prefix cache does not hold (0.01: 100 "
        "tokens to compute weigh as much as one request ahead)",
    )
    kv_usage: float = Field(
        4.0, ge=0, description="per unit of KV-cache fraction in use: what a full cache costs"
    )
    domain_spread: float = Field(
        0.5, ge=0, description="paid by a decode replica in its prefill replica's failure domain"
    )


class AdmissionConfig(ConfigSection):
    """The cluster's admission queue (router/admission.py)."""

    max_queued: int = Field(
        1024,
        ge=0,
        description="most requests waiting for capacity; one more is refused with 429 and "
        "Retry-After before its first byte (P9: never an unbounded queue). 0: refuse at once "
        "whenever the cluster is full",
    )
    predict_wait: bool = Field(
        True,
        description="refuse (503 + Retry-After) a request whose predicted wait in the queue, "
        "from the recent admission rate, is longer than the time left to its deadline",
    )
    unavailable_wait_s: float = Field(
        30.0,
        gt=0,
        description="how long a request waits while nothing can serve it (the router "
        "restarting, or every worker of a role it needs FAILED) before it is refused with 503 "
        "and Retry-After; capacity waits are bounded by the queue and the deadline instead",
    )
    holder_timeout_s: float = Field(
        30.0,
        ge=3 * HOLD_RENEW_S,
        description="a grant whose coordinator (an ingress replica) has not renewed its hold "
        "for this long is released: a replica that dies with requests admitted leaks no batch "
        "slot, block or per-tenant count (coordinators renew every "
        f"{HOLD_RENEW_S:g} s)",
    )


class RouterConfig(ConfigSection):
    weights: RouterWeights = Field(default_factory=RouterWeights)
    herding_guard: int = Field(
        8,
        ge=0,
        description="most load (queued+running) a replica may carry above its pool's "
        "least-loaded replica before its cache affinity stops counting",
    )
    local_prefill_max_tokens: int = Field(
        64,
        ge=0,
        description="uncached prompts this short are prefilled on the decode worker (shipping "
        "their KV costs more than computing it); 0 = never",
    )
    reserve_decode_first: bool = Field(
        True,
        description="the coordinator reserves the decode worker's batch slot and KV blocks "
        "(in its engine) before the prefill starts, so a prefill's KV never waits for room; "
        "false: the prefill starts first and the decode side parks the import until it has "
        "room (kept to measure what the reservation costs: bench/reserve_bench.py)",
    )
    share_prompts: bool = Field(
        True,
        description="the n choices of a request prefill their prompt once: the first on a "
        "prefill worker, the others on its decode worker, on the cached prompt blocks they then "
        "share (cluster/prompt_share.py); false: each choice prefills on its own (kept to "
        "measure what sharing saves: bench/choices_bench.py)",
    )
    admission: AdmissionConfig = Field(
        default_factory=AdmissionConfig,
        description="the cluster's admission queue (router/admission.py)",
    )
