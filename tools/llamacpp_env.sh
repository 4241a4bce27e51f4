#!/usr/bin/env bash
# Make the virtual environment llama.cpp runs in as a peer of `specdec bench e2e`.
#
#   tools/llamacpp_env.sh   # -> ${SPECDEC_LLAMACPP_VENV:-$HOME/.cache/specdec_kernels/llamacpp-venv}
#
# llama.cpp reaches Python through llama-cpp-python 0.3.36, which builds the vendored
# llama.cpp from source at install (~8 min on 2 cores). It gets a venv of its own, never the
# main environment. Steps:
#   1. python -m venv (PYTHON, default python3); the sdist downloaded into $VENV/sdist (76 MB,
#      kept: step 2 takes the converter from it), then built and installed for this CPU:
#      Release, GGML_NATIVE=ON (the host's instruction set: AVX2 / AVX-512 / AVX512-BF16 / AMX
#      where present), OpenMP as llama.cpp defaults (on), no BLAS (llama.cpp's own kernels, as
#      it ships by default; the peer decodes at batch 1)
#   2. llama.cpp's own converter: the sdist's vendored llama.cpp unpacked to $VENV/llama.cpp-src
#      (convert_hf_to_gguf.py), its gguf-py installed from there (converter and gguf move
#      together), and what the converter imports to read an HF checkpoint: numpy, safetensors,
#      sentencepiece, torch (the CPU wheel, 2.13.0+cpu as the main environment's) and transformers
#   3. a smoke check: `import llama_cpp, gguf`, print their versions and llama.cpp's system info
#      (the instruction sets it was built with)
#
# Idempotent: an existing venv that already has llama-cpp-python 0.3.36 skips the download and
# the build; the unpacked source and the pip installs of step 2 are no-ops when present.
# Run heavy: `nice -n 10 tools/llamacpp_env.sh` (the build uses every core: ~8 min on 2 cores,
# ~15 min when they are shared). `specdec bench e2e` converts the GGUFs it needs (f32 / bf16,
# cached next to the checkpoint) with this converter on first use.
set -euo pipefail
VENV=${SPECDEC_LLAMACPP_VENV:-$HOME/.cache/specdec_kernels/llamacpp-venv}
PY=${PYTHON:-python3}
LLAMACPP_VERSION=${SPECDEC_LLAMACPP_VERSION:-0.3.36}

echo "llama.cpp venv: $VENV"
if [ ! -x "$VENV/bin/python" ]; then
  mkdir -p "$(dirname "$VENV")"
  "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"

have=$("$VPY" -c "import importlib.metadata as m; print(m.version('llama_cpp_python'))" 2>/dev/null || true)
if [ "$have" != "$LLAMACPP_VERSION" ]; then
  "$VPY" -m pip install --upgrade pip setuptools wheel
  # the sdist is kept: its vendored llama.cpp carries the converter (step 2)
  mkdir -p "$VENV/sdist"
  "$VPY" -m pip download --no-deps --no-binary llama-cpp-python -d "$VENV/sdist" "llama-cpp-python==$LLAMACPP_VERSION"
  CMAKE_ARGS="-DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON" \
  CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} \
    "$VPY" -m pip install --no-cache-dir "$VENV/sdist/llama_cpp_python-$LLAMACPP_VERSION.tar.gz"
fi

# 2) the converter: llama.cpp's own convert_hf_to_gguf.py and gguf-py, from the sdist
SRC="$VENV/llama.cpp-src"
if [ ! -f "$SRC/convert_hf_to_gguf.py" ]; then
  tmp=$(mktemp -d)
  tar -xzf "$VENV/sdist/llama_cpp_python-$LLAMACPP_VERSION.tar.gz" -C "$tmp"
  rm -rf "$SRC"
  mv "$tmp/llama_cpp_python-$LLAMACPP_VERSION/vendor/llama.cpp" "$SRC"
  rm -rf "$tmp"
fi
# gguf from the same llama.cpp tree (the converter and gguf-py move together);
# torch and transformers are what the converter imports to read HF checkpoints
"$VPY" -m pip install "$SRC/gguf-py" numpy safetensors sentencepiece
# (torch: the CPU wheel, the one the main environment has, wherever pip is configured to find it)
"$VPY" -c "import torch" 2>/dev/null || "$VPY" -m pip install "torch==${SPECDEC_LLAMACPP_TORCH:-2.13.0+cpu}" || \
  "$VPY" -m pip install --index-url https://download.pytorch.org/whl/cpu torch
"$VPY" -c "import transformers" 2>/dev/null || "$VPY" -m pip install transformers

# 3) smoke check
"$VPY" - <<'PYEOF'
import importlib.metadata as m
import llama_cpp, gguf
print("llama-cpp-python", m.version("llama_cpp_python"), "gguf", m.version("gguf"))
print(llama_cpp.llama_print_system_info().decode())
PYEOF
echo "ok: $VPY"
