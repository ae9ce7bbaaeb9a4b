#!/usr/bin/env bash
# The README's main command: build the environment from nothing (or reuse it), then show
# stock vLLM running on the NPU platform. Without an NPU this is the emulated mode
# (ASCEND_PATCH=emulate: the NPU code path on CPU tensors); on an Ascend machine run it
# with ASCEND_PATCH=auto and the real torch-npu installed.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/setup_env.sh"
export ASCEND_PATCH="${ASCEND_PATCH:-emulate}"
export TMPDIR="$ROOT/.tmp" XDG_CACHE_HOME="$ROOT/.cache" VLLM_CACHE_ROOT="$ROOT/.cache/vllm"
mkdir -p "$TMPDIR" "$XDG_CACHE_HOME"
PY="$ROOT/.venv/bin/python"

echo "== ascend-patch doctor (ASCEND_PATCH=$ASCEND_PATCH)"
"$ROOT/.venv/bin/ascend-patch" doctor
echo
echo "== stock vLLM, as any script imports it"
"$PY" - <<'PY'
from vllm.platforms import current_platform
import torch
print(f"current_platform = {type(current_platform).__module__}.{type(current_platform).__name__}")
print(f"device name      = {current_platform.get_device_name(0)}")
print(f"torch device     = {torch.device(current_platform.device_type)}")
print(f"dist backend     = {current_platform.dist_backend}")
PY
