"""What a worker does and what carries KV between workers: the one definition of each, light
to import (the router core and the ingress need no torch)."""

from enum import StrEnum

NAMESPACE = "tandem"  # the Ray namespace of every Tandem actor
ROUTER_NAME = "tandem-router"


class Role(StrEnum):
    PREFILL = "prefill"  # computes prompts' KV and first tokens, serves the KV
    DECODE = "decode"  # continues requests from imported KV (and may prefill short prompts)
    COLOCATED = "colocated"  # does both phases itself: the baseline


class Transport(StrEnum):
    """What carries KV payloads between a prefill and a decode worker (the topology's
    ``transport``). The control stream is gRPC in both modes."""

    AUTO = "auto"  # TORCH where the prefill and decode workers have CUDA, else GRPC
    GRPC = "grpc"
    TORCH = "torch"  # torch.distributed: NCCL when both sides have CUDA, gloo on CPU
