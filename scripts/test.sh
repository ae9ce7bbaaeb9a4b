#!/usr/bin/env bash
# The README's test command: build the environment from nothing (or reuse it), then run
# the whole test suite. Extra arguments go to pytest, e.g. `scripts/test.sh -k loader`.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/setup_env.sh"

# Keep vLLM's caches, IPC sockets and temp files inside the workspace.
export TMPDIR="$ROOT/.tmp" XDG_CACHE_HOME="$ROOT/.cache" VLLM_CACHE_ROOT="$ROOT/.cache/vllm"
mkdir -p "$TMPDIR" "$XDG_CACHE_HOME"
cd "$ROOT"
# The torch-npu wheel of every release the matrix names, for the conformance tests: downloaded
# once into a cache outside the checkout (ASCEND_PATCH_WHEEL_CACHE), sha256-checked on every run.
"$ROOT/.venv/bin/python" -m tests.npu_wheels
exec "$ROOT/.venv/bin/python" -m pytest "$@"
