"""End-to-end decoding: HF `generate` against `specdec_kernels.generate` on the four workloads.

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
  ours_ngram        NgramDrafter(num_tokens=10), a chain (the same k as hf_prompt_lookup)
  ours_ngram_tree   NgramDrafter(num_tokens=10, tree_width=3), a tree of up to 3 continuations
  ours_draft        DraftModelDrafter(draft, num_tokens=4), a chain (with --draft-model)
  ours_draft_tree   DraftModelDrafter(draft, tree_widths=(2, 2, 1)) (with --draft-model)

Batch size B uses B distinct prompts per batch, left padded (HF: attention_mask; ours: the same
attention_mask), ceil(prompts_per_workload / B) batches. Rows that stop at eos count the tokens
up to and including eos. On a GPU each of our runs is profiled once more (not timed) for the
share of the decoding steps spent inside our ops (`specdec::*`, device time).
Writes bench/results/e2e_<device>.json, e2e_<device>.md (the README table),
e2e_speedup_<device>.png and e2e_acceptance_<device>.png.
"""

import argparse
import math
import sys
import time
from pathlib import Path

import torch

from . import common

METHODS = ("hf", "hf_prompt_lookup", "hf_assisted", "ours_plain", "ours_ngram", "ours_ngram_tree", "ours_draft",
           "ours_draft_tree")
DEFAULT_METHODS = tuple(m for m in METHODS if m != "ours_plain")
NEEDS_DRAFT = frozenset({"hf_assisted", "ours_draft", "ours_draft_tree"})
BATCH1_ONLY = frozenset({"hf_prompt_lookup", "hf_assisted"})  # transformers' assisted decoding: batch size 1
TEMPERATURES = (0.0, 0.7)
HF_PROMPT_LOOKUP_TOKENS = 10  # HF's documented example value (also `specdec demo --hf-prompt-lookup`)
NGRAM_TOKENS, NGRAM_TREE_WIDTH = 10, 3  # chain: the same k as HF prompt lookup
DRAFT_TOKENS, DRAFT_TREE_WIDTHS = 4, (2, 2, 1)
RANDOM_LLAMA = "llama3-8b-random"
SHORT = dict(prompts_per_workload=2, max_new_tokens=64, batch_sizes=(1, 8))
FULL = dict(prompts_per_workload=8, max_new_tokens=256, batch_sizes=(1, 8))
SEED = 1234


# ----------------------------------------------------------------------------- models


def random_llama3_8b(*, layers=None, device="cuda", dtype=torch.bfloat16, pad_token_id=None):
    """A LlamaForCausalLM with Llama-3-8B's shapes (hidden 4096, 32 query / 8 KV heads of 128,
    MLP 14336, vocab 128256) and random weights; `layers` of its 32 (default all)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=layers or 32, num_attention_heads=32, num_key_value_heads=8,
                         max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
                         tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=pad_token_id)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # build the weights in bf16 directly (fp32 first would need 32 GB)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(old)
    model.generation_config.eos_token_id = None  # random weights: every row runs to max_new_tokens
    model.generation_config.pad_token_id = pad_token_id
    return model.eval()


def load_models(args, device):
    """(target, tokenizer, draft or None, label) per the command line."""
    from ..models import DEFAULT_MODEL, load_model

    dtype = getattr(torch, args.dtype) if args.dtype else None
    if args.model == RANDOM_LLAMA:
        if device.type != "cuda":
            raise SystemExit(f"specdec bench e2e: --model {RANDOM_LLAMA} needs a CUDA GPU (Llama-3-8B shapes in bf16: "
                             "16 GB of weights with all 32 layers); none is visible here")
        _, tokenizer = load_model(None, verbose=False)  # prompts tokenized as for the default model (ids < 49152)
        layers = args.layers
        if layers is None:
            free = torch.cuda.mem_get_info(device)[0]
            layers = 32 if free > 40e9 else max(1, int(free / 1.2e9) - 4)  # ~0.44 GB per layer + 2 GB embeddings
        model = random_llama3_8b(layers=layers, device=device, dtype=dtype or torch.bfloat16,
                                 pad_token_id=tokenizer.pad_token_id)
        label = f"{RANDOM_LLAMA} ({layers} layers, random weights)"
        if args.draft_model:
            print("--draft-model ignored with the random model (its vocabulary differs)", flush=True)
        return model, tokenizer, None, label
    model, tokenizer = load_model(args.model, dtype=dtype or torch.float32, device=device, verbose=True)
    draft = None
    if args.draft_model:
        draft, draft_tokenizer = load_model(None if args.draft_model == "default" else args.draft_model,
                                            dtype=dtype or torch.float32, device=device, verbose=True)
        if draft_tokenizer.get_vocab() != tokenizer.get_vocab():
            raise SystemExit("specdec bench e2e: the draft model's tokenizer differs from the target's")
    return model, tokenizer, draft, args.model or DEFAULT_MODEL


# ----------------------------------------------------------------------------- inputs


def make_batches(requests, tokenizer, batch_size, device):
    """[(input_ids [B, L], attention_mask [B, L], ids)], B prompts each, left padded."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    encoded = [(r.id, r.input_ids(tokenizer)[0]) for r in requests]
    batches = []
    for start in range(0, len(encoded), batch_size):
        group = encoded[start : start + batch_size]
        width = max(len(ids) for _, ids in group)
        input_ids = torch.full((len(group), width), pad, dtype=torch.long)
        mask = torch.zeros(len(group), width, dtype=torch.long)
        for b, (_, ids) in enumerate(group):
            input_ids[b, width - len(ids) :] = ids
            mask[b, width - len(ids) :] = 1
        batches.append((input_ids.to(device), mask.to(device), [i for i, _ in group]))
    return batches


