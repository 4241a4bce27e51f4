#!/usr/bin/env bash
# Make the folders the GPU window's device calls carry (tools/gpu_session.sh; the runbook is
# docs/gpu.md), in this checkout, keep git from seeing them (.git/info/exclude: the device tool
# sends untracked files that git does not ignore with every call, and these must travel only
# when named in `carry`), check the committed build, and print what each call weighs.
# Seconds, no device time; run it once before the window's first call:
#
#   tools/gpu_prepare.sh           # .data (+ .whl where gguf is installed): the 15-minute window's calls
#   tools/gpu_prepare.sh --model   # also .model_a/b/c: the default model's e2e (a later window)
#
#   .data/prompts/  a copy of the shared prompt files (SPECDEC_DATA, else ../shared/data/prompts):
#              the n-gram goal benchmark and the e2e runs read them (../shared does not travel)
#   .whl/      the wheels the machine lacks: gguf (pure Python; only the default model's loader)
#   .model_a/ .model_b/ .model_c/  (--model) the default model's GGUF in three parts (part_a ..
#              part_c), with PARTS (their names, in order) and the whole file's SHA256SUM_GGUF
#              beside each: one call carries at most 64 MiB, the tree included
#   .gpu_build/gpu_build.tgz  committed (tools/gpu_twin.sh makes it): its stamp is checked
#              against these sources for the machine's torch (2.11.0+cu130; a stale one costs
#              ~2 min of device time to compile there)
#
# Exit status 1 if a source is missing or a call's carry would pass the limit.
set -euo pipefail
cd "$(dirname "$0")/.." || exit 2
PY=${PYTHON:-python}
LIMIT_MIB=60  # what one call may send (64 MiB, the tree and its carry together), with a margin
MODEL=0
[ "${1:-}" = --model ] && MODEL=1

exclude=.git/info/exclude
[ -f .git ] && exclude=$(git rev-parse --git-path info/exclude)  # a worktree: .git is a file
mkdir -p "$(dirname "$exclude")"
touch "$exclude"
for folder in .whl .data .model_a .model_b .model_c; do
  grep -qxF "/$folder/" "$exclude" || echo "/$folder/" >> "$exclude"
done

# 1) the prompt files
data=${SPECDEC_DATA:-../shared/data/prompts}
if [ ! -d "$data" ]; then
  echo "gpu_prepare: no prompt files at $data (set SPECDEC_DATA)" >&2; exit 1
fi
rm -rf .data && mkdir -p .data/prompts && cp "$data"/*.jsonl .data/prompts/

# 2) wheels: the gguf version installed here (only the default model's e2e needs it)
gguf_version=$("$PY" -c "import importlib.metadata as m; print(m.version('gguf'))" 2>/dev/null || true)
rm -rf .whl
if [ -n "$gguf_version" ]; then
  mkdir -p .whl && "$PY" -m pip download -q --no-deps --only-binary=:all: -d .whl "gguf==$gguf_version"
elif [ "$MODEL" = 1 ]; then
  echo "gpu_prepare: gguf is not installed here (pip install gguf): cannot make .whl" >&2; exit 1
fi

# 3) the default model's GGUF, in three parts (--model)
parts=(a b c)
rm -rf .model_a .model_b .model_c
if [ "$MODEL" = 1 ]; then
  gguf=$(PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH} "$PY" -c "from specdec_kernels.models import default_gguf_path; print(default_gguf_path())" 2>/dev/null || true)
  if [ -z "$gguf" ] || [ ! -f "$gguf" ]; then
    echo "gpu_prepare: the default model's GGUF (specdec_kernels.models.default_gguf_path) is not installed here" >&2; exit 1
  fi
  tmp=$(mktemp -d)
  split -n "${#parts[@]}" -a 1 "$gguf" "$tmp/part_"  # part_a, part_b, part_c
  (cd "$(dirname "$gguf")" && sha256sum "$(basename "$gguf")") > "$tmp/SHA256SUM_GGUF"
  echo "part_a part_b part_c" > "$tmp/PARTS"
  for p in "${parts[@]}"; do
    mkdir -p ".model_$p" && mv "$tmp/part_$p" ".model_$p/" && cp "$tmp/SHA256SUM_GGUF" "$tmp/PARTS" ".model_$p/"
  done
  rm -rf "$tmp"
  if ! cat .model_a/part_a .model_b/part_b .model_c/part_c | cmp -s - "$gguf"; then
    echo "gpu_prepare: the parts do not reassemble the GGUF" >&2; exit 1
  fi
fi

# 4) the committed build against these sources, for the machine's torch
if [ -f .gpu_build/gpu_build.tgz ]; then
  built=$(tar -xzOf .gpu_build/gpu_build.tgz build/gpu_build_stamp 2>/dev/null || echo '?')
  want=$(STAMP_TORCH_VERSION=2.11.0+cu130 tools/gpu_session.sh stamp)
  if [ "$built" = "$want" ]; then
    echo "build: .gpu_build/gpu_build.tgz matches these sources (stamp $want): call 1 restores it in seconds"
  else
    echo "build: .gpu_build/gpu_build.tgz is stale (stamp $built, these sources $want): run tools/gpu_twin.sh" \
      "and commit the new one, or call 1 compiles for ~2 min" >&2
  fi
else
  echo "build: no .gpu_build/gpu_build.tgz: run tools/gpu_twin.sh, or call 1 compiles for ~2 min" >&2
fi

# 5) what each call sends: the tree (tracked, and untracked files git does not ignore, as the
# device tool sends them) and its carry
tree=$( { git ls-files -z; git ls-files -z --others --exclude-standard; } | xargs -0 du -cb 2>/dev/null | awk '$2 == "total" {s += $1} END {print s}')
weigh() {  # weigh LABEL FOLDER...: MiB with the tree; fails over the limit
  local label=$1 total mib; shift
  total=$( { [ $# -gt 0 ] && du -cb "$@" | tail -1 | cut -f1; } || echo 0)
  mib=$(( (total + tree + 1048575) / 1048576 ))
  echo "$label: ${mib} MiB with the tree (limit 64)"
  [ "$mib" -le "$LIMIT_MIB" ] || { echo "gpu_prepare: $label is over ${LIMIT_MIB} MiB" >&2; return 1; }
}
weigh "call 1 / call 2, carry [\".data\"]" .data
if [ "$MODEL" = 1 ]; then
  for p in "${parts[@]}"; do weigh "e2e window, carry [\".whl\", \".data\", \".model_$p\"]" .whl .data ".model_$p"; done
fi
echo "ready: .data/prompts ($(find .data/prompts -maxdepth 1 -type f | wc -l) files)$([ -d .whl ] && echo ", .whl ($(ls .whl))")$([ "$MODEL" = 1 ] && echo ", .model_a/b/c")"
echo "next (docs/gpu.md): the device tool's status, then run tools/gpu_session.sh call1 with carry [\".data\"]"
