"""N-gram (prompt lookup) drafting on the CPU: per-step latency against peers in the same run.

    specdec bench kernels                  # runs this (short sweep) with the other kernel benchmarks
    python bench/bench_ngram.py            # --quick (default): ~1-2 min on 2 cores
    python bench/bench_ngram.py --full     # every B x L, slow peers on bigger inputs

Methods (one decoding step = one draft for each of B rows of history length L):
  ours        ngram_propose(backend="cpu"): C++ scan, rows split over torch's threads
  index       NgramIndex.append_and_propose: append 1..k accepted tokens per row, then
              propose (incremental; no rescan). Reported per row and scaled to B rows.
  numba       vLLM's algorithm (KMP over the reversed history: longest prefix-suffix capped
              at max_n, earliest match), our own numba implementation, rows in parallel
              (prange) on the same threads; only if numba is installed.
  unfold      the rule in batched torch ops (`unfold_propose`: Tensor.unfold windows compared
              with each row's suffix, no loop over rows, no host sync), on the GPU when there
              is one (the history already on the device; CUDA-event timed), else on the CPU
              on the same threads.
  hf          transformers' PromptLookupCandidateGenerator.get_candidates, its real code,
              one row at a time (it supports batch size 1); only if transformers imports.
  reference   specdec_kernels.ops.reference (torch ops, one row at a time).
  floor       one full read of the batch (torch max-reduction, the faster of 1 thread and
              all threads): a full scan cannot beat it; early-exit rows can.

Histories are real text: the prompts in /work/shared/data/prompts/*.jsonl, split into words
and punctuation, each word mapped to an id; each row concatenates the prompts in its own
random order (repeating them) up to length L. The "random" workload (uniform ids over 50k)
rarely matches at max_n, so every method scans the whole row: the worst case.
Every method's drafts are checked against ours before timing.
Timing: torch.utils.benchmark (blocked autorange, see benchmarks.common.time_cpu), median per
call; ours, floor and numba rotate over copies of the batch that together exceed twice the
last-level cache, so a call never finds its rows in a cache the previous call warmed.
On a GPU our CUDA kernel is timed too (ours_cuda_us, CUDA events on the device copies) against
unfold there and the host peers. Writes bench/results/ngram_<device>.json (ngram_cpu without a
GPU) and the .png beside it; the JSON is rewritten after
every config ("complete": false until the last), so a run stopped mid-sweep keeps its rows.
"""

import argparse
import json
import os
import re
import time

import numpy as np
import torch

from .. import config
from .._platform import cpu_name
from ..ops import reference
from ..ops._extension import available_backends
from ..ops.ngram import ngram_propose
from ..ops.ngram_index import NgramIndex

from . import common

MIN_N, MAX_N, NUM_TOKENS = 1, 4, 5

try:
    import numba

    # The "workqueue" layer does not busy-wait between calls; the OpenMP layer's idle
    # threads spin and starve the other methods' threads on a small machine.
    numba.config.THREADING_LAYER = "workqueue"
    HAS_NUMBA = True
except ImportError:
    HAS_NUMBA = False

try:
    from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

    HAS_HF = True
except Exception:  # noqa: BLE001  (any import failure just drops the peer)
    HAS_HF = False


# ----------------------------------------------------------------------------- data


def load_corpus():
    """List of prompts, each a list of word ids (one shared word -> id map)."""
    from ..workloads import data_dir

    folder = data_dir()
    if folder is None:
        raise SystemExit("no prompt files found (shared/data/prompts beside the repository); set SPECDEC_DATA")
    vocab, docs = {}, []
    for path in sorted(folder.glob("*.jsonl")):
        with open(path) as f:
            for line in f:
                text = json.loads(line).get("prompt", "")
                words = re.findall(r"\w+|[^\w\s]", text)
                if words:
                    docs.append([vocab.setdefault(w, len(vocab)) for w in words])
    if not docs:
        raise SystemExit(f"no prompts found in {folder}")
    return docs, len(vocab)


