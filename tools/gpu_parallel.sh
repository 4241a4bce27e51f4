#!/usr/bin/env bash
# Run groups of tools/gpu_session.sh stages side by side on one GPU machine.
#
# The compute-sanitizer tools are slow on the host (each launch is instrumented and checked
# there) and leave most of an H100/H200 and its 16 cores idle: run one after another, four
# of them take a whole 15-minute window; side by side, one tool's time. Each group is one
# gpu_session.sh process with its own OUT ($OUT/NAME) and work folder, so their logs,
# summaries and verdict files do not mix; the groups share the build (run `build` first, in
# this shell, so they all load the same _C). Timings taken while groups run side by side are
# not measurements: put bench:* stages after the groups, never inside one.
#
#   tools/gpu_parallel.sh NAME="[VAR=VALUE ...] STAGE [STAGE ...]" [NAME="..." ...]
#
# e.g. (docs/gpu.md's plan):
#   tools/gpu_session.sh build && tools/gpu_parallel.sh \
#     memcheck="SANITIZE_QUICK=memcheck sanitize:memcheck" racecheck="SANITIZE_QUICK=racecheck sanitize:racecheck" \
#     graphs="graphs"
#
# VAR=VALUE words set that group's environment (SANITIZE_QUICK, STAGE_SECONDS, DEADLINE_S, ...);
# the rest of the environment (DEADLINE_S, SPECDEC_COMMIT) is shared. $OUT/summary.txt gets
# every group's summary, in the order given. Exit status: 1 if any group failed.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-/tmp/specdec_gpu_out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
WORK_BASE=${SPECDEC_GPU_WORK:-/tmp/specdec_gpu}
[ $# -ge 1 ] || { echo "usage: tools/gpu_parallel.sh NAME=\"[VAR=VALUE ...] STAGE ...\" ..." >&2; exit 2; }

names=() pids=()
for group in "$@"; do
  name=${group%%=*} words=${group#*=}
  [[ "$name" =~ ^[A-Za-z0-9_.-]+$ ]] && [ "$name" != "$group" ] \
    || { echo "gpu_parallel: expected NAME=\"STAGES\", got '$group'" >&2; exit 2; }
  assignments=() stages=()
  for word in $words; do
    if [[ "$word" =~ ^[A-Z_][A-Z0-9_]*= ]]; then assignments+=("$word"); else stages+=("$word"); fi
  done
  [ ${#stages[@]} -ge 1 ] || { echo "gpu_parallel: group $name has no stage" >&2; exit 2; }
  mkdir -p "$OUT/$name"
  env "${assignments[@]}" OUT="$OUT/$name" SPECDEC_GPU_WORK="$WORK_BASE.$name" \
    tools/gpu_session.sh "${stages[@]}" > "$OUT/$name/console.log" 2>&1 &
  names+=("$name") pids+=($!)
  echo "gpu_parallel: $name (pid $!): ${assignments[*]} ${stages[*]}"
done

failed=0
for i in "${!pids[@]}"; do
  wait "${pids[$i]}" || failed=1
done
for name in "${names[@]}"; do
  echo "--- $name"
  cat "$OUT/$name/summary.txt" 2>/dev/null || { echo "(no summary: see $name/console.log)"; failed=1; }
done | tee -a "$OUT/summary.txt"
exit "$failed"
