"""Shared pieces of the benchmarks: run metadata, the timers, the table format, JSON and plots.

Timing rules (timing lives in benchmarks, never in timed tests):
- GPU: CUDA events around each call, a few warm-up calls first, the median reported; the
  inputs rotate over several copies (or L2 is flushed) so that a call never finds its inputs
  in a cache the previous call warmed.
- CPU: `torch.utils.benchmark.Timer` (blocked autorange), median reported, inputs rotated the
  same way over copies that together exceed the last-level cache.
"""

import datetime
import importlib.metadata
import itertools
import json
import os
import platform
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from .._platform import cpu_name

PACKAGE_DIR = Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------------------- paths


def repo_root() -> Optional[Path]:
    """The source checkout holding this package (it has `bench/` beside the package), else None."""
    root = PACKAGE_DIR.parent
    return root if (root / "bench").is_dir() and (root / "specdec_kernels").is_dir() else None


def results_dir() -> Path:
    """Where results go by default: the checkout's `bench/results`, else `./bench/results`
    (an installed package run from anywhere)."""
    root = repo_root()
    return (root if root is not None else Path.cwd()) / "bench" / "results"


# ----------------------------------------------------------------------------- metadata


def version(dist: str) -> Optional[str]:
    """Installed version of a distribution without importing it (None if absent)."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def git_commit() -> str:
    """$SPECDEC_COMMIT when set (a copy of the checkout without `.git`, such as the one the GPU
    session runs in, gets it from the script that made the copy); else the short commit of the
    checkout this package runs from, with "+dirty" when it has local changes (then the numbers
    may not belong to that commit); "unknown" outside a checkout."""
    commit = os.environ.get("SPECDEC_COMMIT", "").strip()
    if commit:
        return commit
    root = repo_root()
    if root is None:
        return "unknown"
    try:
        commit = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=root, text=True,
                                         stderr=subprocess.DEVNULL).strip()
        dirty = subprocess.check_output(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, text=True,
                                        stderr=subprocess.DEVNULL).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + ("+dirty" if dirty else "")


def device_name(device) -> str:
    """The GPU's name (torch.cuda.get_device_name) or the CPU model."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_name()


def slug(name: str) -> str:
    """A device name as a file-name part: "NVIDIA H100 80GB HBM3" -> "nvidia_h100_80gb_hbm3"."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_") or "unknown"


def device_slug(device) -> str:
    """"cpu" for any CPU (results files are per device kind there), the GPU's name slug otherwise."""
    device = torch.device(device)
    return "cpu" if device.type == "cpu" else slug(device_name(device))


def metadata(benchmark: str, device, backend: Optional[str], **extra) -> dict:
    """The header of a results JSON (benchmark, device, backend, torch/triton versions, commit,
    date; each row holds config, ours_us, floor_us and peers_us) plus threads and `extra`."""
    return {
        "benchmark": benchmark,
        "device": device_name(device),
        "backend": backend,
        "torch": torch.__version__,
        "triton": version("triton"),
        "transformers": version("transformers"),
        "commit": git_commit(),
        "date": datetime.date.today().isoformat(),
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "cuda": torch.version.cuda if torch.device(device).type == "cuda" else None,
        **extra,
    }


def import_error(module: str) -> Optional[str]:
    """None if `module` imports, else why not (a peer left out for it is named in the results,
    never silently missing). Any exception counts: a broken install (missing CUDA library, ABI
    mismatch) is as unusable as an absent one."""
    try:
        importlib.import_module(module)
    except Exception as error:  # noqa: BLE001
        return f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"
    return None


