"""What the adaptive planner predicted against what it got, step by step, grouped by the
number of draft nodes it chose to verify: predicted accepted drafts (the sum of the kept
nodes' acceptance estimates) against the drafts accepted, and the predicted step seconds
(forward plus drafting, the cost model's) against the step's measured seconds. Batch 1,
greedy, `default_drafter`, dev prompts (never the benchmark's held-out ones).

    SPECDEC_DATA=../shared/data/prompts python tools/planner_calibration.py --workload summarization \
        --prompts 6,7 [--dtype bfloat16] [--max-new-tokens 128]

It wraps `Planner.select` and the module's `_choose_counts` (read-only: the plan is the
planner's own). Twenty-first session, bf16 summarisation, dev prompt 7 (701 tokens): the
step costs were predicted within ~5-10%, steps of 1-3 nodes' gains about right (0.46 / 0.79 /
1.18 predicted, 0.33 / 1.06 / 0.83 accepted), but 11-node steps (long n-gram / suffix
copies) predicted 3.6 accepted drafts and got 0.9 (docs/loop.md).
"""

import argparse
import collections

import numpy as np
import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="summarization")
    parser.add_argument("--prompts", default="5,6,7", help="comma-separated dev prompt indices")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    from specdec_kernels.heads.default import default_drafter
    from specdec_kernels.loop import planner as planner_module
    from specdec_kernels.loop.generate import generate
    from specdec_kernels.models import load_model
    from specdec_kernels.workloads import load_workload

    model, tokenizer = load_model(verbose=False)[:2]
    model = model.to(getattr(torch, args.dtype))
    drafter = default_drafter(model)
    generate(model, load_workload("chat")[8].input_ids(tokenizer), drafter=drafter, max_new_tokens=32)  # warm-up

    chosen = []  # per select: (nodes kept, predicted gain, predicted step seconds)
    last = {}
    choose = planner_module._choose_counts

    def recording_choose(gains, seconds, *rest, **kwargs):
        counts = choose(gains, seconds, *rest, **kwargs)
        nodes = int(counts.max()) if counts.size else 0
        last["plan"] = (nodes, float(gains[0, :nodes].sum()), float(seconds[nodes]))
        return counts

    select = planner_module.Planner.select

    def recording_select(self, draft, *rest, **kwargs):
        last.pop("plan", None)
        out = select(self, draft, *rest, **kwargs)
        chosen.append(last.get("plan", (0, 0.0, float("nan"))))  # (a root-only tree: nothing chosen)
        return out

    planner_module._choose_counts = recording_choose
    planner_module.Planner.select = recording_select
    by_nodes = collections.defaultdict(list)
    for index in (int(i) for i in args.prompts.split(",")):
        chosen.clear()
        ids = load_workload(args.workload)[index].input_ids(tokenizer)
        out = generate(model, ids, drafter=drafter, max_new_tokens=args.max_new_tokens)
        for (nodes, gain, predicted), step in list(zip(chosen, out.stats.trace))[1:]:  # (the first: the catch-up)
            by_nodes[nodes].append((gain, step["accepted_per_row"], predicted, step["seconds"]))
    print(f"{args.workload}, {args.dtype}, prompts {args.prompts}: by verified draft nodes per step")
    for nodes in sorted(by_nodes):
        v = np.array(by_nodes[nodes])
        print(f"  {nodes:2d} nodes: {len(v):4d} steps; accepted drafts predicted {v[:, 0].mean():.2f}, got "
              f"{v[:, 1].mean():.2f}; step predicted {1e3 * np.nanmean(v[:, 2]) if nodes else float('nan'):.1f} ms, "
              f"measured {1e3 * v[:, 3].mean():.1f} ms")


if __name__ == "__main__":
    main()