def new_token_counts(sequences, prompt_len, eos_ids, max_new_tokens):
    """Generated tokens per row: up to and including the first eos, else every generated column."""
    new = sequences[:, prompt_len : prompt_len + max_new_tokens].cpu()
    counts = []
    for row in new:
        hits = torch.isin(row, eos_ids).nonzero() if eos_ids is not None else torch.empty(0)
        counts.append(int(hits[0]) + 1 if hits.numel() else row.numel())
    return counts


# ----------------------------------------------------------------------------- methods


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _drafter(sk, method, draft):
    if method == "ours_plain":
        return None
    if method == "ours_ngram":
        return sk.NgramDrafter(num_tokens=NGRAM_TOKENS)
    if method == "ours_ngram_tree":
        return sk.NgramDrafter(num_tokens=NGRAM_TOKENS, tree_width=NGRAM_TREE_WIDTH)
    if method == "ours_draft":
        return sk.DraftModelDrafter(draft, num_tokens=DRAFT_TOKENS)
    return sk.DraftModelDrafter(draft, tree_widths=DRAFT_TREE_WIDTHS)


def run_method(method, model, draft, input_ids, mask, *, max_new_tokens, temperature, eos, pad, seed):
    """One timed call: (sequences [B, L + new], seconds, GenerateStats or None)."""
    import specdec_kernels as sk

    device = input_ids.device
    _sync(device)
    start = time.perf_counter()
    if method.startswith("hf"):
        kwargs = dict(do_sample=False) if temperature == 0 else dict(do_sample=True, temperature=temperature, top_k=0,
                                                                     top_p=1.0)
        if method == "hf_prompt_lookup":
            kwargs["prompt_lookup_num_tokens"] = HF_PROMPT_LOOKUP_TOKENS
        elif method == "hf_assisted":
            kwargs["assistant_model"] = draft
        torch.manual_seed(seed)
        with torch.inference_mode():
            sequences = model.generate(input_ids, attention_mask=mask, max_new_tokens=max_new_tokens, eos_token_id=eos,
                                       pad_token_id=pad, **kwargs)
        stats = None
    else:
        out = sk.generate(model, input_ids, drafter=_drafter(sk, method, draft), max_new_tokens=max_new_tokens,
                          temperature=temperature, seed=seed, eos_token_id=eos, attention_mask=mask)
        sequences, stats = out.sequences, out.stats
    _sync(device)
    return sequences, time.perf_counter() - start, stats


