"""Step time of the target's tree-verify forward, eager against compiled (`generate(..., compile=True)`).

For the default model (SmolLM2-135M-Instruct) or --model, at batch 1 and 8 and tree widths 1,
8 and 32 (binary trees) after a --prefix-token prompt: the eager forward as `generate` runs it
(`hf.forward` on a `TreeKVCache`, few-row linears routed as the cost model's calibration chose)
against the compiled one (`compiled.StaticForward` on a `StaticTreeKVCache`, inside the same
routing), timed interleaved, best and median of --repeats rounds. Compile time is reported per
configuration, once, apart from the step times. Prints a line per configuration and writes
bench/results/compiled_step_cpu.json (rows: ours_us = compiled, peers_us.eager, the ratios,
compile seconds and the load average).

    python bench/bench_compiled.py              # ~10 min on 2 loaded cores (most of it compiling)
"""

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from specdec_kernels import models
from specdec_kernels.benchmarks.common import metadata, results_dir, write_json
from specdec_kernels.loop import compiled, hf
from specdec_kernels.loop.cost_model import CostModel
from specdec_kernels.ops.small_linear import small_linears
from specdec_kernels.ops.tree import TokenTree, tree_mask


def _binary_tree(width: int, batch: int) -> torch.Tensor:
    """parents [batch, width] of a binary tree in breadth-first order (node i under (i-1)//2)."""
    parents = torch.tensor([-1] + [(i - 1) // 2 for i in range(1, width)])
    return parents.expand(batch, -1).contiguous()


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@torch.inference_mode()
def run(model, batches, widths, prefix: int, repeats: int, linear_rows):
    vocab = model.config.vocab_size
    rows = []
    static = compiled.StaticForward("default")
    for batch in batches:
        history = torch.randint(0, vocab, (batch, prefix + 1))
        lengths = torch.full((batch,), prefix + 1)
        capacity = prefix + 1 + max(widths)
        eager_cache = hf.TreeKVCache.for_model(model, batch, capacity)
        static_cache = static.cache(model, batch, capacity)
        with hf.use_tree_attention(model), small_linears(model, linear_rows):
            hf.prefill(model, eager_cache, history, lengths)
            hf.prefill(model, static_cache, history, lengths)
            for width in widths:
                parents = _binary_tree(width, batch)
                tokens = torch.randint(0, vocab, (batch, width))
                positions = TokenTree(tokens, parents).position_ids(eager_cache.seqlens)
                mask = tree_mask(parents)
                eager = lambda: hf.forward(model, eager_cache, tokens, positions, mask)  # noqa: E731
                fast = lambda: static.forward(model, static_cache, tokens, positions, mask)  # noqa: E731
                before = static.compile_seconds
                compile_s = _time(fast)
                compile_s = static.compile_seconds - before if static.compile_seconds > before else compile_s
                same = float((eager() - fast()).abs().max())
                times_e, times_c = [], []
                for _ in range(repeats):
                    times_e.append(_time(eager))
                    times_c.append(_time(fast))
                load = os.getloadavg()[0]
                row = {"config": {"batch": batch, "width": width, "prefix": prefix},
                       "ours_us": min(times_c) * 1e6, "floor_us": None, "peers_us": {"eager": min(times_e) * 1e6},
                       "eager_ms": min(times_e) * 1e3, "compiled_ms": min(times_c) * 1e3,
                       "eager_median_ms": statistics.median(times_e) * 1e3,
                       "compiled_median_ms": statistics.median(times_c) * 1e3,
                       "ratio_best": min(times_e) / min(times_c),
                       "ratio_median": statistics.median(times_e) / statistics.median(times_c),
                       "compile_s": compile_s, "max_abs_logit_diff": same, "loadavg_1min": load}
                rows.append(row)
                print(f"B={batch:2d} T={width:3d}  eager {row['eager_ms']:8.2f} ms (median {row['eager_median_ms']:8.2f})"
                      f"  compiled {row['compiled_ms']:8.2f} ms (median {row['compiled_median_ms']:8.2f})"
                      f"  eager/compiled best {row['ratio_best']:.2f} median {row['ratio_median']:.2f}"
                      f"  compile {compile_s:6.1f} s  |dlogit| {same:.1e}  load {load:.2f}", flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF model directory (default: the default model)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prefix", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--linear-rows", type=int, nargs=2, default=None, metavar=("LO", "HI"),
                        help="few-row linear routing (default: the cost model's calibration, as generate does)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--out", default=None, help="JSON path (default bench/results/compiled_step_<device>.json)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, _ = models.load_model(args.model, verbose=False)
    linear_rows = tuple(args.linear_rows) if args.linear_rows else CostModel.for_model(model).small_linear_rows
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, small_linear_rows {linear_rows}, "
          f"load {os.getloadavg()}", flush=True)
    rows = run(model, args.batches, args.widths, args.prefix, args.repeats, linear_rows)
    result = metadata("compiled_step", "cpu", "cpu", small_linear_rows=list(linear_rows), prefix=args.prefix,
                      repeats=args.repeats, rows=rows)
    write_json(result, Path(args.out) if args.out else results_dir() / "compiled_step_cpu.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
