"""`specdec bench kernels`: every per-op benchmark, short sweep by default, `--full` for all,
`--goal` for the goal configurations alone (tree attention B=8 T=64 prefix 8k; verify B=64
V=128k chain 4 and tree 64, greedy and sampled; n-gram B=256 L=32k), written to *_goal_*.json.

Each benchmark is a module with `main(argv) -> int`:
  ngram           specdec_kernels.benchmarks.ngram (host-side drafting: runs on every machine)
  verify          specdec_kernels.benchmarks.verify (GPU only)
  tree_attention  specdec_kernels.benchmarks.tree_attention (GPU only)
On a machine without a GPU only n-gram drafting (C++) runs: verify and tree attention measure
GPU kernels (a compiled CPU kernel, where `_C` has one, has no CPU mode in those benchmarks
yet), and Triton-interpreter timings are not results, so they are skipped with the reason.
On a GPU the GPU benchmarks run first (verify, tree attention, then n-gram): a run stopped at a
time limit has measured what a GPU machine is there for. Each benchmark rewrites its JSON after
every config, so a stopped run keeps the rows it finished ("complete": false).
"""

import argparse
import importlib
import time
import traceback

import torch

from . import common

BENCHMARKS = ("ngram", "verify", "tree_attention")
GPU_BENCHMARKS = ("verify", "tree_attention")  # what a GPU machine is for: measured first there


def load_benchmark(name: str):
    """The module `specdec_kernels.benchmarks.<name>` (it has `main(argv) -> int`)."""
    if name not in BENCHMARKS:
        raise ValueError(f"load_benchmark: name must be one of {', '.join(BENCHMARKS)}, got {name!r}")
    return importlib.import_module(f"specdec_kernels.benchmarks.{name}")


def cpu_skip_reason(name: str):
    """Why `name` is not run on a CPU-only machine (None: it runs)."""
    from ..ops._extension import available_backends

    if name == "ngram":
        return None
    # verify and tree_attention time GPU kernels only: run without a GPU, their main() would
    # refuse (status 2) unless --smoke, whose interpreted numbers are not results.
    if "cpu" in available_backends(name, "cpu"):
        return "the benchmark measures GPU kernels only (no CPU mode yet for the compiled CPU kernel)"
    return ("GPU only: on the CPU there is only the plain-torch reference, and Triton-interpreter timings "
            "are not results")


def run_order(names, device) -> list:
    """`names` in the order they run on `device`: on a GPU the GPU benchmarks (GPU_BENCHMARKS)
    first, on a CPU the others first (the GPU ones are only skipped there, with the reason);
    within each group the given order is kept."""
    gpu = torch.device(device).type == "cuda"
    return sorted(names, key=lambda name: (name in GPU_BENCHMARKS) != gpu)  # a stable sort


def argv_for(name: str, *, full: bool, smoke: bool, out_dir, device, goal: bool = False) -> list:
    """Command line for one benchmark's main(argv), writing into out_dir."""
    mode = ["--smoke"] if smoke else (["--full"] if full else (["--goal"] if goal else []))
    file = f"{name}_{common.device_slug(device)}.json"  # n-gram on a GPU machine: its CUDA kernel too
    if smoke:
        file = file.replace(".json", "_smoke.json")
    elif goal:  # beside the sweep's file, not over it
        file = file.replace(".json", "_goal.json")
    return mode + ["--out", str(out_dir / file)]


def main(argv=None) -> int:
    """Run the per-op benchmarks; returns 0 if every one that ran succeeded."""
    parser = argparse.ArgumentParser(prog="specdec bench kernels", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    return run(args)


def add_arguments(parser):
    """The `specdec bench kernels` options."""
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--full", action="store_true", help="every benchmark's full sweep")
    mode.add_argument("--smoke", action="store_true", help="tiny configs that only check the code runs")
    mode.add_argument("--goal", action="store_true",
                      help="only the configurations the goals are stated at (issue 37; what a short GPU window "
                           "measures first)")
    parser.add_argument("--out-dir", default=None, help="results folder (default bench/results of the checkout)")
    parser.add_argument("--only", default=None, help=f"comma-separated subset of {', '.join(BENCHMARKS)}")
    return parser


def run(args) -> int:
    """The runner behind `specdec bench kernels` (args from `add_arguments`)."""
    from pathlib import Path

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out_dir = Path(args.out_dir) if args.out_dir else common.results_dir()
    names = [n.strip() for n in args.only.split(",")] if args.only else list(BENCHMARKS)
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        raise SystemExit(f"specdec bench kernels: --only: unknown {unknown}; choose from {', '.join(BENCHMARKS)}")
    names = run_order(names, device)
    summary = []
    for name in names:
        reason = cpu_skip_reason(name) if device.type == "cpu" else None
        if reason:
            print(f"== {name}: skipped ({reason})", flush=True)
            summary.append((name, "skipped", reason))
            continue
        source = f"specdec_kernels.benchmarks.{name}"
        argv = argv_for(name, full=args.full, smoke=args.smoke, goal=args.goal, out_dir=out_dir, device=device)
        print(f"== {name}: {source} main({argv})", flush=True)
        start = time.perf_counter()
        try:
            status = load_benchmark(name).main(argv)
        except SystemExit as exit_:  # a benchmark that exits instead of returning
            status = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
            if exit_.code not in (None, 0) and not isinstance(exit_.code, int):
                print(exit_.code, flush=True)
        except Exception:  # noqa: BLE001  (one broken benchmark must not hide the others' results)
            traceback.print_exc()
            status = 1
        status = 0 if status is None else status
        summary.append((name, "ok" if status == 0 else f"failed (status {status})",
                        f"{source}, {time.perf_counter() - start:.0f} s"))
    print()
    common.print_table(["benchmark", "result", "details"], summary)
    return 0 if all(s[1] in ("ok", "skipped") for s in summary) else 1
