"""Latency metrics exactly as docs/design.md#metrics defines them, from a request's own stamps.

System boundary: ``arrival`` is when the engine (or the serving layer that created the request)
received it; an *emit* is when a token's text was released to the client — one stamp per
emitted token, so tokens released together after a stop-string holdback share a stamp.

    TTFT  = t_first_emit - t_arrival
    ITL_j = t_emit_j - t_emit_(j-1)
    TPOT  = (t_last_emit - t_first_emit) / (N_out - 1)     (N_out >= 2)

and t_last_emit - t_arrival == TTFT + sum(ITL) holds exactly (an identity, not an estimate).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from engine.request import RequestTimes


def ttft(times: RequestTimes) -> float | None:
    """Time to first emitted token, or None if nothing was emitted."""
    return times.emits[0] - times.arrival if times.emits else None


def itls(times: RequestTimes) -> list[float]:
    """Inter-token latencies ITL_2 .. ITL_N."""
    e = times.emits
    return [e[j] - e[j - 1] for j in range(1, len(e))]


def tpot(times: RequestTimes) -> float | None:
    """Time per output token after the first; undefined (None) for N_out < 2."""
    e = times.emits
    return (e[-1] - e[0]) / (len(e) - 1) if len(e) >= 2 else None


def e2e(times: RequestTimes) -> float | None:
    """Arrival to last emit (so that e2e == ttft + sum(itls))."""
    return times.emits[-1] - times.arrival if times.emits else None


def queue_time(times: RequestTimes) -> float | None:
    """Time in the engine's queue: from entering it to the first step that scheduled the
    request (None until both happened). Part of TTFT, reported apart (docs/design.md#metrics:
    declare whether TTFT includes queueing)."""
    if times.queued is None or times.first_scheduled is None:
        return None
    return times.first_scheduled - times.queued


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); NaN for no samples."""
    if not values:
        return math.nan
    s = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(s)))
    return s[rank - 1]


@dataclass(frozen=True)
class Goodput:
    """SLO attainment (a ratio) and goodput (a rate) are different quantities
    (docs/design.md#metrics)."""

    attainment: float  # N_slo / N_total
    requests_per_s: float  # N_slo / wall seconds


def goodput(
    all_times: Sequence[RequestTimes], wall_s: float, ttft_slo: float, tpot_slo: float
) -> Goodput:
    """Count requests meeting both the TTFT and the TPOT SLO."""
    ok = 0
    for t in all_times:
        a, b = ttft(t), tpot(t)
        if a is not None and a <= ttft_slo and (b is None or b <= tpot_slo):
            ok += 1
    n = len(all_times)
    return Goodput(ok / n if n else math.nan, ok / wall_s if wall_s > 0 else math.nan)
