#!/usr/bin/env bash
# Build, on this machine (no GPU, no device time), what the lent GPU machine would build: the
# whole extension with its CUDA kernels, against the GPU machine's own stack (Python 3.12,
# torch 2.11.0+cu130 with Triton 3.6.0, from PyPI), in a copy of the working tree as a device
# call would send it. Then:
#   * check that every op has a compiled CUDA kernel in the built _C (the build links and loads);
#   * compile every Triton kernel configuration for sm_80/sm_90 with that Triton
#     (python -m specdec_kernels.ops.triton.compile_check; this checkout's Triton may differ);
#   * write .gpu_build/gpu_build.tgz with the stamp tools/gpu_session.sh checks, so the first
#     device call restores the build in seconds instead of compiling (~2 min of device time);
#   * with --tests, run the CPU test suite on that stack too;
#   * with --dryrun, rehearse a device call there: `tools/gpu_session.sh call1` (or the stages
#     TWIN_STAGES names) with SPECDEC_GPU_SESSION_CPU_DRYRUN=1, in the copy of the tree, with
#     the machine's test packages (pytest-xdist, pytest-timeout, numba); its summary.txt and
#     logs land in $TWIN/dryrun_out (each stage timed on this CPU: docs/gpu.md).
#
#   tools/gpu_twin.sh [--tests | --dryrun]   # ~3 min to make the venv (downloads ~4 GB), ~2-5 min to build
#
# Environment: TWIN_VENV (default /tmp/specdec_gpu_twin/venv), TWIN_PYTHON (a Python 3.12;
# default: python3.12 on PATH, else pyenv's), TORCH_CUDA_ARCH_LIST (default 9.0a, as
# gpu_session.sh builds), MAX_JOBS (default 2). Logs go to /tmp/specdec_gpu_twin/*.log.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
TWIN=/tmp/specdec_gpu_twin
VENV=${TWIN_VENV:-$TWIN/venv}
SRC=$TWIN/src
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a}
# The GPU machine's stack (KINDS.md of the device tool): keep these in step with it.
TORCH_PIN=torch==2.11.0
TRANSFORMERS_PIN=transformers==5.17.0
mkdir -p "$TWIN"

if [ ! -x "$VENV/bin/python" ]; then
  # The first candidate that runs and is 3.12 (a pyenv shim on PATH may name a version it
  # will not run: "pyenv: python3.12: command not found").
  py=""
  for candidate in ${TWIN_PYTHON:-} $(command -v python3.12) $(find /root/.pyenv/versions -maxdepth 3 -path '*/3.12*/bin/python' 2>/dev/null); do
    if "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then py=$candidate; break; fi
  done
  [ -n "$py" ] || { echo "gpu_twin: no Python 3.12 found (set TWIN_PYTHON)" >&2; exit 1; }
  echo "gpu_twin: making $VENV with $py and $TORCH_PIN (downloads its CUDA 13 libraries)"
  "$py" -m venv "$VENV"
  "$VENV/bin/pip" install -q "$TORCH_PIN" numpy tqdm ninja setuptools wheel > "$TWIN/venv.log" 2>&1 \
    || { tail -20 "$TWIN/venv.log" >&2; exit 1; }
fi
PY=$VENV/bin/python
"$PY" - <<'EOF'
import sys, torch, triton
print(f"gpu_twin: Python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}")
if torch.version.cuda is None:
    raise SystemExit("gpu_twin: this venv's torch has no CUDA")
EOF

# The files a device call sends (tracked, and untracked but not ignored), into $SRC; build/
# stays between runs and the copies keep their times (-p), so ninja recompiles only what changed.
mkdir -p "$SRC"
find "$SRC" -mindepth 1 -maxdepth 1 ! -name build -exec rm -rf {} +
{ git ls-files -z; git ls-files -z --others --exclude-standard; } | xargs -0 -I{} cp -p --parents {} "$SRC" 2>/dev/null || true
cd "$SRC"
stamp=$(PYTHON=$PY "$REPO/tools/gpu_session.sh" stamp)
built=$(tar -xzOf "$REPO/.gpu_build/gpu_build.tgz" build/gpu_build_stamp 2>/dev/null || true)
if [ "${1:-}" = "--dryrun" ] && [ "$built" = "$stamp" ]; then
  # The rehearsal restores the committed build as call 1 would: nothing to build here.
  echo "gpu_twin: .gpu_build/gpu_build.tgz matches these sources (stamp $stamp): not rebuilt"
else