def write_json(result: dict, path, *, quiet: bool = False) -> Path:
    """Write `result` (indented) to `path`, creating folders; returns the path. The file is
    replaced atomically, so a run killed while writing leaves the previous version, never a
    truncated one. quiet: no "wrote ..." line (the partial writes after every row)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1)
    os.replace(tmp, path)
    if not quiet:
        print(f"wrote {path}", flush=True)
    return path


def write_rows(result: dict, rows, path, *, planned: int, complete: bool) -> Path:
    """The results JSON of a sweep so far: `result` (the header, `metadata`) with `rows`,
    "complete" and "rows_planned", written to `path`. The benchmarks call it after every row
    with complete=False, so a run killed at a time limit still leaves the rows it finished, and
    once more at the end with complete=True (the only write that prints its path)."""
    result["rows"] = list(rows)
    result["rows_planned"] = planned
    result["complete"] = complete
    return write_json(result, path, quiet=not complete)


def device_generator(gen: torch.Generator, device) -> torch.Generator:
    """A generator on `device` seeded from the CPU generator `gen`: large inputs drawn on the
    device (seconds of the CPU generator and GBs of host memory otherwise), the run still
    reproducible from its one seed."""
    return torch.Generator(device).manual_seed(int(torch.randint(1 << 62, (), generator=gen)))


# ----------------------------------------------------------------------------- timing


@dataclass
class Timing:
    """Microseconds per call: `median_us` (what results report), `best_us`, and how many samples."""

    median_us: float
    best_us: float
    samples: int


def last_level_cache_bytes(device) -> int:
    """L2 size of the GPU, or the CPU's last-level cache (64 MiB when unknown)."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 64 << 20))
    sizes = []
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = path.read_text().strip().upper()
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        try:
            sizes.append(int(text.rstrip("KMG")) * scale)
        except ValueError:
            pass
    return max(sizes) if sizes else 64 << 20


