#!/usr/bin/env bash
# Regenerate kv_transfer/kv_transfer_pb2{.py,.pyi} from proto/kv_transfer.proto. No gRPC stubs:
# the transports register and call the service's methods themselves (the Pull stream carries
# hand-framed bytes), taking the method paths from the descriptor (kv_transfer/wire.py).
# Usage: [PYTHON=python] scripts/gen_proto.sh [OUT_DIR]    (OUT_DIR defaults to kv_transfer/;
# the test suite regenerates into a temp dir and compares, so the committed files match).
# The generated modules live inside the kv_transfer package, not in a top-level `proto`
# package: the venv also holds proto-plus, whose top-level package is named `proto`.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=$(realpath -m "${1:-kv_transfer}")
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
"${PYTHON:-.venv/bin/python}" -m grpc_tools.protoc -Iproto \
  --python_out="$TMP" --pyi_out="$TMP" proto/kv_transfer.proto
mkdir -p "$OUT"
cp "$TMP"/kv_transfer_pb2.py "$TMP"/kv_transfer_pb2.pyi "$OUT"/
