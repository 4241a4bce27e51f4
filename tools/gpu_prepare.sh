#!/usr/bin/env bash
# Make the folders a GPU session carries to the device machine (tools/gpu_session.sh, its
# RUNBOOK), in this checkout, and keep git from seeing them (.git/info/exclude): the device
# tool sends untracked files that git does not ignore with every call, and the model halves
# must travel only when named in `carry`. Run it once, before the first device call:
#
#   tools/gpu_prepare.sh          # then: run tools/gpu_session.sh all, carry [".whl", ".data", ".model_a"]
#
#   .whl/      the wheels the machine lacks: gguf (pure Python; the GGUF loader needs it)
#   .data/prompts/  a copy of the shared prompt files (SPECDEC_DATA, else ../shared/data/prompts)
#   .model_a/ .model_b/ .model_c/  the default model's GGUF in three parts (part_a .. part_c),
#              with PARTS (their names, in order) and the whole file's SHA256SUM_GGUF beside
#              each: one call carries at most 64 MiB, the tree (~16.5 MiB) included
#   .gpu_build/  (made by a device call that built the kernels; only excluded here)
#
# Idempotent: existing folders are rebuilt from the sources. Exit status 1 if a source is missing.
set -euo pipefail
cd "$(dirname "$0")/.." || exit 2
PY=${PYTHON:-python}
LIMIT_MIB=60  # what one carried folder set may weigh (64 MiB per call, the tree included)

exclude=.git/info/exclude
mkdir -p "$(dirname "$exclude")"
touch "$exclude"
for folder in .whl .data .model_a .model_b .model_c .gpu_build; do
  grep -qxF "/$folder/" "$exclude" || echo "/$folder/" >> "$exclude"
done

# 1) wheels: the gguf version installed here, from the local index or pip's cache
gguf_version=$("$PY" -c "import importlib.metadata as m; print(m.version('gguf'))" 2>/dev/null || true)
if [ -z "$gguf_version" ]; then
  echo "gpu_prepare: gguf is not installed here (pip install gguf): cannot make .whl" >&2; exit 1
fi
rm -rf .whl && mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: -d .whl "gguf==$gguf_version"

# 2) the prompt files
data=${SPECDEC_DATA:-../shared/data/prompts}
if [ ! -d "$data" ]; then
  echo "gpu_prepare: no prompt files at $data (set SPECDEC_DATA)" >&2; exit 1
fi
rm -rf .data && mkdir -p .data/prompts && cp "$data"/*.jsonl .data/prompts/

# 3) the default model's GGUF, in three parts
gguf=$(PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH} "$PY" -c "from specdec_kernels.models import default_gguf_path; print(default_gguf_path())" 2>/dev/null || true)
if [ -z "$gguf" ] || [ ! -f "$gguf" ]; then
  echo "gpu_prepare: the default model's GGUF (specdec_kernels.models.default_gguf_path) is not installed here" >&2; exit 1
fi
parts=(a b c)
rm -rf .model_a .model_b .model_c
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

# 4) what each call of the runbook carries must fit (the tree: tracked and untracked files
# git does not ignore, as the device tool sends them)
tree=$( { git ls-files -z; git ls-files -z --others --exclude-standard; } | xargs -0 du -cb 2>/dev/null | awk '$2 == "total" {s += $1} END {print s}')
for p in "${parts[@]}"; do
  total=$(du -cb .whl .data ".model_$p" | tail -1 | cut -f1)
  mib=$(( (total + tree + 1048575) / 1048576 ))
  echo "carry .whl .data .model_$p: ${mib} MiB with the tree (room for .gpu_build: $(( 64 - mib )) MiB)"
  if [ "$mib" -gt "$LIMIT_MIB" ]; then
    echo "gpu_prepare: .model_$p with .whl, .data and the tree is over ${LIMIT_MIB} MiB" >&2; exit 1
  fi
done
echo "ready: .whl ($(ls .whl)), .data/prompts ($(find .data/prompts -maxdepth 1 -type f | wc -l) files), .model_a/b/c ($(basename "$gguf"))"
echo "next: the device tool's status, then run tools/gpu_session.sh all with carry [\".whl\", \".data\", \".model_a\"]"
