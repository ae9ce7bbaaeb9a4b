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
# The main line (scripts/record_matrix_run.py reads it from here).
REQUIREMENTS="${ASCEND_PATCH_REQUIREMENTS:-$ROOT/requirements/test-vllm-0.34.0.txt}"
PYTHON="${PYTHON:-python3}"
STAMP="$VENV/.ascend-patch-stamp"
# The installed .pth is a copy of the checkout's: a change to it must reinstall.
want="$(sha256sum "$REQUIREMENTS" "$ROOT/pyproject.toml" "$ROOT/setup.py" "$ROOT/ascend_patch/a1_ascend_patch.pth" \
        | sha256sum | cut -c1-16)"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
    echo "setup_env: $VENV is up to date"
    exit 0
fi

start=$SECONDS
pins() { grep -E '^[A-Za-z0-9][^ #]*==' "$1" | sort; }
BASE="${ASCEND_PATCH_BASE_VENV:-}"
if [[ ! -x "$VENV/bin/python" && -n "$BASE" && -f "$BASE/.ascend-patch-stamp" \
      && -f "$BASE/.ascend-patch-requirements" ]]; then
    # A pinned release's environment (scripts/record_matrix_run.py) differs from the main one
    # in a few pins: start from a hard-linked copy of the main one's packages and install only
    # the pins that differ, instead of torch and ~160 packages again (minutes of CI each).
    echo "setup_env: creating $VENV from $BASE (hard links) and the pins that differ"
    "$PYTHON" -m venv "$VENV"
    site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    base_site="$("$BASE/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    rm -rf "$site"
    cp -al "$base_site" "$site"
    # The packages' console scripts (ray, vllm, ...) live in bin/, with the base's interpreter in
    # their first line: each gets this venv's interpreter instead (a binary is linked as it is).
    bin="$(cd "$VENV/bin" && pwd)"
    for script in "$BASE"/bin/*; do
        name="$(basename "$script")"
        [[ -f "$script" && ! -L "$script" && ! -e "$bin/$name" ]] || continue
        if head -c 2 "$script" | grep -q '^#!'; then
            sed "1s|^#!$BASE/bin/python[0-9.]*\$|#!$bin/python|" "$script" > "$bin/$name"
            chmod +x "$bin/$name"
        else
            cp -l "$script" "$bin/$name"
        fi
    done
    gone="$(comm -23 <(pins "$BASE/.ascend-patch-requirements") <(pins "$REQUIREMENTS") | cut -d= -f1)"
    if [[ -n "$gone" ]]; then
        # shellcheck disable=SC2086  # one name per word
        "$VENV/bin/python" -m pip uninstall --quiet --yes $gone
    fi
    REQUIREMENTS_TO_INSTALL="$(mktemp)"
    trap 'rm -f "$REQUIREMENTS_TO_INSTALL"' EXIT
    comm -13 <(pins "$BASE/.ascend-patch-requirements") <(pins "$REQUIREMENTS") > "$REQUIREMENTS_TO_INSTALL"
fi
if [[ ! -x "$VENV/bin/python" ]]; then
    echo "setup_env: creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi
# --no-deps: every package is pinned in the file, so pip neither resolves nor reaches for
# CUDA builds of torch or triton. pip byte-compiles on install, which matters here
# because PYTHONDONTWRITEBYTECODE=1 would otherwise halve import speed for good.
to_install="${REQUIREMENTS_TO_INSTALL:-$REQUIREMENTS}"
echo "setup_env: installing $(grep -c '==' "$to_install") pinned packages; the whole set (torch, vLLM, tools) takes a few minutes"
pip_install() {
    # This machine's pip config names local index folders that may not exist; their
    # warnings are noise, every other line is kept.
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps "$@" \
        2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}
if [[ -s "$to_install" ]]; then
    pip_install -r "$to_install"
fi
echo "setup_env: installing ascend-patch (editable) from $ROOT"
pip_install --no-build-isolation -e "$ROOT"
# The editable install imports from the source tree, where PYTHONDONTWRITEBYTECODE=1 would
# leave every process compiling the .pth bootstrap from source (~2 ms each start-up).
"$VENV/bin/python" -m compileall -q "$ROOT/ascend_patch" "$ROOT/patches"
cp "$REQUIREMENTS" "$VENV/.ascend-patch-requirements"
echo "$want" > "$STAMP"
echo "setup_env: ready in $((SECONDS - start)) s: $VENV"