def kernel_share(method, model, draft, input_ids, mask, *, max_new_tokens, temperature, eos, pad, seed):
    """Profile one run of ours (untimed): {op: share of the decoding steps' time} for our ops.

    Decoding steps = everything from the first `specdec::verify` call on (the prefill before it
    is left out). GPU: the ops' device (kernel) time over the steps' wall time; CPU: the ops'
    CPU time. Profiling slows the run, so these are shares, not times.
    """
    from torch.profiler import ProfilerActivity, profile

    device = input_ids.device
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        _, _, stats = run_method(method, model, draft, input_ids, mask, max_new_tokens=max_new_tokens,
                                 temperature=temperature, eos=eos, pad=pad, seed=seed)
    events = [e for e in prof.events() if e.name.startswith("specdec::")]
    verifies = [e.time_range.start for e in events if e.name == "specdec::verify"]
    if not verifies:
        return None
    first = min(verifies)
    per_op = {}
    for e in events:
        parent, nested = e.cpu_parent, False
        while parent is not None:  # count each op once: skip ops called from inside another of ours
            nested = nested or parent.name.startswith("specdec::")
            parent = parent.cpu_parent
        if nested or e.time_range.start < first:
            continue
        us = e.device_time_total if device.type == "cuda" else e.cpu_time_total
        per_op[e.name.split("::", 1)[1]] = per_op.get(e.name.split("::", 1)[1], 0.0) + us
    steps_us = 1e6 * (stats.time_draft + stats.time_verify + stats.time_accept)
    share = {op: us / steps_us for op, us in sorted(per_op.items())}
    share["total"] = sum(share.values())
    share["basis"] = "device time" if device.type == "cuda" else "cpu time"
    return share


# ----------------------------------------------------------------------------- one row


def _first_difference(a, b):
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return None if len(a) == len(b) else n


def bench_row(method, batches, model, draft, *, workload, batch_size, temperature, max_new_tokens, eos, pad,
              eos_ids, hf_greedy, profile_kernels):
    """Every batch of one (workload, batch size, temperature, method); the row for the JSON.

    hf_greedy: {request id: HF greedy generated tokens} filled by the `hf` greedy row and used
    by the others for the token-for-token check."""
    row = {"config": dict(workload=workload, batch=batch_size, temperature=temperature, method=method,
                          prompts=sum(len(ids) for _, _, ids in batches), max_new_tokens=max_new_tokens)}
    if method in BATCH1_ONLY and batch_size > 1:
        row["skipped"] = "transformers' assisted / prompt lookup decoding supports batch size 1 only"
        return row
    total_tokens, total_s, stats_list, mismatches, compared = 0, 0.0, [], [], 0
    for index, (input_ids, mask, ids) in enumerate(batches):
        seq, seconds, stats = run_method(method, model, draft, input_ids, mask, max_new_tokens=max_new_tokens,
                                         temperature=temperature, eos=eos, pad=pad, seed=SEED + index)
        prompt_len = input_ids.shape[1]
        counts = new_token_counts(seq, prompt_len, eos_ids, max_new_tokens)
        total_tokens += sum(counts)
        total_s += seconds
        if stats is not None:
            stats_list.append((stats, sum(counts)))
        if temperature == 0:
            for b, rid in enumerate(ids):
                tokens = seq[b, prompt_len : prompt_len + counts[b]].tolist()
                if method == "hf":
                    hf_greedy[rid] = tokens
                elif rid in hf_greedy:
                    compared += 1
                    where = _first_difference(tokens, hf_greedy[rid])
                    if where is not None:
                        mismatches.append(dict(prompt=rid, position=where, tokens=len(tokens),
                                               hf_tokens=len(hf_greedy[rid])))
    row.update(new_tokens=total_tokens, seconds=total_s, tokens_per_s=total_tokens / total_s if total_s else None)
    if temperature == 0 and method != "hf":
        row["greedy_identical"] = (not mismatches) if compared else None
        row["greedy_compared_rows"] = compared
        row["mismatches"] = mismatches
    if stats_list:
        pairs = [(s, n / s.tokens_per_step if s.tokens_per_step else 0.0) for s, n in stats_list]
        total_pairs = sum(p for _, p in pairs)
        depth = max(len(s.acceptance_per_depth) for s, _ in pairs)
        row["steps"] = sum(s.steps for s, _ in pairs)
        row["tokens_per_step"] = total_tokens / total_pairs if total_pairs else None
        row["acceptance_by_depth"] = [
            sum(p * (s.acceptance_per_depth[d] if d < len(s.acceptance_per_depth) else 0.0) for s, p in pairs)
            / total_pairs if total_pairs else 0.0 for d in range(depth)]
        row["time_s"] = {k: sum(getattr(s, f"time_{k}") for s, _ in pairs) for k in ("prefill", "draft", "verify", "accept")}
        if profile_kernels:
            input_ids, mask, _ = batches[0]
            row["kernel_share"] = kernel_share(method, model, draft, input_ids, mask, max_new_tokens=max_new_tokens,
                                               temperature=temperature, eos=eos, pad=pad, seed=SEED)
    return row


