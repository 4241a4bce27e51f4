"""Python and launch overhead of a decoding step on a GPU, eager and compiled (issue 36's GPU goal).

The goal: with the compiled verify step (`generate(..., compile="reduce-overhead")`: inductor
and CUDA graphs), Python and kernel-launch overhead is at most 10% of a step for the default
model in bf16. The default model's weights do not travel to a GPU machine, and a step's
kernels and Python do not depend on the weights' values, so this runs the default model's
shapes with random bf16 weights (`random_default_model`; the trained EAGLE head for the same
shapes, its identity check skipped: its drafts are meaningless for a random target, its cost
is real).

Per batch size, method (plain decoding, an n-gram chain, the EAGLE head's tree; fixed sizes,
`adaptive=False`, so the shapes and the step count do not depend on timing) and compile
setting (eager, each mode asked):
1. a warm-up call (compiles the graphs; its compile seconds are reported);
2. a timed call: the decoding steps' wall time per step (`stats.time_total - time_prefill`),
   tokens per step;
3. a profiled call: the GPU's busy time per step (a step: from one `specdec::verify` call to
   the next; busy: the union of the kernel, memcpy and memset intervals starting in it;
   profiling slows the host, not the kernels). overhead = 1 - busy / wall over the whole
   decode (means: plain decoding reads nothing back between stop checks, so the host runs
   ahead of the GPU and one step's host time says nothing; median-based too): the share of a
   step the GPU waits for the host;
4. on CUDA, a call under `torch.cuda.set_sync_debug_mode("warn")`: the host syncs per step
   (each warns once).

The outputs of each setting are compared with eager's (bf16: a compiled graph may round
differently, so a mismatch is reported, not an error). Rows are written to --out as they
finish; a --deadline-s stops before a setting that would not fit.

    python tools/gpu_step_overhead.py --out bench/results/gpu_step_overhead.json
    python tools/gpu_step_overhead.py --device cpu --layers 2 --compile off,default   # a CPU rehearsal
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specdec_kernels.benchmarks import common  # noqa: E402
from specdec_kernels.benchmarks.e2e.models import random_default_model  # noqa: E402
from specdec_kernels import NgramDrafter, generate  # noqa: E402

GOAL_OVERHEAD = 0.10
HEAD_DIR = Path(__file__).resolve().parent.parent / "specdec_kernels" / "heads" / "trained" / "smollm2-135m-instruct-eagle"
COMPILE_SETTINGS = {"off": False, "default": "default", "reduce-overhead": "reduce-overhead"}


def eagle_drafter(model):
    """The trained EAGLE head on the random target (identity check skipped: cost only)."""
    from specdec_kernels.heads import drafters as head_drafters

    check = head_drafters.check_target
    head_drafters.check_target = lambda *args, **kwargs: None
    try:
        return head_drafters.EagleDrafter(model, HEAD_DIR)
    finally:
        head_drafters.check_target = check


def make_drafter(method, model):
    if method == "plain":
        return None
    if method == "ngram":
        return NgramDrafter(num_tokens=5)
    if method == "eagle":
        return eagle_drafter(model)
    raise SystemExit(f"gpu_step_overhead: unknown method {method!r} (plain, ngram, eagle)")


def prompts(batch, length, vocab, device):
    """Random prompts whose second half repeats the first (so the n-gram drafter finds matches)."""
    gen = torch.Generator().manual_seed(batch)
    half = torch.randint(1, vocab, (batch, length // 2), generator=gen)
    return torch.cat([half, half], dim=1).to(device)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(model, method, ids, compile, max_new_tokens):
    out = generate(model, ids, drafter=make_drafter(method, model), max_new_tokens=max_new_tokens,
                   temperature=0.0, eos_token_id=[], adaptive=False, compile=compile)
    sync(ids.device)
    return out


def host_syncs(model, method, ids, compile, max_new_tokens):
    """Host syncs per step of one call (None on a CPU): CUDA's sync debug mode warns at each."""
    import warnings

    if ids.device.type != "cuda":
        return None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = run(model, method, ids, compile, max_new_tokens)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = sum(1 for w in caught if "synchroniz" in str(w.message).lower())
    return syncs / max(out.stats.steps, 1)


