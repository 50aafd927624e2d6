#!/usr/bin/env bash
# Shared set-up for remotorch: a virtualenv in .venv with torch and the package.
#
#   bash scripts/setup.sh          set up (or check) the environment, print the interpreter
#   source scripts/setup.sh        the same, and leave REMOTORCH_PY set for the caller
#
# Steps, each skipped when already done:
#   1. create .venv (python3 -m venv) unless it exists;
#   2. install torch==2.13.0 FIRST, on its own. On a CPU machine whose pip is
#      configured with a local CPU wheel (find-links), this takes that wheel.
#      A bare `torch` requirement resolved by pip from another package would
#      pull the newest CUDA build (several GB), so torch is never left for pip
#      to pick: it is installed explicitly and pinned by a constraint after;
#   3. pip install -e ".[test]" under that constraint. This also builds the
#      compiled framing (setup.py: src/remotorch/transport/_cframing.c, linked
#      with OpenSSL's libcrypto) in place; where it cannot be built the install
#      goes on and the pure-Python framing is used.
# A stamp file (.venv/.remotorch-setup) holds a hash of pyproject.toml, the
# torch pin and the repository path; when it matches, pip is not run at all.
#
# Environment:
#   PYTHON               interpreter to build the venv from (default: python3)
#   REMOTORCH_TORCH      torch requirement (default: torch==2.13.0)
#   REMOTORCH_NO_VENV=1  install into $PYTHON itself instead of a venv. This is
#                        also the fallback when a venv cannot be created; its
#                        stamp is .remotorch-setup in the repository root.

_remotorch_setup() {
    local repo base_py torch_req venv stamp_file want py
    repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    base_py="${PYTHON:-python3}"
    torch_req="${REMOTORCH_TORCH:-torch==2.13.0}"
    venv="$repo/.venv"

    if ! command -v "$base_py" >/dev/null 2>&1; then
        echo "setup: $base_py not found (set PYTHON to a Python >= 3.10)" >&2
        return 1
    fi
    if ! "$base_py" -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
        echo "setup: $("$base_py" --version 2>&1) is too old; remotorch needs Python >= 3.10" >&2
        return 1
    fi

    # 1. the interpreter: .venv unless told otherwise or a venv cannot be made
    if [[ "${REMOTORCH_NO_VENV:-}" == "1" || ( -f "$repo/.remotorch-setup" && ! -d "$venv" ) ]]; then
        # (a stamp in the repository root means an earlier run had to fall back:
        # remove .remotorch-setup to try the virtualenv again)
        py="$(command -v "$base_py")"
        stamp_file="$repo/.remotorch-setup"
    else
        if [[ ! -x "$venv/bin/python" ]]; then
            echo "setup: creating virtualenv $venv" >&2
            if ! "$base_py" -m venv "$venv"; then
                echo "setup: WARNING: could not create a virtualenv; installing into $base_py itself" >&2
                rm -rf "$venv"
                REMOTORCH_NO_VENV=1 _remotorch_setup
                return $?
            fi
        fi
        py="$venv/bin/python"
        stamp_file="$venv/.remotorch-setup"
    fi

    # (setup.py and the C source too: a changed extension is rebuilt)
    want="$( { cat "$repo/pyproject.toml" "$repo/setup.py" "$repo/src/remotorch/transport/_cframing.c"; \
               echo "$torch_req"; echo "$repo"; echo "$py"; } \
             | sha256sum | cut -d' ' -f1)"
    if [[ -f "$stamp_file" && "$(cat "$stamp_file")" == "$want" ]] && "$py" -c '
import importlib.util, sys
sys.exit(not all(importlib.util.find_spec(m) for m in ("torch", "remotorch", "pytest")))' 2>/dev/null; then
        REMOTORCH_PY="$py"
        export REMOTORCH_PY
        return 0
    fi

    local pip_flags=(--disable-pip-version-check)
    if [[ "${REMOTORCH_NO_VENV:-}" == "1" ]] && "$py" -m pip install --help 2>/dev/null \
            | grep -q -- '--break-system-packages'; then
        pip_flags+=(--break-system-packages)  # Debian's system Python refuses otherwise (PEP 668)
    fi

    # 2. torch first, on its own, so pip takes the build its configuration offers
    echo "setup: installing $torch_req" >&2
    "$py" -m pip install "${pip_flags[@]}" "$torch_req" || return 1
    local torch_version constraints
    torch_version="$("$py" -c 'import torch; print(torch.__version__)')" || return 1
    echo "setup: torch $torch_version" >&2

    # 3. the package and its test extras, with torch pinned to what is installed
    constraints="$(mktemp)"
    echo "torch==${torch_version}" >"$constraints"
    echo "setup: installing remotorch (editable) with its test extras" >&2
    if ! "$py" -m pip install "${pip_flags[@]}" --constraint "$constraints" -e "$repo[test]"; then
        rm -f "$constraints"
        return 1
    fi
    rm -f "$constraints"

    echo "$want" >"$stamp_file"
    REMOTORCH_PY="$py"
    export REMOTORCH_PY
    echo "setup: ready ($py)" >&2
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
    # executed: fail on the first error and print the interpreter
    set -euo pipefail
    _remotorch_setup
    echo "$REMOTORCH_PY"
else
    # sourced: the caller decides how errors end it
    _remotorch_setup
fi
