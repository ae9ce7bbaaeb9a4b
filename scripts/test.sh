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
exec "$ROOT/.venv/bin/python" -m pytest "$@"