def warm_up(methods, batches_by_size, model, draft, temperatures, eos, pad):
    """A short call of every (method, batch size, sampling) first: lazy imports, allocator,
    first-call caches stay out of the timings."""
    for batch_size, batches in batches_by_size.items():
        input_ids, mask, _ = batches[0]
        input_ids, mask = input_ids[:, -32:], mask[:, -32:].clone()
        mask[:, -1] = 1
        for method in methods:
            if method in BATCH1_ONLY and batch_size > 1:
                continue
            for temperature in temperatures:
                run_method(method, model, draft, input_ids, mask, max_new_tokens=4, temperature=temperature, eos=eos,
                           pad=pad, seed=SEED)


# ----------------------------------------------------------------------------- driver


def run(model, tokenizer, requests_by_workload, *, draft=None, methods=DEFAULT_METHODS, batch_sizes=(1, 8),
        temperatures=TEMPERATURES, max_new_tokens=64, prompts_per_workload=2, profile_kernels=None, progress=True):
    """The benchmark on loaded models: a list of rows (see `bench_row`), in table order.

    requests_by_workload: {workload: [Request, ...]} with at least max(batch_sizes) requests
    each when a batch needs them (fewer: the batch is smaller). methods needing a draft model
    are left out without one; `hf` always runs (the baseline).
    """
    from tqdm import tqdm

    device = next(model.parameters()).device
    methods = [m for m in methods if m in METHODS and (draft is not None or m not in NEEDS_DRAFT)]
    methods = ["hf"] + [m for m in methods if m != "hf"]
    if profile_kernels is None:
        profile_kernels = device.type == "cuda"
    eos = getattr(model.generation_config, "eos_token_id", None)
    pad = getattr(model.generation_config, "pad_token_id", None)
    pad = pad if pad is not None else tokenizer.pad_token_id
    eos_ids = None if eos is None else torch.tensor([eos] if isinstance(eos, int) else list(eos))
    batches = {}
    for workload, requests in requests_by_workload.items():
        for batch_size in batch_sizes:
            count = batch_size * math.ceil(prompts_per_workload / batch_size)
            batches[workload, batch_size] = make_batches(requests[:count], tokenizer, batch_size, device)
    first = next(iter(requests_by_workload))
    warm_up(methods, {b: batches[first, b] for b in batch_sizes}, model, draft, temperatures, eos, pad)
    plan = [(w, b, t, m) for w in requests_by_workload for b in batch_sizes for t in temperatures for m in methods]
    rows, hf_greedy = [], {}
    bar = tqdm(plan, desc="e2e", unit="run", disable=not progress or None, file=sys.stderr, dynamic_ncols=True)
    start = time.perf_counter()
    for index, (workload, batch_size, temperature, method) in enumerate(bar):
        bar.set_postfix_str(f"{workload} B={batch_size} t={temperature:g} {method}")
        rows.append(bench_row(method, batches[workload, batch_size], model, draft, workload=workload,
                              batch_size=batch_size, temperature=temperature, max_new_tokens=max_new_tokens, eos=eos,
                              pad=pad, eos_ids=eos_ids, hf_greedy=hf_greedy, profile_kernels=profile_kernels))
        if bar.disable and progress:  # no terminal for a bar (a log file): one line per run instead
            rate = rows[-1].get("tokens_per_s")
            print(f"  [{index + 1}/{len(plan)}] {workload} B={batch_size} t={temperature:g} {method}: "
                  f"{'skipped' if rate is None else f'{rate:.1f} tok/s'} ({time.perf_counter() - start:.0f} s)",
                  flush=True)
    bar.close()
    _add_speedups(rows)
    return rows


