#!/usr/bin/env python3
"""Compile every CUDA source for each target arch with nvcc (no GPU needed) and report each
kernel's registers and spills from ptxas; fail on a compile error or any spill.

Usually run through CMake (`tools/compile_check.sh`, which configures and builds the
`compile_check` target of CMakeLists.txt); CMake finds nvcc and torch's headers and passes:

    compile_check.py --nvcc NVCC --arch 80 --arch 90a --out-dir DIR \
        --standalone cmake/check_kernels.cu --glue csrc/cuda/*.cu \
        --glue-flag=-I... (torch include dirs and defines)

--standalone sources include only csrc/include (the torch-free kernels); --glue sources are
the torch bindings and get the --glue-flag options too.
"""

import argparse
import concurrent.futures
import os
import re
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(sm_\w+)'")
PROPERTIES = re.compile(r"Function properties for (\S+)")
FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
REGISTERS = re.compile(r"Used (\d+) registers")


def compile_one(nvcc, source, archs, flags, out_dir):
    """Runs nvcc -c with ptxas verbose output for every arch; returns (source, rc, seconds, output)."""
    obj = os.path.join(out_dir, os.path.relpath(source, ROOT).replace(os.sep, "_") + ".o")
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    cmd = [nvcc, "-c", source, "-o", obj, "-O3", "-Xptxas", "-v", *gencode, *flags]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    return source, proc.returncode, time.perf_counter() - start, proc.stdout + proc.stderr, cmd


def parse(output):
    """One dict per kernel (entry function) and per non-inlined device function with a frame."""
    rows, current, props_name = [], None, None
    for line in output.splitlines():
        if m := ENTRY.search(line):
            current = {"name": m.group(1), "arch": m.group(2), "regs": None, "stack": 0, "spill_st": 0, "spill_ld": 0}
            rows.append(current)
        elif m := PROPERTIES.search(line):
            props_name = m.group(1)
        elif m := FRAME.search(line):
            frame = dict(stack=int(m.group(1)), spill_st=int(m.group(2)), spill_ld=int(m.group(3)))
            if current is not None and props_name == current["name"]:
                current.update(frame)
            else:  # a device function ptxas kept separate: its spills count too
                rows.append({"name": props_name, "arch": current["arch"] if current else "?", "regs": None, **frame})
        elif (m := REGISTERS.search(line)) and current is not None:
            current["regs"] = int(m.group(1))
    return rows


def demangle(names):
    """Readable kernel names: demangled by c++filt when available, parameter lists dropped."""
    if shutil.which("c++filt") is None:
        return {n: n for n in names}
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    readable = {}
    for name, pretty in zip(names, out):
        pretty = re.sub(r"^void ", "", pretty)
        depth = 0  # cut at the '(' that opens the parameter list (depth 0 outside template brackets)
        for i, ch in enumerate(pretty):
            depth += ch == "<"
            depth -= ch == ">"
            if ch == "(" and depth == 0:
                pretty = pretty[:i]
                break
        readable[name] = pretty
    return readable


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nvcc", default=shutil.which("nvcc") or "nvcc")
    parser.add_argument("--arch", action="append", required=True, help="e.g. 80 or 90a; repeat for several")
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--standalone", nargs="*", default=[], help="torch-free .cu files")
    parser.add_argument("--glue", nargs="*", default=[], help=".cu files that include torch headers")
    parser.add_argument("--glue-flag", action="append", default=[], help="extra nvcc flag for --glue sources")
    args = parser.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)

    include = ["-I" + os.path.join(ROOT, "csrc", "include")]
    # Torch-free sources are held to C++17 so the kernels stay usable outside torch's C++20.
    jobs = [(src, ["-std=c++17", *include]) for src in args.standalone]
    jobs += [(src, ["-std=c++20", "-I" + os.path.join(ROOT, "csrc"), *include, *args.glue_flag]) for src in args.glue]
    if not jobs:
        sys.exit("compile_check: no sources given")
    print(f"compile_check: {args.nvcc}, archs {', '.join('sm_' + a for a in args.arch)}, {len(jobs)} sources", flush=True)

    failed, rows = [], []
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        futures = [pool.submit(compile_one, args.nvcc, src, args.arch, flags, args.out_dir) for src, flags in jobs]
        for future in futures:
            source, rc, seconds, output, cmd = future.result()
            rel = os.path.relpath(source, ROOT)
            print(f"  {rel}: {'ok' if rc == 0 else 'FAILED'} in {seconds:.1f}s")
            if rc != 0:
                failed.append(rel)
                print("    " + " ".join(cmd) + "\n" + output)
                continue
            found = parse(output)
            if not found:
                print(f"    note: {rel} defines no kernels")
            rows += [dict(row, source=rel) for row in found]

    names = demangle(sorted({row["name"] for row in rows}))
    header = ("arch", "kernel", "registers", "stack B", "spill stores B", "spill loads B", "source")
    table = [header] + [
        (r["arch"], names[r["name"]], str(r["regs"] if r["regs"] is not None else "-"), str(r["stack"]),
         str(r["spill_st"]), str(r["spill_ld"]), r["source"])
        for r in sorted(rows, key=lambda r: (r["arch"], names[r["name"]], r["source"]))
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for i, row in enumerate(table):
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))

    spilling = [r for r in rows if r["spill_st"] or r["spill_ld"]]
    for r in spilling:
        print(f"compile_check: SPILL in {names[r['name']]} ({r['arch']}, {r['source']}): "
              f"{r['spill_st']} B stored, {r['spill_ld']} B loaded")
    for arch in args.arch:  # every arch must have produced kernels
        if not any(r["arch"] == f"sm_{arch}" for r in rows) and not failed:
            failed.append(f"no kernels reported for sm_{arch}")
    if failed or spilling:
        print(f"compile_check: FAILED ({len(failed)} compile failures, {len(spilling)} spilling kernels)")
        return 1
    print(f"compile_check: ok, {len(rows)} kernel builds, no spills")
    return 0


if __name__ == "__main__":
    sys.exit(main())