def make_batch(docs, batch, length, workload, rng):
    """int32 [batch, length] histories."""
    out = np.empty((batch, length), dtype=np.int32)
    for b in range(batch):
        if workload == "random":
            out[b] = rng.integers(0, 50000, length, dtype=np.int32)
            continue
        row, filled = out[b], 0
        while filled < length:
            for d in rng.permutation(len(docs)):
                take = min(len(docs[d]), length - filled)
                row[filled : filled + take] = docs[d][:take]
                filled += take
                if filled == length:
                    break
    return out


# ----------------------------------------------------------------------------- peers


if HAS_NUMBA:

    @numba.njit(nogil=True, cache=False)
    def _kmp_row(s, num, min_n, max_n, k, out):
        """vLLM's scan: walk r = s reversed, tracking the longest prefix of r (the history's
        suffix, read backwards) that ends at r[i], capped at max_n (KMP failure links built
        on the fly); keep the last i with the longest length = the earliest match."""
        if num < 2:
            return 0
        lps = np.zeros(max_n, dtype=np.int32)
        longest, pos, cur, i = 0, -1, 0, 1
        while i < num:
            if s[num - 1 - i] == s[num - 1 - cur]:
                cur += 1
                if cur >= longest:
                    longest, pos = cur, i
                if i < max_n:
                    lps[i] = cur
                if cur == max_n:
                    cur = lps[max_n - 1]
                i += 1
            elif cur != 0:
                cur = lps[cur - 1]
            else:
                i += 1
        if longest < min_n:
            return 0
        start = num - 1 - pos + longest
        count = min(k, num - start)
        for t in range(count):
            out[t] = s[start + t]
        return count

    @numba.njit(nogil=True, parallel=True, cache=False)
    def numba_propose_parallel(tokens, lengths, min_n, max_n, k, out, out_lens):
        for b in numba.prange(tokens.shape[0]):
            out_lens[b] = _kmp_row(tokens[b], lengths[b], min_n, max_n, k, out[b])

    @numba.njit(nogil=True, cache=False)
    def numba_propose_serial(tokens, lengths, min_n, max_n, k, out, out_lens):
        for b in range(tokens.shape[0]):
            out_lens[b] = _kmp_row(tokens[b], lengths[b], min_n, max_n, k, out[b])


def unfold_propose(tokens, lengths, min_n, max_n, num_tokens, policy="earliest"):
    """`ngram_propose`'s rule in batched torch ops on the tokens' device (the "torch `unfold`
    matching" peer): no Python loop over rows, no host sync.

    Every window of max_n tokens (`Tensor.unfold` on the rows padded on the left) is compared
    with the row's last max_n tokens, column by column from the right; the running AND gives,
    at each window end e, the length of the match with the history's suffix that ends there
    (at most max_n, and at most e + 1: no window starts before the row). Ends e <= N - 2 have a
    token after them (the rule's j <= N - n - 1 with j = e - n + 1). The longest length over
    the row is the rule's n (none below min_n); the smallest (earliest) or largest (latest)
    end reaching it is the match, and the proposal starts at e + 1.

    Returns (draft_tokens [B, num_tokens] in tokens' dtype, -1 padded; draft_lens int32 [B]).
    """
    batch, width = tokens.shape
    device = tokens.device
    lengths = lengths.to(device=device, dtype=torch.int64)
    padded = torch.nn.functional.pad(tokens, (max_n - 1, 0))  # the pad is never counted (the e + 1 cap)
    windows = padded.unfold(1, max_n, 1)  # [B, L, max_n]: windows[b, e] = s[e - max_n + 1 : e + 1], a view
    suffix = windows[torch.arange(batch, device=device), (lengths - 1).clamp(min=0)]  # [B, max_n]
    matched = torch.zeros(batch, width, dtype=torch.int16, device=device)
    run = torch.ones(batch, width, dtype=torch.bool, device=device)
    for col in range(max_n - 1, -1, -1):
        run &= windows[:, :, col] == suffix[:, col : col + 1]
        matched += run
    ends = torch.arange(width, device=device)
    matched = torch.minimum(matched, (ends + 1).clamp(max=max_n).to(torch.int16))
    matched.masked_fill_(ends[None, :] > lengths[:, None] - 2, 0)
    best = matched.amax(dim=1, keepdim=True)  # [B, 1]: the longest n with a match
    at_best = matched == best
    if policy == "earliest":
        end = at_best.to(torch.uint8).argmax(dim=1)  # the first maximum
    else:
        end = torch.where(at_best, ends, -1).amax(dim=1)
    start = end + 1
    found = best[:, 0] >= min_n
    draft_lens = torch.where(found, (lengths - start).clamp(max=num_tokens), 0)
    offsets = torch.arange(num_tokens, device=device)
    drafts = tokens.gather(1, (start[:, None] + offsets).clamp(max=width - 1))
    drafts = drafts.masked_fill(offsets[None, :] >= draft_lens[:, None], -1)
    return drafts, draft_lens.to(torch.int32)


