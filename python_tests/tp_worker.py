"""Run by test_tensor_parallel.py under `torchrun --nproc-per-node 2` (gloo, CPU): generate on a
target sharded with transformers' tensor parallelism (tp_plan="auto"), every rank writing its
outputs to <out_dir>/rank<r>.pt for the test to compare with a single-process run."""

import os
import sys

import torch

import specdec_kernels as sk
from specdec_kernels.loop import cost_model
from transformers import AutoModelForCausalLM


def main(model_dir, out_dir):
    # Each rank its own cache folder, and only rank 1 holds a cost model for the target: the
    # ranks must still agree to measure it together (a rank that calibrated alone would run
    # collective forwards the other rank never joins).
    rank = os.environ["RANK"]
    os.environ["SPECDEC_CACHE_DIR"] = os.path.join(out_dir, f"cache{rank}")
    target = AutoModelForCausalLM.from_pretrained(model_dir, tp_plan="auto")
    if rank == "1":
        key = cost_model.identity(target)
        cost_model.CostModel(key, {1: ([1, 2, 4], [1e-3, 1.5e-3, 2e-3])}).save(cost_model.default_path(key))
    ids = torch.load(os.path.join(out_dir, "inputs.pt"))
    results = {}
    for name, kwargs in CASES.items():
        out = sk.generate(target, ids["input_ids"], attention_mask=ids["attention_mask"], **kwargs())
        results[name] = out.sequences
        # The trees each step verified: ranks must plan alike (their forwards are collective).
        results[name + "_widths"] = torch.tensor([step["width"] for step in out.stats.trace])
    results["hf_greedy"] = target.generate(ids["input_ids"], attention_mask=ids["attention_mask"], max_new_tokens=12,
                                           do_sample=False, pad_token_id=0)
    torch.save(results, os.path.join(out_dir, f"rank{os.environ['RANK']}.pt"))
    # Leave together and tear the group down before exit: a gloo group still alive at
    # interpreter shutdown can abort a worker ("terminate called without an active exception";
    # seen once in a fresh-clone run).
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


CASES = {
    "greedy_ngram_tree": lambda: dict(max_new_tokens=12, drafter=sk.NgramDrafter(num_tokens=4, tree_width=2)),
    "sampled_ngram_chain": lambda: dict(max_new_tokens=12, drafter=sk.NgramDrafter(num_tokens=4), temperature=0.8, seed=123),
    "greedy_penalty": lambda: dict(max_new_tokens=12, drafter=sk.NgramDrafter(num_tokens=4), repetition_penalty=1.3),
}

if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
