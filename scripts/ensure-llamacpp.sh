#!/usr/bin/env bash
# Install the `llamacpp` extra into .venv. llama-cpp-python builds from source (about 7 minutes
# on 2 cores), so the wheel is built once into a cache and reused: later runs take seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
VERSION="0.3.36"
CACHE="${SHOAL_WHEEL_CACHE:-$HOME/.cache/shoal/wheels}"
if ! "$PY" -c "import llama_cpp" 2>/dev/null; then
  mkdir -p "$CACHE"
  if ! ls "$CACHE"/llama_cpp_python-"$VERSION"-*.whl >/dev/null 2>&1; then
    echo "building llama-cpp-python $VERSION once into $CACHE (about 7 minutes)..."
    CMAKE_ARGS="-DGGML_NATIVE=OFF" "$PY" -m pip wheel -q --no-deps "llama-cpp-python==$VERSION" -w "$CACHE"
  fi
  "$PY" -m pip install -q "$CACHE"/llama_cpp_python-"$VERSION"-*.whl
fi
"$PY" -m pip install -q -e '.[llamacpp]'