def hf_propose(gen, rows64):
    """PromptLookupCandidateGenerator.get_candidates on each row ([1, L] each)."""
    out = []
    for row in rows64:
        ids, _ = gen.get_candidates(row)
        out.append(ids[0, row.shape[1] :].tolist())
    return out


# ----------------------------------------------------------------------------- timing


def timeit(fn, budget_s, sets=None, warmup=True) -> common.Timing:
    """fn(x) over x in `sets` (rotated; default [None]) timed by common.time_cpu for at least budget_s."""
    sets = sets if sets is not None else [None]
    return common.time_cpu(lambda i: fn(sets[i]), n_sets=len(sets), min_run_time=budget_s, warmup=warmup)


def record(row, name, timing):
    """The median goes in the row's `ours_us` / `floor_us` / `peers_us` fields, the best block beside it (`*_best_us`)."""
    if name in ("ours", "floor"):
        row[f"{name}_us"], row[f"{name}_best_us"] = timing.median_us, timing.best_us
    else:
        row["peers_us"][name], row["peers_best_us"][name] = timing.median_us, timing.best_us


def rotated_copies(tokens_np, rng):
    """The batch plus shuffled-row copies, together over twice the last-level cache (at most
    256 MiB); each copy is a different permutation of the same rows, so the work is equal."""
    count = common.rotations(tokens_np.nbytes, "cpu", memory_budget=256 << 20)
    return [tokens_np] + [tokens_np[rng.permutation(tokens_np.shape[0])].copy() for _ in range(count - 1)]


