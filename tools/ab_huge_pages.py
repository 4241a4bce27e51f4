"""Same-process interleaved A/B of `generate` with the weights in 4 KB pages (`config.huge_pages` off)
against moved into 2 MB pages (`loop.memory`), plain and `default_drafter`, batch 1, 128 tokens, on
dev prompts 5-7 of chat and code edit (not the benchmark's held-out ones). Usage:
`SPECDEC_DATA=../shared/data/prompts python tools/ab_huge_pages.py [rounds]` (fifteenth session: 4)."""
import statistics as st
import sys
import time

import torch

from specdec_kernels import config
from specdec_kernels.models import load_model
from specdec_kernels.methods import make_drafter
from specdec_kernels.workloads import load_workload
from specdec_kernels.loop.generate import generate
a, tok = load_model(verbose=False)[:2]
b = load_model(verbose=False)[0]
def ids_of(r):
    if r.chat:
        return tok.apply_chat_template([{"role": "user", "content": r.text}], add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    return tok(r.text, return_tensors="pt").input_ids
work = [(w, ids_of(r)) for w in ("chat", "code_edit") for r in load_workload(w)[5:8]]
drafters = {"plain": (None, None), "default": (make_drafter("default", target=a), make_drafter("default", target=b))}
def run(k, method, ids):
    """One call on model a (k=0: never moved) or b (k=1: moved on its first call)."""
    config.huge_pages = (k == 1)
    model = (a, b)[k]
    d = drafters[method][k]
    start = time.perf_counter()
    out = generate(model, ids, drafter=d, max_new_tokens=128, temperature=0)
    return time.perf_counter() - start, out.sequences
for k in (0, 1):  # warm-up: cost models, b's move
    for m in drafters:
        run(k, m, work[0][1])
print("moved:", hasattr(b, "_specdec_huge_page_regions"), hasattr(a, "_specdec_huge_page_regions"))
ratios = {m: [] for m in drafters}
for rnd in range(int(sys.argv[1]) if len(sys.argv) > 1 else 3):
    for w, ids in work:
        for m in drafters:
            order = (0, 1) if rnd % 2 == 0 else (1, 0)
            t = {}
            seqs = {}
            for k in order:
                t[k], seqs[k] = run(k, m, ids)
            assert torch.equal(seqs[0], seqs[1])
            ratios[m].append(t[0] / t[1])
            print(rnd, w, m, f"4K {t[0]:.3f} 2M {t[1]:.3f} ratio {t[0]/t[1]:.3f}", flush=True)
for m, r in ratios.items():
    print(m, "median 4K/2M", round(st.median(r), 3), "of", len(r), "pairs; >1:", sum(x > 1 for x in r))