def _union(spans):
    """Total length of the union of (start, end) intervals."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(spans):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def gpu_busy(model, method, ids, compile, max_new_tokens, breakdown=True):
    """The GPU's busy microseconds per step of one profiled call (None on a CPU): the steps
    are the spans between consecutive `specdec::verify` calls (one a step); busy is the union
    of the kernel, memcpy and memset intervals that start in a step. Returns the median and the
    mean over the steps, and the launches counted over them."""
    from torch.profiler import ProfilerActivity, profile

    if ids.device.type != "cuda":
        return None
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run(model, method, ids, compile, max_new_tokens)
    events = prof.events()
    marks = sorted(e.time_range.start for e in events if e.name == "specdec::verify")
    if len(marks) < 3:
        return None
    gpu = sorted((e.time_range.start, e.time_range.end) for e in events
                 if e.device_type == torch.autograd.DeviceType.CUDA)
    per_step, i = [], 0
    for left, right in zip(marks, marks[1:]):
        while i < len(gpu) and gpu[i][0] < left:
            i += 1
        j = i
        while j < len(gpu) and gpu[j][0] < right:
            j += 1
        per_step.append(_union(gpu[i:j]))
    def counted(names):
        return sum(1 for e in events if e.name in names and marks[0] <= e.time_range.start < marks[-1])
    steps = len(per_step)
    # What the GPU time goes to (kernels by name) and how many host ops a step runs (ops with no
    # op above them: what the loop calls; a compiled region counts once).
    kernels, host = {}, {}
    for e in events if breakdown else ():
        if not marks[0] <= e.time_range.start < marks[-1]:
            continue
        if e.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels.setdefault(e.name[:90], [0, 0.0])
            k[0] += 1
            k[1] += e.time_range.end - e.time_range.start
        elif e.name.startswith(("aten::", "specdec::", "Torch-Compiled")):
            parent, nested = e.cpu_parent, False
            while parent is not None and not nested:
                nested = parent.name.startswith(("aten::", "specdec::", "Torch-Compiled"))
                parent = parent.cpu_parent
            if not nested:
                host[e.name] = host.get(e.name, 0) + 1
    top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:15]
    return dict(busy_us_median=statistics.median(per_step), busy_us_mean=sum(per_step) / steps,
                top_kernels=[dict(name=n, per_step=c / steps, us_per_step=t / steps) for n, (c, t) in top],
                host_ops_per_step=sum(host.values()) / steps,
                top_host_ops={n: c / steps for n, c in sorted(host.items(), key=lambda kv: -kv[1])[:20]},
                kernels_per_step=sum(1 for s in gpu if marks[0] <= s[0] < marks[-1]) / steps,
                kernel_launches_per_step=counted({"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel",
                                                  "cuLaunchKernelEx"}) / steps,
                graph_launches_per_step=counted({"cudaGraphLaunch", "cuGraphLaunch"}) / steps)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--layers", type=int, default=None, help="of the default model's 30 (default all)")
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--methods", default="plain,ngram,eagle")
    parser.add_argument("--plan", default=None, metavar="B:METHOD,...",
                        help="the (batch size, method) pairs in this order, instead of --batch-sizes x --methods")
    parser.add_argument("--compile", default="off,reduce-overhead", help=f"comma-separated of {list(COMPILE_SETTINGS)}")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--deadline-s", type=float, default=None, help="start no setting after this many seconds")
    parser.add_argument("--out", default=str(common.results_dir() / "gpu_step_overhead.json"))
    args = parser.parse_args(argv)
    start = time.perf_counter()
    device = torch.device(args.device)
    compiles = [c for c in args.compile.split(",") if c]
    bad = [c for c in compiles if c not in COMPILE_SETTINGS]
    if bad:
        raise SystemExit(f"gpu_step_overhead: --compile: unknown {bad}; choose from {list(COMPILE_SETTINGS)}")
    model = random_default_model(layers=args.layers, device=device, dtype=getattr(torch, args.dtype))
    result = common.metadata("gpu_step_overhead", device, None, dtype=args.dtype,
                             layers=model.config.num_hidden_layers, max_new_tokens=args.max_new_tokens,
                             prompt_len=args.prompt_len, goal_overhead=GOAL_OVERHEAD)
    rows = []
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    if args.plan:
        plan = [(int(pair.split(":")[0]), pair.split(":")[1]) for pair in args.plan.split(",")]
    else:
        plan = [(int(b), m) for b in args.batch_sizes.split(",") for m in args.methods.split(",")]
    for batch, method in plan:
        ids = prompts(batch, args.prompt_len, model.config.vocab_size, device)
        eager_out = None
        for name in compiles:
            elapsed = time.perf_counter() - start
            label = f"batch {batch} {method} compile={name}"
            if args.deadline_s is not None and elapsed > args.deadline_s:
                print(f"{label}: skipped (deadline, {elapsed:.0f} s)", flush=True)
                rows.append(dict(batch=batch, method=method, compile=name, skipped="deadline"))
                continue
            row = dict(batch=batch, method=method, compile=name)
            try:
                with torch.inference_mode():
                    warm = run(model, method, ids, COMPILE_SETTINGS[name], args.max_new_tokens)
                    timed = run(model, method, ids, COMPILE_SETTINGS[name], args.max_new_tokens)
                    prof = gpu_busy(model, method, ids, COMPILE_SETTINGS[name], args.max_new_tokens)
                    syncs = host_syncs(model, method, ids, COMPILE_SETTINGS[name], args.max_new_tokens)
            except Exception as error:  # a failed setting is a result: record it, go on
                row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
                print(f"{label}: FAILED {row['error']}", flush=True)
                rows.append(row)
                continue
            stats = timed.stats
            # Steady state: the median step (a step that compiled, or re-recorded a CUDA
            # graph for this call's new cache buffers, is an outlier, not a step's cost).
            step_us = 1e6 * statistics.median(t["seconds"] for t in stats.trace if not t.get("compiled_graph"))
            row.update(steps=stats.steps, tokens_per_step=stats.tokens_per_step,
                       nodes_per_step=stats.nodes_per_step, step_us=step_us,
                       step_us_mean=1e6 * (stats.time_total - stats.time_prefill) / max(stats.steps, 1),
                       tokens_per_s=batch * args.max_new_tokens / stats.time_total,
                       prefill_ms=1e3 * stats.time_prefill, compiled=stats.compiled,
                       compile_s=warm.stats.time_compile, warm_call_s=warm.stats.time_total)
            if name == "off":
                eager_out = timed.sequences
            elif eager_out is not None:
                row["rows_equal_to_eager"] = int((timed.sequences == eager_out).all(dim=1).sum())
                row["tokens_equal_to_eager"] = float((timed.sequences == eager_out).float().mean())
            if syncs is not None:
                row["host_syncs_per_step"] = syncs
            if prof is not None:
                row.update(prof)
                row["overhead"] = 1.0 - prof["busy_us_mean"] / row["step_us_mean"]
                row["overhead_median"] = 1.0 - prof["busy_us_median"] / step_us
            rows.append(row)
            share = f", GPU busy {row['busy_us_mean']:.0f} us, overhead {100 * row['overhead']:.0f}%" \
                if prof is not None else ""
            print(f"{label}: {stats.steps} steps, {stats.tokens_per_step:.2f} tok/step, {row['step_us_mean']:.0f} us/step"
                  f"{share}, compile {row['compile_s']:.1f} s", flush=True)
            result["rows"] = rows
            common.write_json(result, args.out, quiet=True)
    result["rows"] = rows
    result["seconds"] = time.perf_counter() - start
    common.write_json(result, args.out)
    met = [r for r in rows if r.get("compile") == "reduce-overhead" and "overhead" in r]
    for r in met:
        verdict = "MET" if r["overhead"] <= GOAL_OVERHEAD else "MISSED"
        print(f"goal overhead<=10% batch {r['batch']} {r['method']}: {100 * r['overhead']:.0f}% {verdict}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
