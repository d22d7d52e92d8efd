#!/usr/bin/env bash
# Build llama.cpp's own server, llama-server, from the llama.cpp source that llama-cpp-python
# vendors (the version pinned in pyproject.toml, so the binding and the server are one llama.cpp),
# with the binding's CPU flags (scripts/llamacpp_flags.sh: -march=native, AMX left out), and
# link it into a virtual environment's bin/. Usage:
#   scripts/install_llama_server.sh VENV
#
# flyspec's bench methods llama-server* run it as a child process (docs/benchmarks.md). The
# build takes about 5 minutes on 2 cores the first time; the binary is kept under
# $FLYSPEC_HOME/llama-server (default ~/.cache/flyspec/llama-server), in a folder keyed like the
# binding's wheel, and a kept binary that answers --version is reused.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:?usage: scripts/install_llama_server.sh VENV}
source scripts/llamacpp_flags.sh
KEPT="${FLYSPEC_HOME:-$HOME/.cache/flyspec}/llama-server/${REQUIREMENT/==/-}-$KEY"

if ! "$KEPT/llama-server" --version >/dev/null 2>&1; then
    echo "building llama-server from $REQUIREMENT's llama.cpp for this CPU into $KEPT" \
        "(about 5 minutes on 2 cores) ..."
    WORK=$(mktemp -d)
    trap 'rm -rf "$WORK"' EXIT
    "$VENV/bin/python" -m pip download --quiet --disable-pip-version-check --no-deps \
        --no-binary :all: -d "$WORK" "$REQUIREMENT"
    tar xzf "$WORK"/*.tar.gz -C "$WORK"
    SOURCE=$(echo "$WORK"/*/vendor/llama.cpp)
    if ! command -v cmake >/dev/null; then  # the binding's build gets its cmake from PyPI too
        "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check cmake
        export PATH="$VENV/bin:$PATH"
    fi
    # A static binary without the web UI (no download at build time), HTTPS or the other tools.
    # shellcheck disable=SC2086  # CMAKE_ARGS holds several options
    cmake -S "$SOURCE" -B "$WORK/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
        -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON \
        -DLLAMA_BUILD_SERVER=ON $CMAKE_ARGS >"$WORK/configure.log" 2>&1 \
        || { cat "$WORK/configure.log" >&2; exit 1; }
    cmake --build "$WORK/build" --target llama-server -j "$CMAKE_BUILD_PARALLEL_LEVEL" \
        >"$WORK/build.log" 2>&1 || { tail -50 "$WORK/build.log" >&2; exit 1; }
    rm -rf "$KEPT" && mkdir -p "$KEPT.partial"
    cp "$WORK/build/bin/llama-server" "$KEPT.partial/"
    mv "$KEPT.partial" "$KEPT"
fi
if ! "$KEPT/llama-server" --version >/dev/null 2>&1; then
    echo "llama-server, built in $KEPT, does not run on this CPU" >&2
    exit 1
fi
ln -sf "$KEPT/llama-server" "$VENV/bin/llama-server"
echo "llama-server: $VENV/bin/llama-server -> $KEPT/llama-server"
