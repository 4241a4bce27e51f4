"""Held-out agreement per depth: a trained MTP head (`specdec train-draft --kind mtp`) against
the shipped EAGLE head, on the default model.

Both draft greedy chains of `--depth` tokens (fixed size, no planner, no confidence cut) on
the first `--holdout` requests of each workload (the ones `specdec train-draft --holdout`
leaves out of training); a drafted depth d is accepted when it and every depth before it
equal the target's greedy tokens, so `acceptance_per_depth[d - 1]` is the held-out
agreement of the head's chain at depth d. Same prompts, same target, same length for both.

    python tools/mtp_vs_eagle.py --mtp /tmp/mtp_smol [--holdout 3] [--tokens 48] [--depth 3] [--heads eagle,mtp]
"""

import argparse
import json

import torch


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mtp", default=None, help="MTP head directory (train-draft --kind mtp --out)")
    parser.add_argument("--heads", default="eagle,mtp", help="which heads to run (comma-separated; default both)")
    parser.add_argument("--holdout", type=int, default=3, help="held-out requests per workload to use")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import specdec_kernels as sk
    from specdec_kernels.heads import find_head
    from specdec_kernels.models import load_model
    from specdec_kernels.workloads import load_workload

    target, tokenizer = load_model()
    eagle_dir = find_head(target, kind="eagle")
    drafters = {"eagle": lambda: sk.EagleDrafter(target, eagle_dir, max_nodes=args.depth, depth=args.depth, top_k=1,
                                                 min_score=0.0),
                "mtp": lambda: sk.MtpDrafter(target, args.mtp, num_tokens=args.depth, min_score=0.0)}
    chosen = [h for h in args.heads.split(",") if h]
    if "mtp" in chosen and args.mtp is None:
        parser.error("--mtp DIR is needed to run the MTP head")
    drafters = {name: make for name, make in drafters.items() if name in chosen}
    totals = {name: [0.0] * args.depth for name in drafters}
    steps = {name: 0 for name in drafters}
    for workload in ("code_completion", "code_edit", "summarization"):
        for request in load_workload(workload)[: args.holdout]:
            ids = request.input_ids(tokenizer)
            for name, make in drafters.items():
                out = sk.generate(target, ids, drafter=make(), max_new_tokens=args.tokens, adaptive=False, eos_token_id=[])
                s = out.stats
                for d, a in enumerate(s.acceptance_per_depth[: args.depth]):
                    totals[name][d] += a * s.steps
                steps[name] += s.steps
    result = {name: [round(t / max(steps[name], 1), 4) for t in totals[name]] for name in drafters}
    print(json.dumps({"holdout_per_workload": args.holdout, "tokens": args.tokens, "depth": args.depth,
                      "acceptance_per_depth": result, "steps": steps}, indent=1))


if __name__ == "__main__":
    main()
