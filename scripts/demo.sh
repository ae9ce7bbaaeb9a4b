#!/usr/bin/env bash
# The README's main command: build the environment from nothing (or reuse it), then run a
# real generation through stock vLLM on the NPU platform and print it. Without an NPU this
# is the emulated mode (ASCEND_PATCH=emulate: the NPU code path on CPU tensors, with a
# tiny locally built model — there is no model hub here — whose token ids are then scored
# against HF transformers). On an Ascend machine, run it with ASCEND_PATCH=auto and torch-npu
# installed, and pass a real model: scripts/demo.sh MODEL_DIR
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/setup_env.sh"
export ASCEND_PATCH="${ASCEND_PATCH:-emulate}"
export ASCEND_PATCH_EMULATED_HBM="${ASCEND_PATCH_EMULATED_HBM:-1GiB}"
export TMPDIR="$ROOT/.tmp" XDG_CACHE_HOME="$ROOT/.cache" VLLM_CACHE_ROOT="$ROOT/.cache/vllm"
mkdir -p "$TMPDIR" "$XDG_CACHE_HOME"
PY="$ROOT/.venv/bin/python"

MODEL="${1:-}"
CHECK=()
if [[ -z "$MODEL" ]]; then
    echo "== building the tiny local test model (random weights, no hub needed)"
    MODEL="$("$PY" -m ascend_patch.kit.tiny_models "$ROOT/.cache/models" --only tiny-llama | sed -n 's/^tiny-llama: //p')"
    CHECK=(--check)
fi

echo "== ascend-patch doctor (ASCEND_PATCH=$ASCEND_PATCH), its summary; \`ascend-patch doctor\` shows the rest"
"$ROOT/.venv/bin/ascend-patch" doctor | sed '/^$/q'
echo "== stock vLLM, unchanged script: LLM(...).generate(...) on $MODEL"
"$PY" "$ROOT/scripts/demo_generate.py" "$MODEL" "${CHECK[@]}"
