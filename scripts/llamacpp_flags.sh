# Sourced by install_llamacpp.sh and install_llama_server.sh: the llama.cpp version pinned in
# pyproject.toml (REQUIREMENT), the CPU flags both builds use (CMAKE_ARGS, CFLAGS, CXXFLAGS,
# exported) and the key of a build (KEY), so the binding and the server are built alike and kept
# per version, flags and CPU.
#
# The builds use -march=native (llama.cpp's default) but never AMX: on one 2-core Xeon with AMX
# the AMX matrix kernel faulted on its first tile instruction although the kernel granted AMX,
# and killed the process (docs/design.md, "llama.cpp builds"). -mno-amx-* wins over
# -march=native whatever their order, so every other instruction set of the CPU stays in.
REQUIREMENT=$(sed -n 's/^llamacpp = \["\([^"]*\)"\].*/\1/p' pyproject.toml)  # llama-cpp-python==V
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