def rotations(bytes_per_set: int, device, *, most: int = 16, memory_budget: int = 1 << 30) -> int:
    """How many copies of an input set to rotate over so that together they exceed twice the
    last-level cache (1 when one set already does), capped by `most` and `memory_budget`."""
    need = (2 * last_level_cache_bytes(device)) // max(1, bytes_per_set) + 1
    fit = max(1, memory_budget // max(1, bytes_per_set))
    return int(max(1, min(need, most, fit)))


def time_cuda(call: Callable[[int], object], *, n_sets: int = 1, reps: int = 50, warmup: int = 5,
              flush_l2: bool = False, device=None) -> Timing:
    """Median of CUDA-event-timed calls `call(i)` (i = input set, rotating over `n_sets`).

    warmup calls run first (compilation, allocator, autotuning). flush_l2: overwrite a buffer
    twice the L2 size before every call, outside the timed interval, for inputs too large to
    copy (then n_sets = 1 is enough).
    """
    device = torch.device(device or "cuda")
    flush = None
    if flush_l2:
        flush = torch.empty(2 * last_level_cache_bytes(device), dtype=torch.uint8, device=device)
    for i in range(warmup):
        call(i % n_sets)
    torch.cuda.synchronize(device)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        if flush is not None:
            flush.zero_()
        starts[i].record()
        call(i % n_sets)
        ends[i].record()
    torch.cuda.synchronize(device)
    times = sorted(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends))
    return Timing(times[len(times) // 2], times[0], reps)


def time_cpu(call: Callable[[int], object], *, n_sets: int = 1, min_run_time: float = 0.2,
             warmup: bool = True) -> Timing:
    """`torch.utils.benchmark.Timer(...).blocked_autorange` of `call(i)` with i rotating over
    `n_sets` input sets; median and best per-call time over the measured blocks.
    warmup: one untimed call first (first-call allocations, lazy imports); skip it for slow
    calls that already ran once."""
    from torch.utils import benchmark

    order = itertools.cycle(range(n_sets))
    if warmup:
        call(0)
    timer = benchmark.Timer(stmt="call(next(order))", globals={"call": call, "order": order},
                            num_threads=torch.get_num_threads())
    measurement = timer.blocked_autorange(min_run_time=min_run_time)
    times = measurement.times
    return Timing(1e6 * measurement.median, 1e6 * min(times), len(times) * measurement.number_per_run)


def time_kernel(call: Callable[[int], object], device, *, reps: int = 50, n_sets: int = 1, warmup: int = 5,
                flush_l2: bool = False) -> Timing:
    """The GPU benchmarks' timer: `time_cuda` on a GPU; on the CPU (their --smoke runs under the
    Triton interpreter, whose numbers are never recorded) the wall-clock median of `reps` calls
    `call(i)`, i rotating over `n_sets`, with no warm-up (an interpreted call is slow enough)."""
    if torch.device(device).type == "cuda":
        return time_cuda(call, n_sets=n_sets, reps=reps, warmup=warmup, flush_l2=flush_l2, device=device)
    times = []
    for i in range(max(1, reps)):
        start = time.perf_counter()
        call(i % n_sets)
        times.append((time.perf_counter() - start) * 1e6)
    times.sort()
    return Timing(times[len(times) // 2], times[0], len(times))


# ----------------------------------------------------------------------------- output


def fmt(x, digits: int = 1) -> str:
    """A number for a table cell ("-" for None)."""
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def fmt_us(us: Optional[float]) -> str:
    """A time in microseconds for a table cell: "45.6us", "1.23ms" from 1000 us on ("-" for None)."""
    if us is None:
        return "-"
    return f"{us / 1000:.2f}ms" if us >= 1000 else f"{us:.1f}us"


def peer_cell(peer_us: Optional[float], ours_us: Optional[float]) -> str:
    """A peer's table cell: "us (peer / ours x)" (> 1x: ours is faster); "-" when the peer did not run."""
    if peer_us is None:
        return "-"
    return f"{peer_us:.1f} ({peer_us / ours_us:.2f}x)" if ours_us else f"{peer_us:.1f}"


def print_progress(index: int, total: int, label: str, row: dict) -> None:
    """A line per finished config while a sweep runs (the table comes at the end): our backend
    and time, then the errors of methods that could not run it."""
    print(f"  [{index}/{total}] {label}: {row.get('ours_backend') or 'ours'} {fmt(row.get('ours_us'))} us", flush=True)
    for name, error in row.get("errors", {}).items():
        print(f"    {name}: {error}", flush=True)


def print_table(headers: Sequence[str], rows: Sequence[Sequence], *, file=None) -> None:
    """A plain text table: columns as wide as their widest cell, numbers right-aligned."""
    cells = [[str(h) for h in headers]] + [[c if isinstance(c, str) else fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    numeric = [all(_is_number(r[i]) for r in cells[1:]) for i in range(len(headers))]

    def line(row):
        return "  ".join(c.rjust(w) if num else c.ljust(w) for c, w, num in zip(row, widths, numeric)).rstrip()

    print(line(cells[0]), file=file)
    print("  ".join("-" * w for w in widths), file=file)
    for row in cells[1:]:
        print(line(row), file=file, flush=True)


def _is_number(text: str) -> bool:
    return bool(re.fullmatch(r"[-+]?[\d.]+(e[-+]?\d+)?(x|%|us|ms)?|-", text))


def pyplot():
    """matplotlib.pyplot with the Agg backend, or None (and a message) if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed (pip install 'specdec_kernels[bench]'): no plots", flush=True)
        return None
    return plt


def save_figure(plt, fig, path) -> Path:
    """Lay out, write (PNG, 110 dpi) and close `fig`; returns the path."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}", flush=True)
    return Path(path)


def plot_panels(path, panels, *, xlabel: str, ylabel: str, title: Optional[str] = None, xbase: int = 2,
                panel_width: float = 4.0, height: float = 3.6) -> Optional[Path]:
    """The benchmarks' line plot: one log-log panel per (panel_title, xs, {series: ys}) in
    `panels`, a line per series (points whose y is None or 0 are left out; a series named
    "floor..." is dashed), the legend on the last panel. Returns the PNG's path, None without
    matplotlib."""
    plt = pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(panel_width * len(panels), height), squeeze=False)
    for ax, (panel_title, xs, series) in zip(axes[0], panels):
        for name, ys in series.items():
            points = [(x, y) for x, y in zip(xs, ys) if y]
            if points:
                ax.plot(*zip(*points), marker="o", linestyle="--" if name.startswith("floor") else "-", label=name)
        ax.set_xscale("log", base=xbase)
        ax.set_yscale("log")
        ax.set_title(panel_title, fontsize=9)
        ax.set_xlabel(xlabel)
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel(ylabel)
    axes[0][-1].legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    return save_figure(plt, fig, path)
