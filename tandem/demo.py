"""The built-in demo model: where its checkpoint lives, built on first use."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from engine.config import DemoSize

DEFAULT_DEMO_SIZE: DemoSize = "tiny"


def tandem_home() -> Path:
    """Where Tandem keeps what it builds once per machine (``$TANDEM_HOME``, else
    ~/.cache/tandem): the demo checkpoints, the tests' real model."""
    return Path(os.environ.get("TANDEM_HOME", Path.home() / ".cache" / "tandem"))


def demo_model_dir(size: str = DEFAULT_DEMO_SIZE) -> Path:
    """Where the demo checkpoint of ``size`` lives."""
    return tandem_home() / f"demo-{size}-llama"


def ensure_demo_model(size: str = DEFAULT_DEMO_SIZE) -> Path:
    """Return the demo checkpoint dir, writing it first if it is not there yet."""
    out = demo_model_dir(size)
    if not (out / "config.json").exists():
        # Imported only to build it (torch): an ingress finding it built stays without torch.
        from engine.demo_model import write_demo_checkpoint

        print(f"tandem: building the {size} demo model in {out} (first use only)", file=sys.stderr)
        write_demo_checkpoint(out, size=size)  # type: ignore[arg-type]
    return out
