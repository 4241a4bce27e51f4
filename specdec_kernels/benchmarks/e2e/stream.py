"""A stream of distinct requests through one drafter: does the suffix cache pay as it fills?

    specdec bench e2e --stream code_edit --prompts-per-workload 12 --max-new-tokens 64

Each method is one drafter object that serves the requests one after the other (batch 1,
greedy, adaptive), as a server would: `ours_default` (default_drafter: head where one ships,
n-gram, suffix cache) against `ours_default_nocache` (the same without the suffix cache),
with the cache emptied once before the stream. Requests are the workload's distinct prompts
(`load_workload` drops repeats: greedy decoding of a repeated request is a copy that would
flatter any cache). Per request: tokens per step (emitted tokens per target forward),
tokens/s, and the tokens the cache held before it. The methods' outputs must be equal (both
are the target's greedy output). Writes bench/results/e2e_stream_<workload>_<device>.json and
a plot of tokens per step along the stream.
"""

import time
from pathlib import Path

import torch

from .. import common
from .runner import SEED, clear_suffix_cache, drafter as make_method_drafter

STREAM_METHODS = ("ours_default_nocache", "ours_default")


def run_stream(model, tokenizer, requests, *, methods=STREAM_METHODS, max_new_tokens=64, progress=True,
               on_row=None):
    """{method: [per-request row]} for `requests` served in order by one drafter per method.

    The methods take turns request by request (request i by every method, then i + 1), so a
    slow spell of a shared machine hits them alike; on_row(results) after every request."""
    from ...loop.generate import generate
    from ...methods import stop_ids

    eos, pad = stop_ids(model, tokenizer)
    device = next(model.parameters()).device
    prompts = [r.input_ids(tokenizer).to(device) for r in requests]
    results, drafters = {}, {}
    for method in methods:
        drafters[method] = chosen = make_method_drafter(method, None, model)
        # Warm-up (lazy imports, the planner's cost model), then an empty cache.
        generate(model, prompts[0][:, -16:], drafter=chosen, max_new_tokens=4, eos_token_id=eos, seed=SEED)
        clear_suffix_cache(chosen)
        results[method] = []
    for i, (request, ids) in enumerate(zip(requests, prompts)):
        for method in methods:
            chosen, rows = drafters[method], results[method]
            cache = getattr(chosen, "suffix_cache", None)
            cached = cache.cached_tokens if cache is not None else 0
            start = time.perf_counter()
            out = generate(model, ids, drafter=chosen, max_new_tokens=max_new_tokens, eos_token_id=eos, seed=SEED)
            seconds = time.perf_counter() - start
            new = out.sequences[0, ids.shape[1]:][: out.stats.new_tokens[0]].tolist()
            rows.append(dict(request=request.id, index=i, prompt_tokens=ids.shape[1], new_tokens=len(new),
                             seconds=seconds, tokens_per_s=len(new) / seconds, steps=out.stats.steps,
                             tokens_per_step=out.stats.tokens_per_step, nodes_per_step=out.stats.nodes_per_step,
                             cached_tokens_before=cached, output=new))
            if progress:
                print(f"  stream {method} [{i + 1}/{len(requests)}] {request.id}: {rows[-1]['tokens_per_step']:.2f} "
                      f"tok/step, {rows[-1]['tokens_per_s']:.1f} tok/s (cache {cached} tokens)", flush=True)
        if on_row is not None:
            on_row(results)
    return results


def summarise(results):
    """Per method: mean tokens/step and summed tokens / summed seconds over the first and the
    second half of the stream, and whether every output equals the first method's."""
    first = next(iter(results.values()))
    summary = {}
    for method, rows in results.items():
        half = (len(rows) + 1) // 2
        parts = {"first_half": rows[:half], "second_half": rows[half:], "all": rows}
        summary[method] = {
            name: dict(tokens_per_step=sum(r["tokens_per_step"] for r in part) / max(len(part), 1),
                       tokens_per_s=sum(r["new_tokens"] for r in part) / max(sum(r["seconds"] for r in part), 1e-9))
            for name, part in parts.items()}
        summary[method]["outputs_equal_first_method"] = all(a["output"] == b["output"] for a, b in zip(rows, first))
    return summary


def plot_stream(results, path, title):
    """Tokens per step per request along the stream, one line per method."""
    plt = common.pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for method, rows in results.items():
        x = [r["index"] + 1 for r in rows]
        axes[0].plot(x, [r["tokens_per_step"] for r in rows], marker="o", label=method)
        axes[1].plot(x, [r["tokens_per_s"] for r in rows], marker="o", label=method)
    axes[0].set_ylabel("tokens per step (target forward)")
    axes[1].set_ylabel("tokens/s")
    for ax in axes:
        ax.set_xlabel("request in the stream (distinct prompts)")
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    return common.save_figure(plt, fig, path)


def run_stream_args(args, model, tokenizer, label, device, max_new_tokens, prompts) -> int:
    """`specdec bench e2e --stream WORKLOAD`: run, print, write JSON and the plot."""
    from ...workloads import load_workload

    requests = load_workload(args.stream, limit=prompts)
    methods = tuple(args.methods) if args.methods else STREAM_METHODS
    print(f"stream: {label}, {len(requests)} distinct {args.stream} requests, max_new_tokens {max_new_tokens}, "
          f"methods {', '.join(methods)} (batch 1, greedy)", flush=True)
    start = time.perf_counter()
    out_dir = Path(args.out_dir or common.results_dir())
    slug = f"{args.stream}_{common.device_slug(device)}"

    def write(results, complete):  # after every request too: a run stopped at a time limit keeps its rows
        result = common.metadata("e2e", device, "default dispatch", model=label, mode="stream", workload=args.stream,
                                 max_new_tokens=max_new_tokens, requests=len(requests), complete=complete,
                                 wall_s=time.perf_counter() - start, summary=summarise(results))
        result["rows"] = [dict(config=dict(method=m, workload=args.stream, request=r["request"], index=r["index"]),
                               **{k: v for k, v in r.items() if k != "output"})
                          for m, rows in results.items() for r in rows]
        common.write_json(result, out_dir / f"e2e_stream_{slug}.json", quiet=not complete)
        return result

    results = run_stream(model, tokenizer, requests, methods=methods, max_new_tokens=max_new_tokens,
                         progress=True, on_row=lambda r: write(r, False))
    summary = summarise(results)
    headers = ["method", "tok/step 1st half", "tok/step 2nd half", "tok/s 1st half", "tok/s 2nd half", "same output"]
    cells = [[m, f"{s['first_half']['tokens_per_step']:.2f}", f"{s['second_half']['tokens_per_step']:.2f}",
              f"{s['first_half']['tokens_per_s']:.1f}", f"{s['second_half']['tokens_per_s']:.1f}",
              str(s["outputs_equal_first_method"])] for m, s in summary.items()]
    print()
    common.print_table(headers, cells)
    result = write(results, True)
    plot_stream(results, out_dir / f"e2e_stream_{slug}.png", f"{label}: {args.stream} stream on {result['device']}")
    return 0 if all(s["outputs_equal_first_method"] for s in summary.values()) else 1
