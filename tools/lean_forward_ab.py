"""Plain decoding's verify step with and without the lean forward, interleaved (loop/hf/lean.py).

Single end-to-end passes on a shared 2-core VM move by +-15% between runs, more than the lean
forward changes a step; this alternates the two (`config.lean_forward` on / off, the order
flipped every round) on the same code-edit prompts in one process, drops the first round
(warm-up, calibration) and prints each side's ms per step (generate's time_verify / steps).

    python tools/lean_forward_ab.py [--threads 2] [--dtype float32|bfloat16] [--rounds 5]
"""

import argparse
import statistics

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--rounds", type=int, default=5, help="rounds, the first dropped (default 5)")
    parser.add_argument("--prompts", type=int, default=3, help="code-edit prompts per round (default 3)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import specdec_kernels as sk
    from specdec_kernels import config
    from specdec_kernels.models import default_model_dir
    from specdec_kernels.workloads import load_workload

    folder = default_model_dir(verbose=False)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, args.dtype)).eval()
    prompts = [tokenizer(r.render(tokenizer), return_tensors="pt").input_ids
               for r in load_workload("code_edit", limit=args.prompts)]
    ms = {True: [], False: []}
    for round_ in range(args.rounds):
        for lean in ((True, False) if round_ % 2 == 0 else (False, True)):
            config.lean_forward = lean
            steps = seconds = 0
            for prompt in prompts:
                out = sk.generate(model, prompt, max_new_tokens=args.max_new_tokens, timing=True)
                steps, seconds = steps + out.stats.steps, seconds + out.stats.time_verify
            if round_ > 0:
                ms[lean].append(1000 * seconds / steps)
    for lean, name in ((True, "lean forward"), (False, "model's own")):
        print(f"{name:13s} {[round(x, 1) for x in ms[lean]]} median {statistics.median(ms[lean]):.1f} ms/step")


if __name__ == "__main__":
    main()
