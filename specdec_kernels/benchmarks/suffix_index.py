"""Suffix cache (`SuffixIndex`) on the CPU: append + draft per row per decoding step.

    python -m specdec_kernels.benchmarks.suffix_index            # 64 rows, 1M cached tokens
    python -m specdec_kernels.benchmarks.suffix_index --smoke    # tiny, seconds

One decoding step: every row appends its 1-3 accepted tokens, then drafts (append_and_draft,
num_tokens=16, max_nodes=32), the cache holding `cached` tokens of text-like sequences
(random segments, 70% of them copies of earlier stretches, over a 32k vocabulary). Rows
continue random stretches of the cached text (so they match long suffixes) or random tokens
(`mix`: the share of rows on fresh text, which match short suffixes only: the costlier case,
more candidates). Reported per row and step. Peer in the same run: `NgramIndex`
append_and_propose on each row's own history (the per-row lookup the cache adds to).
Timing: best of several passes of `steps` steps (the machine may be shared). Writes
bench/results/suffix_index_<device>.json.
"""

import argparse
import time

import torch

from . import common


def text_like(count: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """Tokens where 70% of segments copy an earlier stretch (as code and chat do)."""
    out = torch.empty(count, dtype=torch.int64)
    fresh = torch.randint(0, vocab, (count,), generator=gen)
    i = 0
    while i < count:
        n = int(torch.randint(1, 64, (), generator=gen))
        n = min(n, count - i)
        if i > 64 and float(torch.rand((), generator=gen)) < 0.7:
            s = int(torch.randint(0, i - 64, (), generator=gen))
            out[i : i + n] = out[s : s + n]
        else:
            out[i : i + n] = fresh[i : i + n]
        i += n
    return out


def measure(rows: int, cached: int, mix: float, steps: int, passes: int, threads: int, gen) -> dict:
    from ..ops.ngram_index import NgramIndex
    from ..ops.suffix_index import SuffixIndex
    from .. import config

    torch.set_num_threads(threads)
    vocab = 32000
    data = text_like(cached, vocab, gen)
    index = SuffixIndex(rows, max_tokens=cached)
    index.add(list(data.split(2000)))
    ngram = NgramIndex(rows, max_n=4)
    starts = torch.randint(0, cached - 600 - 4 * steps, (rows,), generator=gen)
    for r in range(rows):
        prompt = data[int(starts[r]) : int(starts[r]) + 500]
        index.start(r, prompt)
        ngram.reset(r, prompt)
    # Each step's tokens: rows on cached text continue it, the others get fresh tokens.
    on_text = torch.rand(rows, generator=gen) >= mix
    counts = torch.randint(1, 4, (passes * steps, rows), generator=gen)
    offsets = counts.cumsum(0) - counts
    j = torch.arange(3)
    slots = torch.arange(rows)
    results = {"ours": [], "draft_only": [], "ngram_index": []}
    with config.value_checks(False):
        for p in range(passes):
            batch = []
            for k in range(p * steps, (p + 1) * steps):
                at = (starts + 500 + offsets[k])[:, None] + j
                tokens = torch.where(on_text[:, None], data[at.clamp(max=cached - 1)],
                                     torch.randint(0, vocab, (rows, 3), generator=gen))
                batch.append((tokens, counts[k]))
            start = time.perf_counter()
            for tokens, count in batch:
                index.append_and_draft(slots, tokens, count, num_tokens=16, max_nodes=32)
            results["ours"].append((time.perf_counter() - start) / steps / rows * 1e6)
            start = time.perf_counter()
            for _ in batch:
                index.draft(slots, num_tokens=16, max_nodes=32)
            results["draft_only"].append((time.perf_counter() - start) / steps / rows * 1e6)
            start = time.perf_counter()
            for tokens, count in batch:
                ngram.append_and_propose(slots, tokens, count, num_tokens=16)
            results["ngram_index"].append((time.perf_counter() - start) / steps / rows * 1e6)
    out = index.draft(slots, num_tokens=16, max_nodes=32)
    return dict(config=dict(rows=rows, cached_tokens=index.cached_tokens, fresh_rows=mix, threads=threads,
                            num_tokens=16, max_nodes=32, max_candidates=8),
                ours_us=min(results["ours"]), draft_only_us=min(results["draft_only"]),
                peers_us={"ngram_index": min(results["ngram_index"])},
                mean_match_length=float(out.match_lengths.float().mean()),
                mean_nodes=float((out.parents >= 0).sum(1).float().mean()),
                memory_mib=index.memory_bytes() / 2**20, unit="us per row per step")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="specdec_kernels.benchmarks.suffix_index", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (seconds)")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--cached", type=int, default=1 << 20)
    parser.add_argument("--out", default=None, help="JSON path (default bench/results/suffix_index_<device>.json)")
    args = parser.parse_args(argv)
    from ..ops.suffix_index import SuffixIndex

    if not SuffixIndex.has_compiled_backend():
        print("suffix_index: no compiled SuffixIndex in specdec_kernels._C (rebuild); nothing measured")
        return 2
    gen = torch.Generator().manual_seed(0)
    rows, cached, steps = (8, 1 << 14, 20) if args.smoke else (args.rows, args.cached, 100)
    threads0 = torch.get_num_threads()
    configs = [(mix, threads) for mix in (0.0, 0.5) for threads in sorted({1, threads0})]
    results = []
    for mix, threads in configs:
        results.append(measure(rows, cached, mix, steps, 3, threads, gen))
        r = results[-1]
        print(f"rows {rows}, cached {r['config']['cached_tokens']}, fresh rows {mix:.0%}, {threads} thread(s): "
              f"append+draft {r['ours_us']:.2f} us/row/step (draft alone {r['draft_only_us']:.2f}); "
              f"NgramIndex append+propose {r['peers_us']['ngram_index']:.2f}; match {r['mean_match_length']:.1f}, "
              f"{r['mean_nodes']:.1f} nodes; {r['memory_mib']:.0f} MiB", flush=True)
    torch.set_num_threads(threads0)
    result = common.metadata("suffix_index", "cpu", "cpu", rows=results)
    path = args.out or (common.results_dir() / f"suffix_index_{common.device_slug('cpu')}.json")
    common.write_json(result, path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
