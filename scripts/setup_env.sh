#!/usr/bin/env bash
# Create (or refresh) the project environment from nothing: a venv holding stock vLLM
# from PyPI on the CPU build of torch, the test tools, and ascend-patch installed
# editable (so its .pth loader is live). Idempotent: a venv whose stamp matches the
# requirements file is reused as is.
#
#   scripts/setup_env.sh [VENV_DIR]        (default: .venv in the repository)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$ROOT/.venv}"
REQUIREMENTS="${ASCEND_PATCH_REQUIREMENTS:-$ROOT/requirements/test-vllm-0.33.0.txt}"
PYTHON="${PYTHON:-python3}"
STAMP="$VENV/.ascend-patch-stamp"
want="$(sha256sum "$REQUIREMENTS" "$ROOT/pyproject.toml" "$ROOT/setup.py" | sha256sum | cut -c1-16)"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
    echo "setup_env: $VENV is up to date"
    exit 0
fi

start=$SECONDS
if [[ ! -x "$VENV/bin/python" ]]; then
    echo "setup_env: creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi
# --no-deps: every package is pinned in the file, so pip neither resolves nor reaches for
# CUDA builds of torch or triton. pip byte-compiles on install, which matters here
# because PYTHONDONTWRITEBYTECODE=1 would otherwise halve import speed for good.
echo "setup_env: installing $(grep -c '==' "$REQUIREMENTS") pinned packages (torch, vLLM, tools); this takes a minute or two"
pip_install() {
    # This machine's pip config names local index folders that may not exist; their
    # warnings are noise, every other line is kept.
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps "$@" \
        2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}
pip_install -r "$REQUIREMENTS"
echo "setup_env: installing ascend-patch (editable) from $ROOT"
pip_install --no-build-isolation -e "$ROOT"
# The editable install imports from the source tree, where PYTHONDONTWRITEBYTECODE=1 would
# leave every process compiling the .pth bootstrap from source (~2 ms each start-up).
"$VENV/bin/python" -m compileall -q "$ROOT/ascend_patch" "$ROOT/patches"
echo "$want" > "$STAMP"
echo "setup_env: ready in $((SECONDS - start)) s: $VENV"