echo "gpu_twin: building for TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST (log: $TWIN/build.log)"
start=$SECONDS
PATH=$VENV/bin:$PATH MAX_JOBS=${MAX_JOBS:-2} \
  "$PY" setup.py build_ext --inplace > "$TWIN/build.log" 2>&1 || { tail -30 "$TWIN/build.log" >&2; exit 1; }
echo "gpu_twin: built in $((SECONDS - start)) s"
PYTHONPATH=$SRC "$PY" - <<'EOF'
import specdec_kernels as sk
missing = [op for op in sk.ops._extension.OPS if "cuda" not in sk.available_backends(op, "cuda")]
if sk.LOAD_ERROR or missing:
    raise SystemExit(f"gpu_twin: no compiled CUDA kernel for {missing} ({sk.LOAD_ERROR or 'built without them'})")
print(f"gpu_twin: _C loads, every op ({len(sk.ops._extension.OPS)}) has a compiled CUDA kernel")
EOF

# The build the first device call restores: the stamp is the one gpu_session.sh computes there.
mkdir -p build && echo "$stamp" > build/gpu_build_stamp
mkdir -p "$REPO/.gpu_build"
tar -czf "$REPO/.gpu_build/gpu_build.tgz" specdec_kernels/_C*.so build/gpu_build_stamp
echo "gpu_twin: wrote .gpu_build/gpu_build.tgz ($(du -h "$REPO/.gpu_build/gpu_build.tgz" | cut -f1), stamp $stamp)"

echo "gpu_twin: Triton compile check (log: $TWIN/triton_compile_check.log)"
if PYTHONPATH=$SRC "$PY" -m specdec_kernels.ops.triton.compile_check > "$TWIN/triton_compile_check.log" 2>&1; then
  "$PY" - "$TWIN/triton_compile_check.log" <<'EOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.startswith("{")]
bad = [r for r in rows if not r["ok"]]
spills = [r["n_spills"] for r in rows if "n_spills" in r]
print(f"gpu_twin: {len(rows)} Triton configs compiled, {len(bad)} over a limit, spills {min(spills)}-{max(spills)} bytes")
sys.exit(1 if bad or not rows else 0)
EOF
else
  tail -30 "$TWIN/triton_compile_check.log" >&2; exit 1
fi
fi  # (built)

if [ "${1:-}" = "--tests" ] || [ "${1:-}" = "--dryrun" ]; then
  # What the machine's image holds of what the suite and the stages import (KINDS.md's list).
  "$VENV/bin/pip" install -q pytest pytest-xdist pytest-timeout numba scipy hypothesis matplotlib "$TRANSFORMERS_PIN" \
    safetensors gguf accelerate >> "$TWIN/venv.log" 2>&1 || { tail -20 "$TWIN/venv.log" >&2; exit 1; }
fi
if [ "${1:-}" = "--dryrun" ]; then
  # As on the device: the copy of the tree, the build restored from .gpu_build (just written),
  # the carried prompt files, OUT a fresh folder; machine-wide state in a fresh work folder.
  mkdir -p .gpu_build && cp "$REPO/.gpu_build/gpu_build.tgz" .gpu_build/
  [ -d "$REPO/.data" ] && rm -rf .data && cp -r "$REPO/.data" .data
  rm -rf build/gpu_build_stamp "$TWIN/dryrun_out" "$TWIN/dryrun_work"
  # shellcheck disable=SC2086  # TWIN_STAGES is a list of stages
  SPECDEC_GPU_SESSION_CPU_DRYRUN=1 PYTHON=$PY OUT=$TWIN/dryrun_out SPECDEC_GPU_WORK=$TWIN/dryrun_work \
    PATH=$VENV/bin:$PATH tools/gpu_session.sh ${TWIN_STAGES:-call1} > "$TWIN/dryrun.log" 2>&1
  echo "gpu_twin: dry run exit $? (log: $TWIN/dryrun.log; summary: $TWIN/dryrun_out/summary.txt)"
  cat "$TWIN/dryrun_out/summary.txt"
  exit 0
fi
if [ "${1:-}" = "--tests" ]; then
  echo "gpu_twin: CPU test suite on this stack (log: $TWIN/tests.log)"
  PYTHONPATH=$SRC "$PY" -m pytest python_tests -q -ra -p no:cacheprovider > "$TWIN/tests.log" 2>&1 \
    || { sed -n '/short test summary info/,$p' "$TWIN/tests.log" >&2; exit 1; }
  tail -1 "$TWIN/tests.log"
fi