def _add_speedups(rows):
    """speedup_vs_hf: tokens/s over the `hf` row with the same workload, batch and temperature."""
    base = {(r["config"]["workload"], r["config"]["batch"], r["config"]["temperature"]): r.get("tokens_per_s")
            for r in rows if r["config"]["method"] == "hf"}
    for r in rows:
        c = r["config"]
        ref = base.get((c["workload"], c["batch"], c["temperature"]))
        r["speedup_vs_hf"] = r["tokens_per_s"] / ref if r.get("tokens_per_s") and ref else None


# ----------------------------------------------------------------------------- output


def table_rows(rows):
    """(headers, cells) of the summary table."""
    depth = max((len(r.get("acceptance_by_depth") or []) for r in rows), default=0)
    depth = min(depth, 5)
    headers = ["workload", "B", "temp", "method", "tok/s", "speedup", "tok/step"] + [f"acc@{d + 1}" for d in range(depth)]
    headers += ["kernels %", "greedy == HF"]
    cells = []
    for r in rows:
        c = r["config"]
        if "skipped" in r:
            cells.append([c["workload"], str(c["batch"]), f"{c['temperature']:g}", c["method"], "-", "-", "-"]
                         + ["-"] * depth + ["-", "skipped: batch 1 only"])
            continue
        acc = list(r.get("acceptance_by_depth") or [])[:depth]
        identical = r.get("greedy_identical")
        check = ("-" if c["temperature"] else "(baseline)") if c["method"] == "hf" else (
            "-" if c["temperature"] else ("yes" if identical else ("not compared" if identical is None else
                                                                   f"NO ({len(r['mismatches'])} rows differ)")))
        share = r.get("kernel_share")
        cells.append([c["workload"], str(c["batch"]), f"{c['temperature']:g}", c["method"], f"{r['tokens_per_s']:.1f}",
                      f"{r['speedup_vs_hf']:.2f}x" if r.get("speedup_vs_hf") else "-",
                      f"{r['tokens_per_step']:.2f}" if r.get("tokens_per_step") else "-"]
                     + [f"{a:.2f}" for a in acc] + ["-"] * (depth - len(acc))
                     + [f"{100 * share['total']:.0f}%" if share else "-", check])
    return headers, cells


def markdown(rows, header):
    """The summary table as Markdown (the README's e2e table)."""
    headers, cells = table_rows(rows)
    lines = [header, "", "| " + " | ".join(headers) + " |", "|" + "|".join(" --- " for _ in headers) + "|"]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in cells]
    return "\n".join(lines) + "\n"


def plot_speedup(rows, path, title):
    """Bars: speedup vs HF (same sampling) per workload and method, one panel per (batch, temperature)."""
    plt = common.pyplot()
    if plt is None:
        return None
    panels = sorted({(r["config"]["batch"], r["config"]["temperature"]) for r in rows})
    workloads = list(dict.fromkeys(r["config"]["workload"] for r in rows))
    methods = [m for m in dict.fromkeys(r["config"]["method"] for r in rows) if m != "hf"]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.8), squeeze=False)
    width = 0.8 / max(1, len(methods))
    for ax, (batch, temperature) in zip(axes[0], panels):
        for i, method in enumerate(methods):
            values = []
            for w in workloads:
                match = [r for r in rows if r["config"]["workload"] == w and r["config"]["batch"] == batch
                         and r["config"]["temperature"] == temperature and r["config"]["method"] == method]
                values.append((match[0].get("speedup_vs_hf") or 0.0) if match else 0.0)
            ax.bar([x + (i - (len(methods) - 1) / 2) * width for x in range(len(workloads))], values, width, label=method)
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        ax.set_xticks(range(len(workloads)))
        ax.set_xticklabels(workloads, rotation=20, fontsize=8)
        ax.set_title(f"B={batch}, {'greedy' if temperature == 0 else f'temperature {temperature:g}'}", fontsize=9)
    axes[0][0].set_ylabel("speedup vs HF generate (same sampling)")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}", flush=True)
    return path


