"""What a worker does: the one definition, light to import (the router core needs no torch)."""

from enum import StrEnum


class Role(StrEnum):
    PREFILL = "prefill"  # computes prompts' KV and first tokens, serves the KV
    DECODE = "decode"  # continues requests from imported KV (and may prefill short prompts)
    COLOCATED = "colocated"  # does both phases itself: the baseline
