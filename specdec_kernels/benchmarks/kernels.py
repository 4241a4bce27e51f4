"""`specdec bench kernels`: every per-op benchmark, short sweep by default, `--full` for all.

Each benchmark is a module with `main(argv) -> int`:
  ngram           specdec_kernels.benchmarks.ngram (host-side drafting: runs on every machine)
  verify          specdec_kernels.benchmarks.verify if the package has it, else bench/bench_verify.py
                  of the checkout (loaded by path); the output says which
  tree_attention  specdec_kernels.benchmarks.tree_attention (GPU only)
On a machine without a GPU only what measures a real CPU backend runs: n-gram drafting (C++),
and verify only if `_C` has a compiled CPU verify kernel. Tree attention has no CPU backend but
the plain-torch reference, and Triton-interpreter timings are not results, so it is skipped.
"""

import argparse
import importlib
import importlib.util
import time
import traceback

import torch

from . import common

BENCHMARKS = ("ngram", "verify", "tree_attention")


def load_benchmark(name: str):
    """(module with main(argv), where it came from) or (None, why not)."""
    try:
        return importlib.import_module(f"specdec_kernels.benchmarks.{name}"), f"specdec_kernels.benchmarks.{name}"
    except ModuleNotFoundError as error:
        if error.name != f"specdec_kernels.benchmarks.{name}":
            raise
    root = common.repo_root()
    path = root / "bench" / f"bench_{name}.py" if root is not None else None
    if path is None or not path.is_file():
        return None, f"no specdec_kernels.benchmarks.{name} and no checkout with bench/bench_{name}.py"
    spec = importlib.util.spec_from_file_location(f"_specdec_bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not callable(getattr(module, "main", None)):
        return None, f"{path} has no main(argv)"
    return module, str(path)


def cpu_skip_reason(name: str):
    """Why `name` is not run on a CPU-only machine (None: it runs)."""
    import specdec_kernels as sk

    if name == "ngram":
        return None
    if name == "verify":
        if "cpu" in sk.available_backends("verify", "cpu"):
            return None
        return "no compiled CPU verify kernel in _C (only the plain-torch reference): nothing of ours to time"
    if "cpu" in sk.available_backends("tree_attention", "cpu"):
        return "the benchmark measures GPU kernels only (no CPU mode yet for the compiled CPU kernel)"
    return ("GPU only: on the CPU there is only the plain-torch reference, and Triton-interpreter timings "
            "are not results")


def argv_for(name: str, *, full: bool, smoke: bool, out_dir, device) -> list:
    """Command line for one benchmark's main(argv), writing into out_dir."""
    mode = ["--smoke"] if smoke else (["--full"] if full else [])
    file = "ngram_cpu.json" if name == "ngram" else f"{name}_{common.device_slug(device)}.json"
    if smoke:
        file = file.replace(".json", "_smoke.json")
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
    summary = []
    for name in names:
        reason = cpu_skip_reason(name) if device.type == "cpu" else None
        if reason:
            print(f"== {name}: skipped ({reason})", flush=True)
            summary.append((name, "skipped", reason))
            continue
        module, source = load_benchmark(name)
        if module is None:
            print(f"== {name}: not available ({source})", flush=True)
            summary.append((name, "not available", source))
            continue
        argv = argv_for(name, full=args.full, smoke=args.smoke, out_dir=out_dir, device=device)
        print(f"== {name}: {source} main({argv})", flush=True)
        start = time.perf_counter()
        try:
            status = module.main(argv)
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
    return 0 if all(s[1] in ("ok", "skipped", "not available") for s in summary) else 1
