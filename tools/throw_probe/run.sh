#!/usr/bin/env bash
# GPU machine: why a failing TORCH_CHECK in _C segfaults there (call 1 of 2026-11-26: both
# CUDA bad-input tests killed their worker). Writes $OUT/throw_probe/. ~2-3 min.
# 1) the toolchain; 2) our _C (as restored) throwing from its CPU and CUDA glue, with a gdb
# backtrace; 3) a two-file probe op built with each toolchain variant; 4) the first variant
# that throws cleanly rebuilds _C and reruns the bad-input tests.
set -u
tar -xzf .gpu_build/gpu_build.tgz  # the _C that call 1 compiled on this kind of machine
P=$(dirname "$0"); O=$OUT/throw_probe; mkdir -p "$O"
PY=${PY:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
{ echo "CC=${CC:-} CXX=${CXX:-} LDFLAGS=${LDFLAGS:-}"
  for c in /opt/gcc/bin/g++ /usr/bin/g++ /usr/bin/c++; do
    [ -x "$c" ] && echo "$c: $($c --version | head -1); libstdc++.so: $($c -print-file-name=libstdc++.so); .a: $($c -print-file-name=libstdc++.a)"
  done
  ls /opt/gcc /opt/gcc/lib64 2>&1 | head -40
  /opt/gcc/bin/g++ -dumpspecs 2>/dev/null | grep -n -i -A1 "static\|^\*link:\|libstdc" | head -40
  $PY -c 'import sysconfig as s; print("sysconfig CXX", s.get_config_var("CXX"), "| LDSHARED", s.get_config_var("LDSHARED"))'
  for so in specdec_kernels/_C*.so; do echo "$so:"; readelf -d "$so" | grep NEEDED; nm -D "$so" | grep -c " T __cxa_\| T __gxx_"; done
  which gdb; } > "$O/toolchain.txt" 2>&1
for dev in cpu cuda; do
  timeout 60 $PY "$P/probe.py" specdec $dev > "$O/specdec_$dev.txt" 2>&1; echo "rc $?" >> "$O/specdec_$dev.txt"
done
command -v gdb >/dev/null && timeout 40 gdb -batch -ex run -ex bt --args $PY "$P/probe.py" specdec cuda > "$O/gdb_specdec_cuda.txt" 2>&1
declare -A V=([opt_gcc]="" [exclude_libs]="-Wl,--exclude-libs,ALL")
for name in "${!V[@]}"; do (timeout 100 $PY "$P/probe.py" build $name "${V[$name]}" > "$O/build_$name.txt" 2>&1) & done
if [ -x /usr/bin/g++ ]; then (CC=/usr/bin/gcc CXX=/usr/bin/g++ timeout 100 $PY "$P/probe.py" build system_gcc "" > "$O/build_system_gcc.txt" 2>&1) & fi
wait
winner=""
for name in opt_gcc exclude_libs system_gcc; do
  for dev in cpu cuda; do
    timeout 60 $PY "$P/probe.py" call $name $dev > "$O/call_${name}_$dev.txt" 2>&1; echo "rc $?" >> "$O/call_${name}_$dev.txt"
  done
  if [ -z "$winner" ] && [ "$name" != opt_gcc ] && grep -q "RAISED OK" "$O/call_${name}_cpu.txt" && grep -q "RAISED OK" "$O/call_${name}_cuda.txt"; then winner=$name; fi
  readelf -d /tmp/throw_probe/$name/*.so 2>/dev/null | grep NEEDED | tr '\n' ' ' >> "$O/call_${name}_cpu.txt"
done
grep -H . "$O"/specdec_*.txt "$O"/call_*.txt > "$O/verdicts.txt"
echo "winner: ${winner:-none}" | tee -a "$O/verdicts.txt"
[ -n "$winner" ] || exit 0
case $winner in
  system_gcc) export CC=/usr/bin/gcc CXX=/usr/bin/g++ ;;
  *) export LDFLAGS="${V[$winner]}" ;;
esac
rm -rf build/temp.*
MAX_JOBS=16 timeout 110 $PY setup.py build_ext --inplace > "$O/rebuild.txt" 2>&1; echo "rebuild rc $?" >> "$O/verdicts.txt"
for dev in cpu cuda; do timeout 60 $PY "$P/probe.py" specdec $dev >> "$O/verdicts.txt" 2>&1; done
timeout 60 $PY -m pytest -q -p no:cacheprovider python_tests/test_verify_cuda.py python_tests/test_tree_attention_cuda.py \
  -k "bad_input or refused or chain_and_row" > "$O/tests_after.txt" 2>&1; tail -3 "$O/tests_after.txt" >> "$O/verdicts.txt"
