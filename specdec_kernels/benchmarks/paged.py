"""Paged against dense tree attention: the same logical caches, once dense [B, S, Hkv, D] and
once cut into shuffled pages [num_pages, page_size, Hkv, D] behind a block table.

    python bench/bench_paged.py                 # CPU: SmolLM2-135M shapes, page size 16
    python bench/bench_paged.py --page-size 32  # another page size (written to another file)
    python bench/bench_paged.py --smoke         # one tiny config, nothing recorded
    python bench/bench_paged.py --e2e           # generate end to end: paged against dense KV cache

Sweep (CPU): SmolLM2-135M attention (Hq=9, Hkv=3, D=64), fp32 (the dtype the CPU models
run in), T in {1, 11, 64} tree nodes (random trees), prefix in {512, 2048}, batch in {1, 8}.
On a GPU: the same sweep in bf16 plus llama3-8b shapes (Hq=32, Hkv=8, D=128).

Methods (each checked against the dense reference before timing):
  paged   tree_attention(..., block_table=table): ours on the paged pool ("ours")
  dense   tree_attention(...) on the dense cache (the peer: the same kernel without pages)
Both go through the public API with value checks off (config.value_checks(False)), as
`generate` calls them, so the times are the kernels plus the wrapper's metadata checks.

Timing: with one thread (--threads 1) the clock is the process's CPU time (time.process_time),
which leaves out the time it waits for a core when other processes load the machine; with
more threads, wall time. The two methods alternate in short blocks of calls (dense block, paged block, ...,
each about 5 ms) for --min-time seconds each, so load from other processes on a shared
machine hits both alike; each block gives one per-call time. We report per method the
median and the best (lowest) block, and paged / dense for both: on a loaded machine the
medians carry the other processes' noise, and best / best is the closer estimate of the
uncontended ratio. CUDA: CUDA-event timing (benchmarks.common.time_cuda).
Writes bench/results/paged_<device>.json (paged_<device>_ps<N>.json for page sizes other
than 16); not in --smoke mode.

--e2e: `generate` end to end on the default model (SmolLM2-135M-Instruct), batch 1, greedy,
code edit and chat prompts: the e2e benchmark's methods ours_ngram (dense KV cache) and
ours_ngram_paged (kv_page_size=16), run by its runner (`benchmarks.e2e.runner.run_method`).
Each prompt runs dense, paged, dense, paged, ... (--rounds each, wall time, after a warm-up
call of both), so load from other processes hits both alike; paged output must equal dense
output token for token. Reports per workload the median tokens/s of each and paged / dense
(medians of the per-prompt ratios and of the best rounds). Writes
bench/results/paged_e2e_<device>.json.
"""

import argparse
import os
import time

import torch

from ..ops.tree import pack_tree_mask, tree_mask

from . import common

