#!/usr/bin/env bash
# The README's test command: build the environment from nothing (or reuse it), then run
# the whole test suite. Extra arguments go to pytest, e.g. `scripts/test.sh -k loader`.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/setup_env.sh"

# Keep vLLM's caches, IPC sockets and temp files inside the workspace.
export TMPDIR="$ROOT/.tmp" XDG_CACHE_HOME="$ROOT/.cache" VLLM_CACHE_ROOT="$ROOT/.cache/vllm"
mkdir -p "$TMPDIR" "$XDG_CACHE_HOME/ascend-patch"
# The vLLM releases the static probes read (19 sdists, ~40 MB of sources each once extracted)
# are kept outside the checkout too, so a machine downloads each release once.
RELEASES="${ASCEND_PATCH_RELEASE_CACHE:-$HOME/.cache/ascend-patch-ci/releases}"
mkdir -p "$RELEASES"
if [[ ! -e "$XDG_CACHE_HOME/ascend-patch/releases" || -L "$XDG_CACHE_HOME/ascend-patch/releases" ]]; then
    ln -sfn "$RELEASES" "$XDG_CACHE_HOME/ascend-patch/releases"
fi
# vLLM's model-class inspection cache: on a miss vLLM inspects the class in a fresh interpreter
# that imports vLLM (~14 s per architecture here); vLLM checks each entry against the hash of
# the model's source file, so a machine keeps it across runs like the releases.
MODELINFOS="${ASCEND_PATCH_MODELINFO_CACHE:-$HOME/.cache/ascend-patch-ci/vllm-modelinfos}"
mkdir -p "$MODELINFOS" "$VLLM_CACHE_ROOT"
if [[ ! -e "$VLLM_CACHE_ROOT/modelinfos" || -L "$VLLM_CACHE_ROOT/modelinfos" ]]; then
    ln -sfn "$MODELINFOS" "$VLLM_CACHE_ROOT/modelinfos"
fi
cd "$ROOT"
# The torch-npu wheel of every release the matrix names, for the conformance tests: downloaded
# once into a cache outside the checkout (ASCEND_PATCH_WHEEL_CACHE), sha256-checked on every run.
"$ROOT/.venv/bin/python" -m tests.npu_wheels
exec "$ROOT/.venv/bin/python" -m pytest "$@"