def plot_acceptance(rows, path, title):
    """Lines: acceptance by depth (fraction of steps accepting >= d drafts) per method, one panel
    per workload, batch 1 (or the smallest batch), greedy and sampled."""
    plt = common.pyplot()
    if plt is None:
        return None
    ours = [r for r in rows if r.get("acceptance_by_depth")]
    workloads = list(dict.fromkeys(r["config"]["workload"] for r in rows))
    fig, axes = plt.subplots(1, len(workloads), figsize=(4 * len(workloads), 3.4), squeeze=False)
    batch = min((r["config"]["batch"] for r in ours), default=1)
    for ax, w in zip(axes[0], workloads):
        for r in ours:
            c = r["config"]
            if c["workload"] != w or c["batch"] != batch:
                continue
            acc, temperature = r["acceptance_by_depth"], c["temperature"]
            sampling = "greedy" if temperature == 0 else f"t={temperature:g}"
            ax.plot(range(1, len(acc) + 1), acc, marker="o", linestyle="-" if temperature == 0 else "--",
                    label=f"{c['method']} {sampling}")
        ax.set_title(f"{w}, B={batch}", fontsize=9)
        ax.set_xlabel("depth d")
        ax.set_ylim(0, 1)
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("steps accepting >= d drafts")
    axes[0][-1].legend(fontsize=6)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}", flush=True)
    return path


def write_results(rows, out_dir, *, device, model_label, settings, name=None):
    """JSON, Markdown table and both plots under out_dir; returns {kind: path}."""
    slug = name or common.device_slug(device)
    out_dir = Path(out_dir)
    result = common.metadata("e2e", device, "default dispatch", model=model_label, **settings)
    result["stat"] = ("tokens_per_s = generated tokens (to eos inclusive) / wall time summed over the batches, one "
                      "timed call each after a warm-up call per method; speedup_vs_hf = tokens_per_s / the hf row with "
                      "the same workload, batch and temperature")
    result["rows"] = rows
    paths = {"json": common.write_json(result, out_dir / f"e2e_{slug}.json")}
    title = f"{model_label} on {result['device']}"
    header = (f"End-to-end, {model_label} on {result['device']} ({result['date']}, commit {result['commit']}, "
              f"torch {result['torch']}, transformers {result['transformers']}; max_new_tokens "
              f"{settings['max_new_tokens']}, {settings['prompts_per_workload']} prompt(s) per workload and batch size)")
    paths["md"] = out_dir / f"e2e_{slug}.md"
    paths["md"].write_text(markdown(rows, header))
    print(f"wrote {paths['md']}", flush=True)
    paths["speedup_png"] = plot_speedup(rows, out_dir / f"e2e_speedup_{slug}.png", title)
    paths["acceptance_png"] = plot_acceptance(rows, out_dir / f"e2e_acceptance_{slug}.png", title)
    return paths


