#!/usr/bin/env bash
# Run groups of tools/gpu_session.sh stages side by side on one GPU machine.
#
# What it is for: stages whose time goes to the host (compute-sanitizer checks each
# instrumented launch on the CPU; Triton and inductor compile there) leave most of a
# 16-core machine idle when run one after another. Each group is one gpu_session.sh process
# with its own OUT (packed into $OUT/groups.tgz) and work folder, so their logs, summaries and
# verdict files do not mix; the groups share the build (run `build` first, in this shell, so
# they all load the same _C). What it does not buy: every process is its own CUDA context,
# which the GPU time-slices, so GPU-bound work is not faster side by side (the second window:
# a sanitized tree_masks took 8 s alone and ~100 s beside six other sanitizers), and
# timings taken while groups run side by side are not measurements: put bench:* stages after
# the groups, never inside one.
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

# The groups' own OUT folders live outside $OUT and come back as one archive, $OUT/groups.tgz
# (the device tool returns few files), packed every 30 s so a call cut short keeps the latest.
GROUPS_DIR=$WORK_BASE.groups
rm -rf "$GROUPS_DIR" && mkdir -p "$GROUPS_DIR"
pack() { tar -C "$GROUPS_DIR" -czf "$OUT/groups.tgz.part" . 2>/dev/null && mv -f "$OUT/groups.tgz.part" "$OUT/groups.tgz"; }
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
  mkdir -p "$GROUPS_DIR/$name"
  env "${assignments[@]}" OUT="$GROUPS_DIR/$name" SPECDEC_GPU_WORK="$WORK_BASE.$name" \
    tools/gpu_session.sh "${stages[@]}" > "$GROUPS_DIR/$name/console.log" 2>&1 &
  names+=("$name") pids+=($!)
  echo "gpu_parallel: $name (pid $!): ${assignments[*]} ${stages[*]}"
done

( trap 'exit 0' TERM; while sleep 30 & wait $!; do pack; done ) >/dev/null 2>&1 &
packer=$!
failed=0
for i in "${!pids[@]}"; do
  wait "${pids[$i]}" || failed=1
done
for name in "${names[@]}"; do
  echo "--- $name"
  cat "$GROUPS_DIR/$name/summary.txt" 2>/dev/null || { echo "(no summary: see $name/console.log)"; failed=1; }
done | tee -a "$OUT/summary.txt"
kill "$packer" 2>/dev/null; wait "$packer" 2>/dev/null
pack
exit "$failed"
