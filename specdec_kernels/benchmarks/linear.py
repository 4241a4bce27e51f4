"""`specdec bench linear`: the target's forward with few-row linears by our kernel and by `F.linear` (CPU).

    specdec bench linear                   # default model, 1..32 tokens, ~1-2 min on 2 cores
    specdec bench linear --smoke           # a tiny random Llama: only checks the code runs

For each token count T (one chain of T tokens after a 64-token prefix, batch 1: what one
verify step of T - 1 drafts costs) it times the target's whole forward, as `generate` runs
it (tree attention, our KV cache), with
  ours     every fp32 linear through `torch.ops.specdec.small_linear` (`small_linear.small_linears`)
  F.linear the model's own linears (torch's BLAS: what HF runs)
and the floor: the forward must read every weight once, weight bytes / the machine's read
bandwidth (a large tensor's sum on torch's threads, the best of a few runs). Both run
interleaved in rounds, median of each. `generate` uses our kernel, per machine, at the row
counts where it won on the model's own weights (`cost_model.calibrate`); this table shows the
whole forward, and what a verify step costs against a one-token step either way.
Writes bench/results/linear_cpu.json (the CPU named inside).
"""

import argparse
import statistics

import torch

from . import common

COUNTS = (1, 2, 3, 4, 6, 8, 12, 16, 32)
PREFIX = 64


def read_bandwidth(megabytes: int = 512, repeats: int = 5) -> float:
    """Bytes per second of reading a large fp32 tensor (sum), the best of `repeats`."""
    import time

    x = torch.ones(megabytes * (1 << 20) // 4)
    best = float("inf")
    for _ in range(repeats + 1):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best


def _tiny_model():
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return transformers.LlamaForCausalLM(config).eval()


@torch.inference_mode()
def measure(model, counts=COUNTS, rounds: int = 7) -> list:
    """Rows of the results JSON: per token count, the median microseconds of ours and of F.linear, and the floor."""
    from .. import config
    from ..loop import hf
    from ..ops import small_linear
    from ..loop.cost_model import _time_forward

    weight_bytes = sum(w.numel() * w.element_size() for w in small_linear.linear_weights(model))
    floor_us = 1e6 * weight_bytes / read_bandwidth()
    times = {n: {"ours": [], "F.linear": []} for n in counts}
    with hf.use_tree_attention(model), config.value_checks(False):
        cache = hf.TreeKVCache.for_model(model, 1, PREFIX + max(counts) + 1)
        # The lean forward op by op, its linears by F.linear or by ours (the fused layers would
        # time ours only).
        forward = hf.tree_step_forward(model)
        _time_forward(forward, model, cache, max(counts), PREFIX)  # warm-up
        for _ in range(rounds):
            for n in counts:
                times[n]["F.linear"].append(_time_forward(forward, model, cache, n, PREFIX))
                with small_linear.small_linears(model, (1, max(counts))):
                    times[n]["ours"].append(_time_forward(forward, model, cache, n, PREFIX))
    rows = []
    for n in counts:
        ours, peer = (1e6 * statistics.median(times[n][k]) for k in ("ours", "F.linear"))
        rows.append({"config": {"tokens": n, "prefix": PREFIX, "weight_mb": round(weight_bytes / 2**20, 1)},
                     "ours_us": round(ours, 1), "floor_us": round(floor_us, 1), "peers_us": {"F.linear": round(peer, 1)}})
    return rows


def add_arguments(parser):
    """The `specdec bench linear` options."""
    parser.add_argument("--smoke", action="store_true", help="a tiny random Llama, 2 rounds (checks the code runs)")
    parser.add_argument("--model", default=None, help="HF model directory or name (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (median reported)")
    parser.add_argument("--out", default=None, help="results JSON (default bench/results/linear_cpu.json)")
    return parser


def main(argv=None) -> int:
    """`specdec bench linear` as a module: parse `argv`, then `run_args`."""
    parser = argparse.ArgumentParser(prog="specdec bench linear", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    return run_args(add_arguments(parser).parse_args(argv))


def run_args(args) -> int:
    """Run the benchmark, print its table, write its JSON; returns 0."""
    if args.smoke:
        model, name, rounds = _tiny_model(), "tiny-random-llama", 2
    else:
        from ..models import load_model

        model, _ = load_model(args.model)
        name, rounds = getattr(model, "name_or_path", None) or "default", args.rounds
    rows = measure(model, rounds=rounds)
    common.print_table(["tokens", "ours (small_linear) ms", "F.linear ms", "F.linear / ours", "floor ms",
                        "x one-token forward (ours / F.linear)"],
                       [[r["config"]["tokens"], f"{r['ours_us'] / 1e3:.1f}", f"{r['peers_us']['F.linear'] / 1e3:.1f}",
                         f"{r['peers_us']['F.linear'] / r['ours_us']:.2f}x", f"{r['floor_us'] / 1e3:.1f}",
                         f"{r['ours_us'] / rows[0]['ours_us']:.2f} / {r['peers_us']['F.linear'] / rows[0]['peers_us']['F.linear']:.2f}"]
                        for r in rows])
    result = {**common.metadata("linear", "cpu", "cpu", model=str(name), smoke=args.smoke), "rows": rows}
    out = args.out or common.results_dir() / ("linear_cpu_smoke.json" if args.smoke else "linear_cpu.json")
    common.write_json(result, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