# ----------------------------------------------------------------------------- main


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
    parser.add_argument("--model", default=None,
                        help=f"target: HF model directory or cached hub name (default SmolLM2-135M-Instruct), or "
                             f"{RANDOM_LLAMA} (GPU only: Llama-3-8B shapes, random bf16 weights)")
    parser.add_argument("--draft-model", default=None, help="draft model ('default': the default model); adds "
                                                            "hf_assisted, ours_draft, ours_draft_tree")
    parser.add_argument("--workloads", type=_csv(str), default=None, help="comma-separated (default all four)")
    parser.add_argument("--batch-sizes", type=_csv(int), default=None, help="comma-separated (default 1,8)")
    parser.add_argument("--methods", type=_csv(str), default=None,
                        help=f"comma-separated of {', '.join(METHODS)} (default all but ours_plain; hf always runs)")
    parser.add_argument("--temperatures", type=_csv(float), default=None, help="comma-separated (default 0,0.7)")
    parser.add_argument("--max-new-tokens", type=int, default=None)
    parser.add_argument("--prompts-per-workload", type=int, default=None)
    parser.add_argument("--layers", type=int, default=None, help=f"{RANDOM_LLAMA}: layers (default 32 if memory allows)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                        help=f"weights (default float32; {RANDOM_LLAMA}: bfloat16)")
    parser.add_argument("--kernel-share", choices=("auto", "on", "off"), default="auto",
                        help="profile each of our runs once for the share of step time in our ops (auto: on GPU only)")
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
    from ..workloads import WORKLOADS, load_workload

    preset = FULL if args.full else SHORT
    workloads = args.workloads or WORKLOADS
    for name, values, allowed in (("--workloads", workloads, WORKLOADS), ("--methods", args.methods or (), METHODS)):
        bad = [v for v in values if v not in allowed]
        if bad:
            raise SystemExit(f"specdec bench e2e: {name}: unknown {bad}; choose from {', '.join(allowed)}")
    batch_sizes = args.batch_sizes or preset["batch_sizes"]
    max_new_tokens = args.max_new_tokens or preset["max_new_tokens"]
    prompts = args.prompts_per_workload or preset["prompts_per_workload"]
    if min(batch_sizes) < 1 or max_new_tokens < 1 or prompts < 1:
        raise SystemExit("specdec bench e2e: batch sizes, --max-new-tokens and --prompts-per-workload must be >= 1")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    start = time.perf_counter()
    model, tokenizer, draft, label = load_models(args, device)
    methods = args.methods or DEFAULT_METHODS
    if draft is None and any(m in NEEDS_DRAFT for m in methods) and args.methods:
        print(f"no --draft-model: leaving out {', '.join(m for m in methods if m in NEEDS_DRAFT)}", flush=True)
    try:
        requests = {w: load_workload(w, limit=max(max(batch_sizes), prompts)) for w in workloads}
    except FileNotFoundError as error:
        raise SystemExit(f"specdec bench e2e: {error}") from None
    profile = {"auto": None, "on": True, "off": False}[args.kernel_share]
    print(f"e2e: {label} on {common.device_name(device)} ({device.type}, {torch.get_num_threads()} threads); "
          f"workloads {', '.join(workloads)}; batch sizes {batch_sizes}; max_new_tokens {max_new_tokens}; "
          f"{prompts} prompt(s) per workload and batch size", flush=True)
    rows = run(model, tokenizer, requests, draft=draft, methods=methods, batch_sizes=batch_sizes,
               temperatures=args.temperatures or TEMPERATURES, max_new_tokens=max_new_tokens,
               prompts_per_workload=prompts, profile_kernels=profile, progress=not args.no_progress)
    headers, cells = table_rows(rows)
    print()
    common.print_table(headers, cells)
    settings = dict(mode="full" if args.full else "short", max_new_tokens=max_new_tokens, prompts_per_workload=prompts,
                    batch_sizes=list(batch_sizes), workloads=list(workloads),
                    methods=sorted({r["config"]["method"] for r in rows}), dtype=str(next(model.parameters()).dtype),
                    hf_prompt_lookup_num_tokens=HF_PROMPT_LOOKUP_TOKENS, ngram_num_tokens=NGRAM_TOKENS,
                    ngram_tree_width=NGRAM_TREE_WIDTH, draft_model=args.draft_model, draft_num_tokens=DRAFT_TOKENS,
                    draft_tree_widths=list(DRAFT_TREE_WIDTHS), wall_s=None)
    settings["wall_s"] = time.perf_counter() - start
    name = common.device_slug(device) + ("_llama3_8b_random" if args.model == RANDOM_LLAMA else "")
    write_results(rows, args.out_dir or common.results_dir(), device=device, model_label=label, settings=settings,
                  name=name)
    bad = [r for r in rows if r.get("greedy_identical") is False]
    print(f"e2e done in {settings['wall_s']:.0f} s", flush=True)
    if bad:
        print(f"WARNING: {len(bad)} greedy row(s) differ from HF generate: "
              + "; ".join(f"{r['config']['workload']} B={r['config']['batch']} {r['config']['method']}: "
                          f"{r['mismatches'][:3]}" for r in bad), flush=True)
        return 1
    return 0