def bench_config(docs, batch, length, workload, policy, args, rng):
    tokens_np = make_batch(docs, batch, length, workload, rng)
    tokens = torch.from_numpy(tokens_np)
    lengths = torch.full((batch,), length, dtype=torch.int64)
    copies_np = rotated_copies(tokens_np, rng)
    copies = [torch.from_numpy(c) for c in copies_np]
    kw = dict(min_n=MIN_N, max_n=MAX_N, num_tokens=NUM_TOKENS, policy=policy)
    row = {"config": dict(B=batch, L=length, workload=workload, policy=policy, dtype="int32", min_n=MIN_N,
                          max_n=MAX_N, num_tokens=NUM_TOKENS, threads=torch.get_num_threads()),
           "peers_us": {}, "peers_best_us": {}, "checked": [], "rotated_copies": len(copies)}
    budget = args.budget

    drafts, lens = ngram_propose(tokens, lengths, **kw, backend="cpu")
    row["hit_rate"] = float((lens > 0).float().mean())
    row["bytes"], row["flops"] = int(tokens_np.nbytes), 0  # the floor: the batch read once
    record(row, "ours", timeit(lambda t: ngram_propose(t, lengths, **kw, backend="cpu"), budget, copies))
    # The read floor: the faster of a 1-thread and an all-threads reduction (on a loaded
    # machine the threaded one can lose whole scheduler slices).
    threads = torch.get_num_threads()
    floors = [timeit(lambda t: t.max(), budget, copies)]
    torch.set_num_threads(1)
    floors.append(timeit(lambda t: t.max(), budget, copies))
    torch.set_num_threads(threads)
    record(row, "floor", min(floors, key=lambda t: t.median_us))

    if HAS_NUMBA and policy == "earliest":
        out = np.full((batch, NUM_TOKENS), -1, dtype=np.int32)
        out_lens = np.zeros(batch, dtype=np.int32)
        lens_np = lengths.numpy()
        best = None
        # Serial and prange versions (vLLM also runs small batches serially): the faster counts.
        for name, fn in (("serial", numba_propose_serial), ("prange", numba_propose_parallel)):
            out[:], out_lens[:] = -1, 0
            fn(tokens_np, lens_np, MIN_N, MAX_N, NUM_TOKENS, out, out_lens)
            assert np.array_equal(out_lens, lens.numpy()) and np.array_equal(out, drafts.numpy()), "numba differs"
            times = timeit(lambda t: fn(t, lens_np, MIN_N, MAX_N, NUM_TOKENS, out, out_lens), budget, copies_np)
            if best is None or times.median_us < best[0].median_us:
                best = (times, name)
        row["checked"].append("numba")
        record(row, "numba", best[0])
        row["numba_variant"] = best[1]

    # The unfold peer on the benchmark's device: distinct buffers (rows rolled) rotated as for ours.
    device = args.unfold_device
    dev_lengths = lengths.to(device)
    base = tokens.to(device)
    if device.type == "cuda":
        count = common.rotations(tokens_np.nbytes, device, memory_budget=256 << 20)
        dev_copies = [base] + [base.roll(i, 0) for i in range(1, count)]
    else:
        dev_copies = copies
    u_drafts, u_lens = unfold_propose(base, dev_lengths, MIN_N, MAX_N, NUM_TOKENS, policy)
    assert torch.equal(u_drafts.cpu(), drafts) and torch.equal(u_lens.cpu(), lens), "unfold differs"
    row["checked"].append("unfold")
    if device.type == "cuda":
        unfold_fn = lambda i: unfold_propose(dev_copies[i], dev_lengths, MIN_N, MAX_N, NUM_TOKENS, policy)  # noqa: E731
        record(row, "unfold", common.time_cuda(unfold_fn, n_sets=len(dev_copies), reps=args.cuda_reps, warmup=3,
                                               device=device))
    else:
        record(row, "unfold", timeit(lambda t: unfold_propose(t, lengths, MIN_N, MAX_N, NUM_TOKENS, policy), budget,
                                     dev_copies))
    # Ours on the GPU: the CUDA kernel where _C has one, on the same device copies as unfold,
    # checked against the C++ drafts; timed as generate calls it (input value checks off).
    if args.cuda_ours:
        c_drafts, c_lens = ngram_propose(base, dev_lengths, **kw, backend="cuda")
        assert torch.equal(c_drafts.cpu(), drafts) and torch.equal(c_lens.cpu(), lens), "CUDA kernel differs"
        row["checked"].append("ours_cuda")
        with config.value_checks(False):
            timing = common.time_cuda(lambda i: ngram_propose(dev_copies[i], dev_lengths, **kw, backend="cuda"),
                                      n_sets=len(dev_copies), reps=args.cuda_reps, warmup=3, device=device)
        row["ours_cuda_us"], row["ours_cuda_best_us"] = timing.median_us, timing.best_us
        # The GPU read floor: one max-reduction over the batch on the device.
        timing = common.time_cuda(lambda i: dev_copies[i].max(), n_sets=len(dev_copies), reps=args.cuda_reps,
                                  warmup=3, device=device)
        row["floor_cuda_us"] = timing.median_us
    del base, dev_copies

    slow_ok = batch * length <= args.slow_limit
    if slow_ok:
        ref = lambda: reference.ngram_propose(tokens, lengths, MIN_N, MAX_N, NUM_TOKENS, policy)  # noqa: E731
        r_drafts, r_lens = ref()
        assert torch.equal(r_drafts, drafts) and torch.equal(r_lens, lens), "reference differs"
        row["checked"].append("reference")
        record(row, "reference", timeit(lambda _: ref(), budget, warmup=False))
    if slow_ok and HAS_HF and policy == "earliest" and MIN_N == 1:
        gen = PromptLookupCandidateGenerator(num_output_tokens=NUM_TOKENS, max_matching_ngram_size=MAX_N,
                                             max_length=length + 1000)
        rows64 = [tokens[b : b + 1].to(torch.int64) for b in range(batch)]
        got = hf_propose(gen, rows64)
        want = [drafts[b, : int(lens[b])].tolist() for b in range(batch)]
        assert got == want, "HF differs"
        row["checked"].append("hf")
        record(row, "hf", timeit(lambda _: hf_propose(gen, rows64), budget, warmup=False))

    # The incremental index: as many rows as fit in the token cap, per-row cost scaled to B.
    idx_rows = max(1, min(batch, args.index_tokens // length))
    index = NgramIndex(idx_rows, max_n=MAX_N)
    t0 = time.perf_counter()
    for r in range(idx_rows):
        index.reset(r, tokens[r])
    reset_s = time.perf_counter() - t0
    first = index.propose(list(range(idx_rows)), **kw)
    assert torch.equal(first[0].to(torch.int32), drafts[:idx_rows]) and torch.equal(first[1], lens[:idx_rows])
    row["checked"].append("index")
    k = NUM_TOKENS + 1  # accepted drafts + the bonus token
    steps = args.index_steps
    slots = torch.arange(idx_rows)
    step_tokens, step_counts = [], []
    for _ in range(steps):  # continue each row with a stretch copied from its own history
        starts = rng.integers(0, length - k, idx_rows) if length > k else np.zeros(idx_rows, dtype=np.int64)
        step_tokens.append(torch.from_numpy(np.stack([tokens_np[r, s : s + k] for r, s in enumerate(starts)])).long())
        step_counts.append(torch.from_numpy(rng.integers(1, k + 1, idx_rows)))
    times = []
    for s in range(steps):
        t0 = time.perf_counter()
        index.append_and_propose(slots, step_tokens[s], step_counts[s], **kw)
        times.append(time.perf_counter() - t0)
    # Steps differ (random counts), so the best step is optimistic: report the median step per
    # row, scaled to B rows, in both fields.
    per_row_us = 1e6 * float(np.median(times)) / idx_rows
    row["index_per_row_us"] = per_row_us
    record(row, "index", common.Timing(per_row_us * batch, per_row_us * batch, steps))
    row["index_rows"] = idx_rows
    row["index_reset_us_per_token"] = 1e6 * reset_s / (idx_rows * length)
    row["index_bytes_per_token"] = index.memory_bytes() / (idx_rows * length)
    del index
    return row


# ----------------------------------------------------------------------------- output


TABLE_HEADERS = ["workload", "policy", "B", "L", "hit", "ours", "floor", "index", "idx/row", "numba", "unfold", "hf",
                 "ref", "numba/ours", "unfold/ours", "hf/ours", "ref/ours", "ours/index", "cuda", "cuda floor",
                 "numba/cuda", "unfold/cuda"]


def table_cells(row):
    """One table row: config, hit rate, each method's time per step, then peer / ours ratios."""
    c, p, ours = row["config"], row["peers_us"], row["ours_us"]

    cuda = row.get("ours_cuda_us")

    def ratio(peer, base=ours):
        return "-" if peer is None or base is None else f"{peer / base:.1f}x"

    return [c["workload"], c["policy"], c["B"], c["L"], f"{row['hit_rate']:.2f}", common.fmt_us(ours),
            common.fmt_us(row["floor_us"]), common.fmt_us(p.get("index")), f"{row['index_per_row_us']:.2f}us",
            common.fmt_us(p.get("numba")), common.fmt_us(p.get("unfold")), common.fmt_us(p.get("hf")),
            common.fmt_us(p.get("reference")), ratio(p.get("numba")), ratio(p.get("unfold")), ratio(p.get("hf")),
            ratio(p.get("reference")), f"{ours / p['index']:.1f}x", common.fmt_us(cuda),
            common.fmt_us(row.get("floor_cuda_us")), ratio(p.get("numba"), cuda), ratio(p.get("unfold"), cuda)]


def plot(rows, path):
    """Per-step latency against L, one panel per batch (text, earliest): ours, floor, peers."""
    text = [r for r in rows if r["config"]["workload"] == "text" and r["config"]["policy"] == "earliest"]
    panels = []
    for batch in sorted({r["config"]["B"] for r in text}):
        sel = sorted((r for r in text if r["config"]["B"] == batch), key=lambda r: r["config"]["L"])
        series = {"ours (C++)": [r["ours_us"] for r in sel], "floor (1 read)": [r["floor_us"] for r in sel]}
        for name in ("index", "numba", "unfold", "hf", "reference"):
            series[name] = [r["peers_us"].get(name) for r in sel]
        if any("ours_cuda_us" in r for r in sel):
            series["ours (CUDA)"] = [r.get("ours_cuda_us") for r in sel]
        panels.append((f"B={batch}, text, earliest", [r["config"]["L"] for r in sel], series))
    common.plot_panels(path, panels, xlabel="history length L", ylabel="per-step latency (us)",
                       title=f"n-gram drafting on {cpu_name()}, {torch.get_num_threads()} threads")


def main(argv=None) -> int:
    """Run the sweep, print the table, write the JSON and the plot; returns the exit status."""
    parser = argparse.ArgumentParser(prog="bench_ngram", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="default: small sweep, ~1-2 min")
    mode.add_argument("--full", action="store_true", help="every B x L, slow peers on bigger inputs")
    mode.add_argument("--goal", action="store_true",
                      help="the goal configuration alone (issue 37: B=256, L=32k; text and the random worst case)")
    mode.add_argument("--smoke", action="store_true", help="two tiny configs, short timings: checks the code runs "
                                                           "(written to --out, default a temporary file)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None, help="JSON path (default bench/results/ngram_<device>.json; "
                                                    "the plot goes beside it)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    threads = torch.get_num_threads()
    try:
        return sweep(args)
    finally:
        # `specdec bench kernels` runs the GPU benchmarks next in this process: their host-side
        # work (inputs, checks, launches) gets the machine's threads back, not --threads.
        torch.set_num_threads(threads)


def sweep_configs(args) -> list:
    """The (B, L, workload, policy) configs of the chosen mode; sets the mode's timing budgets
    on `args` (budget, slow_limit, index_tokens, index_steps)."""
    if args.full:
        batches, lengths = (1, 8, 64, 256), (1024, 8192, 32768, 131072)
        extra_lengths = (8192, 32768, 131072)
        args.budget, args.slow_limit, args.index_tokens, args.index_steps = 0.5, 1 << 23, 1 << 22, 60
    elif args.smoke:
        batches, lengths, extra_lengths = (2,), (512,), (512,)
        args.budget, args.slow_limit, args.index_tokens, args.index_steps = 0.01, 1 << 12, 1 << 12, 4
    else:
        batches, lengths = (1, 8, 64, 256), (1024, 8192, 32768, 131072)
        extra_lengths = (32768,)
        args.budget, args.slow_limit, args.index_tokens, args.index_steps = 0.15, 1 << 19, 1 << 21, 40
    configs = [(b, n, "text", "earliest") for b in batches for n in lengths]
    extra_batch = batches[-1]
    configs += [(extra_batch, n, w, p) for n in extra_lengths for w, p in (("text", "latest"), ("random", "earliest"),
                                                                         ("random", "latest"))]
    if args.smoke:
        configs = configs[:2]
    if args.goal:  # the quick settings at the goal's B and L alone
        configs = [(256, 32768, "text", "earliest"), (256, 32768, "random", "earliest")]
    return configs


def sweep(args) -> int:
    """The sweep of `main` with parsed arguments (torch's thread count set to --threads)."""
    torch.set_num_threads(args.threads)
    if HAS_NUMBA:
        numba.set_num_threads(min(args.threads, numba.config.NUMBA_NUM_THREADS))
    configs = sweep_configs(args)
    # The unfold peer runs where a GPU serving engine would run it: on the GPU when there is one;
    # so does our CUDA kernel where _C has it (ours_cuda_us, beside the C++ ours_us).
    args.unfold_device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args.cuda_ours = args.unfold_device.type == "cuda" and "cuda" in available_backends("ngram_propose", "cuda")
    if args.out is None:
        args.out = (os.path.join("/tmp", "bench_ngram_smoke.json") if args.smoke
                    else str(common.results_dir() / f"ngram_{common.device_slug(args.unfold_device)}"
                                                        f"{'_goal' if args.goal else ''}.json"))
    args.cuda_reps = 5 if args.smoke else 50
    docs, vocab = load_corpus()
    print(f"corpus: {len(docs)} prompts, {sum(map(len, docs))} words, vocab {vocab}; threads {args.threads}; "
          f"numba {'yes' if HAS_NUMBA else 'no'}, transformers {'yes' if HAS_HF else 'no'}; "
          f"unfold on {common.device_name(args.unfold_device)}")
    result = common.metadata(
        "ngram", args.unfold_device, "cuda" if args.cuda_ours else "cpu",
        host_cpu=cpu_name(),
        numba=numba.__version__ if HAS_NUMBA else None,
        mode="full" if args.full else ("smoke" if args.smoke else ("goal" if args.goal else "quick")),
        unfold_device=common.device_name(args.unfold_device),
        notes="ours/floor/peers_us are per decoding step for B rows; index = per-row append(1..k)+propose "
              "time x B; floor = one torch max-reduction over the batch (bytes: the batch read once; n-gram "
              "matching does no flops worth counting); numba = vLLM's reversed-KMP algorithm re-implemented "
              "here; unfold = the rule in batched torch ops (Tensor.unfold windows) on unfold_device, the "
              "history already there; hf = transformers PromptLookupCandidateGenerator.get_candidates row by row; "
              "ours, floor, numba and unfold rotate over rotated_copies copies of the batch (unfold on a GPU: "
              "enough copies to exceed twice its L2); ours_cuda_us: our CUDA kernel on those GPU copies (input "
              "value checks off), floor_cuda_us: one max-reduction over the batch on the GPU",
    )
    result["threads"] = args.threads
    rng = np.random.default_rng(args.seed)
    rows = []
    start = time.perf_counter()
    for batch, length, workload, policy in configs:
        rows.append(bench_config(docs, batch, length, workload, policy, args, rng))
        result["stat"] = stat_note(args)
        common.write_rows(result, rows, args.out, planned=len(configs), complete=False)
        c = rows[-1]
        print(f"  B={batch:<4} L={length:<7} {workload:6} {policy:8} ours {common.fmt_us(c['ours_us'])}, "
              f"checked {c['checked']}  ({time.perf_counter() - start:.0f}s)", flush=True)
    print()
    common.print_table(TABLE_HEADERS, [table_cells(r) for r in rows])
    print(f"\nmedian per call, torch.utils.benchmark (load average now {os.getloadavg()[0]:.1f} on {os.cpu_count()} "
          "cores; best blocks in the JSON); index: median step per row, x B.")
    print(f"slow peers (hf, reference) only where B*L <= {args.slow_limit}; index measured on up to "
          f"{args.index_tokens} history tokens (rows scaled to B); {time.perf_counter() - start:.0f}s")
    result["stat"] = stat_note(args)
    common.write_rows(result, rows, args.out, planned=len(configs), complete=True)
    plot(rows, os.path.splitext(args.out)[0] + ".png")
    return 0


def stat_note(args) -> str:
    """The JSON's "stat": how the times were taken, with the load average now (a loaded
    machine's numbers are suspect)."""
    unfold = ("CUDA events, median of the timed calls after warm-up" if args.unfold_device.type == "cuda"
              else "as the others")
    return ("ours_us/floor_us/peers_us: median per call (torch.utils.benchmark blocked autorange; load average "
            f"{os.getloadavg()[0]:.1f} when written); *_best_us: the fastest block; index: median step; unfold: "
            f"{unfold}")


if __name__ == "__main__":
    raise SystemExit(main())
