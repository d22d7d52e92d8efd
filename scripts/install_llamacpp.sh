#!/usr/bin/env bash
# Install llama.cpp's Python binding into a virtual environment, built for this machine's CPU,
# and check in a child process that it decodes here. Usage:
#   scripts/install_llamacpp.sh VENV
#
# The binding builds llama.cpp from source (about 20 minutes on 2 cores). It is built with
# -march=native (llama.cpp's default) but never with AMX: on one 2-core Xeon with AMX the AMX
# matrix kernel faulted on its first tile instruction although the kernel granted AMX, and
# killed the process (docs/design.md, "llama.cpp builds"). -mno-amx-* wins over -march=native
# whatever their order, so every other instruction set of the CPU stays in.
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
REQUIREMENT=$(sed -n 's/^llamacpp = \["\([^"]*\)"\].*/\1/p' pyproject.toml)  # llama-cpp-python==V

if "$PY" -c "import llama_cpp" 2>/dev/null; then
    if "$PY" -m flyspec.models.llamacpp_binding --recheck; then
        exit 0
    fi
    echo "rebuilding llama.cpp's binding for this CPU ..."
fi

CMAKE_ARGS="${CMAKE_ARGS:-}"
if [ "$(uname -m)" = "x86_64" ]; then
    NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    export CFLAGS="${CFLAGS:-} $NO_AMX" CXXFLAGS="${CXXFLAGS:-} $NO_AMX"
    CMAKE_ARGS="$CMAKE_ARGS -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
fi
export CMAKE_ARGS
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
CPU=$(grep -m2 -E "^(model name|flags)" /proc/cpuinfo 2>/dev/null || uname -m)
KEY=$(printf '%s|%s|%s|%s|%s' "$REQUIREMENT" "$CMAKE_ARGS" "${CFLAGS:-}" "${CXXFLAGS:-}" "$CPU" \
    | sha256sum | cut -c1-12)
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
