#!/usr/bin/env bash
# Install llama.cpp's Python bindings (llama-cpp-python) into their own virtualenv, for the peer benchmarks only
# (issue 18: the same GGUF file run as stored by llama.cpp). It builds llama.cpp from source with the host's own
# instruction set (GGML_NATIVE): about 20 minutes on two cores, never part of `make test`.
#
# The build is tied to the CPU it was made on (a Zen 3 build has no AVX-512 paths for a Zen 4 or 5): the CPU's
# model name and ISA flags are kept beside the virtualenv, and a different CPU rebuilds it.
#
# LLAMACPP_ISA=avx2 builds it for AVX2 at most (no AVX-512), beside PAGEDLLM_CPU_ISA=avx2: a Zen 3's instruction set on
# a newer CPU (use its own VENV: LLAMACPP_VENV=.venv-llamacpp-avx2).
#
# Usage: bench/peers/setup_llamacpp.sh [VENV]     (default: .venv-llamacpp at the repository root, or $LLAMACPP_VENV)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
VENV="${1:-${LLAMACPP_VENV:-$ROOT/.venv-llamacpp}}"
PYTHON="${PYTHON:-python3}"
VERSION="0.3.36"
BUILD="isa-by-name"  # bumped when the build flags change: a venv of other flags is rebuilt
LIMIT="${LLAMACPP_ISA:-native}"
case "$LIMIT" in native|avx2) ;; *) echo "LLAMACPP_ISA must be avx2 or unset, got $LIMIT" >&2; exit 2 ;; esac
CPU="$BUILD $LIMIT $( (grep -m1 'model name' /proc/cpuinfo; grep -m1 -o -w 'avx512[a-z_0-9]*\|avx2\|avx_vnni\|f16c\|fma' /proc/cpuinfo | sort -u) | tr '\n' ' ')"
MARK="$VENV/.built-for-cpu"

if [ -x "$VENV/bin/python" ] && [ -f "$MARK" ] && [ "$(cat "$MARK")" = "$CPU" ] \
  && "$VENV/bin/python" -c "import importlib.metadata as m; assert m.version('llama_cpp_python') == '$VERSION'" 2>/dev/null; then
  echo "llama-cpp-python $VERSION already in $VENV, built for this CPU"; exit 0
fi
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install --quiet --upgrade pip
# No CUDA, no BLAS: llama.cpp's own CPU kernels, compiled for this CPU; -j from the cores we have.
# Not GGML_NATIVE: the VMs we measure on list amx_tile/amx_int8 in /proc/cpuinfo but trap on the first tileloadd
# (SIGILL, seen on a Xeon of 2026-11-27), and -march=native compiles llama.cpp's AMX kernels in whatever
# GGML_AMX_* says. Instead every other instruction set this CPU lists, named one by one.
has() {
  if [ "$LIMIT" = avx2 ]; then case "$1" in avx512*|avx_vnni) return 1 ;; esac; fi
  grep -m1 -q -w "$1" /proc/cpuinfo
}
ISA="-DGGML_NATIVE=OFF"
has avx && ISA="$ISA -DGGML_AVX=ON"
has avx2 && ISA="$ISA -DGGML_AVX2=ON"
has fma && ISA="$ISA -DGGML_FMA=ON"
has f16c && ISA="$ISA -DGGML_F16C=ON"
has avx_vnni && ISA="$ISA -DGGML_AVX_VNNI=ON"
has avx512f && ISA="$ISA -DGGML_AVX512=ON"
has avx512_vbmi && ISA="$ISA -DGGML_AVX512_VBMI=ON"
has avx512_vnni && ISA="$ISA -DGGML_AVX512_VNNI=ON"
has avx512_bf16 && ISA="$ISA -DGGML_AVX512_BF16=ON"
CMAKE_ARGS="$ISA -DGGML_CUDA=OFF -DGGML_BLAS=OFF -DLLAMA_CURL=OFF" \
  CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
  $PIP install --quiet --no-cache-dir "llama-cpp-python==$VERSION"
echo "$CPU" > "$MARK"
"$VENV/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__, 'in $VENV')"
