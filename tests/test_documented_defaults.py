"""The defaults docs/design.md states are the code's: each sentence quoted here is in the doc,
and the value it names is the one the code uses -- a change to either fails here, not in a
user's surprise."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from cluster.coordinator import Coordinator
from cluster.retry import RetryPolicy
from engine.async_engine import AsyncLLMEngine
from engine.config import SpeculativeConfig
from engine.request import RECORDS_KEPT, RecordLog
from prefill_worker.worker import PrefillWorker
from tandem.topology import Topology

DESIGN = (Path(__file__).resolve().parent.parent / "docs" / "design.md").read_text()


def coordinator() -> Coordinator:
    return Coordinator(None, {}, {}, "m", RetryPolicy(), unavailable_wait_s=1.0)  # type: ignore[arg-type]


def default(function: object, name: str) -> object:
    return inspect.signature(function).parameters[name].default  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("sentence", "value", "stated"),
    [
        ("keep the latest 10 000 records in memory", RECORDS_KEPT, 10_000),
        *(
            ("defaults `k` 8, `min_n` 2, `max_n` 4, `threshold` 0.2, `max_batch` 8", got, want)
            for got, want in zip(
                SpeculativeConfig().model_dump(exclude={"method"}).values(),
                (8, 2, 4, 0.2, 8),
                strict=True,
            )
        ),
        ("keep the latest 10 000 records in memory", RecordLog()._items.maxlen, 10_000),
        ("keep the latest 10 000 records in memory", coordinator().records._items.maxlen, 10_000),
        ("`lease_timeout_s`, default 30 s", Topology.model_fields["lease_timeout_s"].default, 30),
        ("`lease_timeout_s`, default 30 s", default(PrefillWorker.__init__, "lease_timeout_s"), 30),
        (
            "(`max_buffered_outputs`, 64 entries)",
            default(AsyncLLMEngine, "max_buffered_outputs"),
            64,
        ),
        (
            "(`max_buffered_outputs`, 64 entries)",
            default(AsyncLLMEngine.from_checkpoint, "max_buffered_outputs"),
            64,
        ),
    ],
)
def test_a_documented_default_is_the_codes(sentence: str, value: object, stated: int) -> None:
    assert sentence in " ".join(DESIGN.split()), sentence
    assert value == stated
