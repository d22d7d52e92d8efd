#!/usr/bin/env bash
# Install llama.cpp's Python binding into a virtual environment, built for this machine's CPU,
# and check in a child process that it decodes here. Usage:
#   scripts/install_llamacpp.sh VENV
#
# The binding builds llama.cpp from source (about 20 minutes on 2 cores), with the CPU flags of
# scripts/llamacpp_flags.sh (-march=native without AMX).
#
# The wheel is kept under $FLYSPEC_HOME/wheels (default ~/.cache/flyspec/wheels), in a folder
# named by the binding's version, the build flags and the CPU, so another machine or other flags
# build anew, and pip's own wheel cache (keyed by the source archive alone) is never used for it.
# An installed binding that passes the decode check is kept as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:?usage: scripts/install_llamacpp.sh VENV}
PY="$VENV/bin/python"
PIP_FLAGS=(--quiet --disable-pip-version-check)

if "$PY" -c "import llama_cpp" 2>/dev/null; then
    if "$PY" -m flyspec.models.llamacpp_binding --recheck; then
        exit 0
    fi
    echo "rebuilding llama.cpp's binding for this CPU ..."
fi

source scripts/llamacpp_flags.sh
WHEELS="${FLYSPEC_HOME:-$HOME/.cache/flyspec}/wheels/${REQUIREMENT/==/-}-$KEY"
if ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    echo "building $REQUIREMENT for this CPU into $WHEELS (about 20 minutes on 2 cores) ..."
    mkdir -p "$WHEELS.partial"
    "$PY" -m pip wheel "${PIP_FLAGS[@]}" --no-deps --no-cache-dir --no-binary llama-cpp-python \
        -w "$WHEELS.partial" "$REQUIREMENT"
    rm -rf "$WHEELS"
    mv "$WHEELS.partial" "$WHEELS"
fi
"$PY" -m pip install "${PIP_FLAGS[@]}" --force-reinstall --no-deps "$WHEELS"/*.whl
"$PY" -m pip install "${PIP_FLAGS[@]}" "$(ls "$WHEELS"/*.whl)"  # its dependencies
if ! "$PY" -m flyspec.models.llamacpp_binding --recheck; then
    echo "llama.cpp's binding, built in $WHEELS, does not decode on this CPU" >&2
    exit 1
fi
