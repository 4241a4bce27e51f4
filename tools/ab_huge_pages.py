"""`generate` with the weights in 4 KB pages against 2 MB pages (loop/memory.py), interleaved.

Two copies of the default model in one process: a (`config.huge_pages` off for its calls: never
moved) and b (moved on its first call). Each round runs every prompt on both, plain and with
`default_drafter`, the order flipped every round; every pair's outputs must be equal. Prints
each pair's seconds and the median ratio (4 KB / 2 MB) per method. Batch 1, greedy, 128 new
tokens, dev prompts 5-7 of chat and code edit (not the benchmark's held-out ones); the
fifteenth session's log is bench/results/huge_pages_ab_s15.txt.

    SPECDEC_DATA=../shared/data/prompts python tools/ab_huge_pages.py [--rounds 4]
"""

import argparse
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    from specdec_kernels import config
    from specdec_kernels.loop.generate import generate
    from specdec_kernels.methods import make_drafter
    from specdec_kernels.models import load_model
    from specdec_kernels.workloads import load_workload

    a, tokenizer = load_model(verbose=False)[:2]
    b = load_model(verbose=False)[0]
    work = [(name, r.input_ids(tokenizer)) for name in ("chat", "code_edit") for r in load_workload(name)[5:8]]
    drafters = {"plain": (None, None), "default": (make_drafter("default", target=a), make_drafter("default", target=b))}

    def run(k, method, ids):
        """One call on model a (k=0) or b (k=1): (seconds, sequences)."""
        config.huge_pages = k == 1
        start = time.perf_counter()
        out = generate((a, b)[k], ids, drafter=drafters[method][k], max_new_tokens=128, temperature=0)
        return time.perf_counter() - start, out.sequences

    for k in (0, 1):  # warm-up: cost models, b's move
        for method in drafters:
            run(k, method, work[0][1])
    print("moved:", hasattr(b, "_specdec_huge_page_regions"), hasattr(a, "_specdec_huge_page_regions"))
    ratios = {method: [] for method in drafters}
    for round_ in range(args.rounds):
        for name, ids in work:
            for method in drafters:
                seconds, sequences = {}, {}
                for k in (0, 1) if round_ % 2 == 0 else (1, 0):
                    seconds[k], sequences[k] = run(k, method, ids)
                assert torch.equal(sequences[0], sequences[1])
                ratios[method].append(seconds[0] / seconds[1])
                print(round_, name, method, f"4K {seconds[0]:.3f} 2M {seconds[1]:.3f} ratio {seconds[0] / seconds[1]:.3f}",
                      flush=True)
    for method, r in ratios.items():
        print(method, "median 4K/2M", round(statistics.median(r), 3), "of", len(r), "pairs; >1:", sum(x > 1 for x in r))


if __name__ == "__main__":
    main()