SHAPES_CPU = {"smollm2-135m": (9, 3, 64)}
SHAPES_GPU = {"smollm2-135m": (9, 3, 64), "llama3-8b": (32, 8, 128)}
NODES = (1, 11, 64)
PREFIXES = (512, 2048)
BATCHES = (1, 8)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="bench_paged", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--smoke", action="store_true", help="one tiny config, nothing recorded")
    parser.add_argument("--min-time", type=float, default=2.0, help="seconds of timed calls per method and config (CPU)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads for the run (default: torch's); on a loaded machine 1 is steadier")
    parser.add_argument("--out", default=None, help="JSON path (default bench/results/paged_<device>.json)")
    parser.add_argument("--e2e", action="store_true", help="generate end to end, paged against dense (see above)")
    parser.add_argument("--prompts", type=int, default=4, help="--e2e: prompts per workload (default 4)")
    parser.add_argument("--rounds", type=int, default=3, help="--e2e: timed runs of each cache per prompt (default 3)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="--e2e: default 64")
    return parser.parse_args(argv)


def random_parents(batch, num_nodes, gen):
    parents = torch.full((batch, num_nodes), -1, dtype=torch.int64)
    for i in range(1, num_nodes):
        parents[:, i] = torch.randint(0, i, (batch,), generator=gen)
    return parents


def make_inputs(batch, num_nodes, prefix, q_heads, kv_heads, head_dim, page_size, dtype, device, gen):
    """Dense caches of prefix + T tokens per row and the same tokens in a shuffled page pool."""
    tokens = prefix + num_nodes
    pages_per_row = -(-tokens // page_size)
    cache_len = pages_per_row * page_size
    k = torch.randn(batch, cache_len, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(batch, cache_len, kv_heads, head_dim, generator=gen).to(dtype)
    q = torch.randn(batch, num_nodes, q_heads, head_dim, generator=gen).to(dtype)
    num_pages = batch * pages_per_row
    order = torch.randperm(num_pages, generator=gen)  # row b's page j is pool page order[b * P + j]
    k_pool = torch.empty(num_pages, page_size, kv_heads, head_dim, dtype=dtype)
    v_pool = torch.empty_like(k_pool)
    k_pool[order] = k.reshape(num_pages, page_size, kv_heads, head_dim)
    v_pool[order] = v.reshape(num_pages, page_size, kv_heads, head_dim)
    table = order.view(batch, pages_per_row).to(torch.int32)
    mask = pack_tree_mask(tree_mask(random_parents(batch, num_nodes, gen)))
    seqlens = torch.full((batch,), prefix, dtype=torch.int32)
    to = lambda x: x.to(device)  # noqa: E731
    return tuple(map(to, (q, k, v, k_pool, v_pool, mask, seqlens, table)))


def time_alternating(calls, min_time, clock):
    """{name: (median_us, best_us)} of callables timed in alternating blocks (see the docstring),
    by `clock` (time.perf_counter: wall time; time.process_time: this process's CPU time)."""
    for call in calls.values():
        call()  # warm-up: scratch buffers, first-call allocations
    number = 1
    start = time.perf_counter()
    while time.perf_counter() - start < 0.005:  # calls per block: about 5 ms of the first method
        for _ in range(number):
            next(iter(calls.values()))()
        number *= 2
    samples = {name: [] for name in calls}
    deadline = time.perf_counter() + min_time * len(calls)
    while time.perf_counter() < deadline or min(len(s) for s in samples.values()) < 5:
        for name, call in calls.items():
            t0 = clock()
            for _ in range(number):
                call()
            samples[name].append((clock() - t0) / number * 1e6)
    return {name: (sorted(s)[len(s) // 2], min(s)) for name, s in samples.items()}


def time_gpu(calls, device):
    return {name: (t.median_us, t.best_us) for name, t in
            ((name, common.time_cuda(lambda _: call(), reps=50, warmup=3, flush_l2=True, device=device))
             for name, call in calls.items())}


E2E_WORKLOADS = ("code_edit", "chat")
E2E_METHODS = {"dense": "ours_ngram", "paged": "ours_ngram_paged"}


def run_e2e(args, device) -> dict:
    """The --e2e comparison (see the module docstring); returns the result to write."""
    from ..methods import stop_ids
    from ..models import load_model
    from ..workloads import load_workload
    from .e2e.runner import PAGED, SEED, make_batches, run_method

    model, tokenizer = load_model(None, dtype=torch.float32, device=device, verbose=False)
    eos, pad = stop_ids(model, tokenizer)
    run = dict(max_new_tokens=args.max_new_tokens, temperature=0.0, eos=eos, pad=pad, seed=SEED)
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    print(f"e2e paged vs dense: {common.device_name(device)}, {torch.get_num_threads()} threads; load average {load}",
          flush=True)
    rows = []
    for workload in E2E_WORKLOADS:
        batches = make_batches(load_workload(workload, limit=args.prompts), tokenizer, 1, device)
        rates = {name: [] for name in E2E_METHODS}
        ratios, best_ratios = [], []
        for index, (input_ids, mask, _) in enumerate(batches):
            for method in E2E_METHODS.values():  # warm-up (and the planner's first look at this prompt)
                run_method(method, model, None, input_ids, mask, **run)
            prompt_rates = {name: [] for name in E2E_METHODS}
            outputs = {}
            for _ in range(args.rounds):
                for name, method in E2E_METHODS.items():
                    sequences, seconds, stats = run_method(method, model, None, input_ids, mask, **run)
                    prompt_rates[name].append(sum(stats.new_tokens) / seconds)
                    outputs.setdefault(name, sequences)
            if not torch.equal(outputs["paged"], outputs["dense"]):
                raise AssertionError(f"{workload} prompt {index}: the paged cache's output differs from the dense one's")
            for name in E2E_METHODS:
                rates[name] += prompt_rates[name]
            median = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
            ratios.append(median(prompt_rates["dense"]) / median(prompt_rates["paged"]))
            best_ratios.append(max(prompt_rates["dense"]) / max(prompt_rates["paged"]))
            print(f"  {workload} prompt {index}: {input_ids.shape[1]} tokens, dense {median(prompt_rates['dense']):.1f} "
                  f"tok/s, paged {median(prompt_rates['paged']):.1f} tok/s, paged time / dense {ratios[-1]:.3f}",
                  flush=True)
        geo = lambda xs: torch.tensor(xs).log().mean().exp().item()  # noqa: E731
        rows.append({
            "config": {"workload": workload, "batch": 1, "temperature": 0.0, "method": E2E_METHODS["paged"],
                       "peer": E2E_METHODS["dense"], "page_size": PAGED[E2E_METHODS["paged"]],
                       "prompts": len(batches), "rounds": args.rounds, "max_new_tokens": args.max_new_tokens},
            "tokens_per_s": sorted(rates["paged"])[len(rates["paged"]) // 2],
            "peers_tokens_per_s": {"dense": sorted(rates["dense"])[len(rates["dense"]) // 2]},
            "paged_time_over_dense": geo(ratios), "paged_time_over_dense_best": geo(best_ratios),
            "outputs_identical": True,
        })
    table = [[r["config"]["workload"], f"{r['peers_tokens_per_s']['dense']:.1f}", f"{r['tokens_per_s']:.1f}",
              f"{r['paged_time_over_dense']:.3f}x", f"{r['paged_time_over_dense_best']:.3f}x"] for r in rows]
    print()
    common.print_table(["workload", "dense tok/s", "paged tok/s", "paged/dense time", "best/best"], table)
    result = common.metadata(
        "paged_e2e", device, "cpu" if device.type == "cpu" else "cuda", model="SmolLM2-135M-Instruct",
        load_average_at_start=load, load_average_at_end=os.getloadavg() if hasattr(os, "getloadavg") else None,
        stat=("generate, batch 1, greedy, n-gram chain (the e2e benchmark's ours_ngram, adaptive planner) on a dense "
              "and on a paged KV cache, alternating per prompt; tokens_per_s (paged) and peers_tokens_per_s.dense: "
              "median over prompts and rounds; paged_time_over_dense: geometric mean over prompts of the median "
              "dense tok/s / median paged tok/s (*_best: of the best rounds); wall time"))
    result["rows"] = rows
    return result


def main(argv=None) -> int:
    """Run the paged-vs-dense sweep (or with --e2e the end-to-end comparison) on this
    machine's device; returns the exit status."""
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.e2e:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        result = run_e2e(args, device)
        common.write_json(result, args.out or str(common.results_dir() / f"paged_e2e_{common.device_slug(device)}.json"))
        return 0
    from .. import config
    from ..ops import reference
    from ..ops._extension import available_backends
    from ..ops.tree_attention import tree_attention

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    backend = available_backends("tree_attention_paged", device.type)[0]
    gen = torch.Generator().manual_seed(0)
    if args.smoke:
        configs = [dict(shape="tiny", heads=(4, 2, 16), B=2, T=5, prefix=40)]
    else:
        shapes = SHAPES_CPU if device.type == "cpu" else SHAPES_GPU
        configs = [dict(shape=name, heads=heads, B=b, T=t, prefix=p)
                   for name, heads in shapes.items() for b in BATCHES for p in PREFIXES for t in NODES]
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    # One thread: CPU time of the process, which leaves out the time it waits for a core on a
    # shared machine (and equals the kernel's work); several threads: wall time.
    cpu_time = device.type == "cpu" and torch.get_num_threads() == 1
    clock = time.process_time if cpu_time else time.perf_counter
    print(f"{common.device_name(device)}, {torch.get_num_threads()} threads, backend {backend}, page size "
          f"{args.page_size}, {str(dtype).replace('torch.', '')}; load average {load}", flush=True)
    rows, table_rows = [], []
    print("shape B T prefix dense_us paged_us paged/dense best/best (table at the end)", flush=True)
    for cfg in configs:
        q_heads, kv_heads, head_dim = cfg["heads"]
        q, k, v, k_pool, v_pool, mask, seqlens, table = make_inputs(
            cfg["B"], cfg["T"], cfg["prefix"], q_heads, kv_heads, head_dim, args.page_size, dtype, device, gen)
        scale = head_dim**-0.5
        expected = reference.tree_attention(q, k, v, mask, seqlens, scale)
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        with config.value_checks(False):
            calls = {
                "dense": lambda: tree_attention(q, k, v, mask, seqlens, scale=scale),
                "paged": lambda: tree_attention(q, k_pool, v_pool, mask, seqlens, block_table=table, scale=scale),
            }
            for name, call in calls.items():
                err = (call().float() - expected.float()).abs().max().item()
                if not err <= tol:
                    raise AssertionError(f"{name} {cfg}: max abs error {err:.3g} > {tol}")
            times = time_gpu(calls, device) if device.type == "cuda" else time_alternating(
                calls, 0.05 if args.smoke else args.min_time, clock)
        (paged_us, paged_best), (dense_us, dense_best) = times["paged"], times["dense"]
        rows.append({
            "config": {"shape": cfg["shape"], "B": cfg["B"], "T": cfg["T"], "prefix": cfg["prefix"], "Hq": q_heads,
                       "Hkv": kv_heads, "D": head_dim, "page_size": args.page_size,
                       "dtype": str(dtype).replace("torch.", "")},
            "ours_us": paged_us, "ours_best_us": paged_best, "floor_us": None,
            "peers_us": {"dense": dense_us}, "peers_best_us": {"dense": dense_best},
            "paged_over_dense": paged_us / dense_us, "paged_over_dense_best": paged_best / dense_best,
        })
        table_rows.append([cfg["shape"], cfg["B"], cfg["T"], cfg["prefix"], dense_us, paged_us,
                           f"{paged_us / dense_us:.2f}x", f"{paged_best / dense_best:.2f}x"])
        print("  ".join(f"{c:.1f}" if isinstance(c, float) else str(c) for c in table_rows[-1]), flush=True)
    print()
    common.print_table(["shape", "B", "T", "prefix", "dense us", "paged us", "paged/dense", "best/best"], table_rows)
    for key, what in (("paged_over_dense", "medians"), ("paged_over_dense_best", "best blocks")):
        ratios = torch.tensor([r[key] for r in rows])
        print(f"paged / dense ({what}): worst {ratios.max().item():.2f}x, geometric mean "
              f"{ratios.log().mean().exp().item():.2f}x")
    if args.smoke:
        return 0
    result = common.metadata(
        "paged", device, backend, page_size=args.page_size, load_average_at_start=load,
        clock="process CPU time (one thread)" if cpu_time else "wall time",
        load_average_at_end=os.getloadavg() if hasattr(os, "getloadavg") else None,
        stat=("CPU: median (ours_us, peers_us) and best (*_best_us) per-call time over alternating blocks of "
              "dense and paged calls (each block about 5 ms), value checks off; peers_us.dense = the dense op "
              "on the same logical cache"
              if device.type == "cpu" else "median of CUDA-event-timed calls after 3 warm-up calls, L2 flushed"),
    )
    result["rows"] = rows
    suffix = "" if args.page_size == 16 else f"_ps{args.page_size}"
    out = args.out or str(common.results_dir() / f"paged_{common.device_slug(device)}{suffix}.json")
    common.write_json(result, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
