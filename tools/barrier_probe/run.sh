#!/usr/bin/env bash
# GPU machine: does the verify kernel's grid barrier complete under compute-sanitizer
# (barrier_probe.cu says why we ask)? Builds the probe (~5 s) and runs each launch variant
# without a tool, then under memcheck and racecheck, at two shapes: 1 group of 2 blocks (the
# quick sanitize cases' plan) and 8 groups of 16 blocks (a large vocabulary's). Every run is
# bounded (the probe gives up a barrier after 5 s; `timeout` backs it). ~30-60 s.
# Writes $OUT/barrier_probe.txt (one line per run) and prints it.
set -u
P=$(dirname "$0")
O=${OUT:-/tmp}/barrier_probe.txt
BIN=/tmp/barrier_probe
SAN=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}
nvcc -O2 -arch=sm_90a -o "$BIN" "$P/barrier_probe.cu" > "$O" 2>&1 || { echo "barrier_probe: nvcc failed" >> "$O"; cat "$O"; exit 1; }
one() {  # TOOL VARIANT CHUNKS GROUPS
  local tool=$1 line rc start=$SECONDS
  shift
  if [ "$tool" = none ]; then
    line=$(timeout 30 "$BIN" "$@" 5 2>&1 | tail -1); rc=${PIPESTATUS[0]}
  else
    line=$(timeout 30 "$SAN" --tool "$tool" --print-limit 5 "$BIN" "$@" 5 2>&1 | grep -E "barrier_probe|ERROR SUMMARY|RACECHECK SUMMARY|Error|error" | tr '\n' ' '); rc=${PIPESTATUS[0]}
  fi
  echo "[$tool $* -> rc $rc, $((SECONDS - start)) s] $line" | tee -a "$O"
}
for v in ex coop plain cg; do one none $v 16 8 8; done
for tool in memcheck racecheck; do
  for shape in "2 1" "16 8"; do
    for v in ex coop plain cg; do
      # shellcheck disable=SC2086  # shape is two numbers
      one "$tool" $v $shape 8
    done
  done
done
