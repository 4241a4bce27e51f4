"""Drafting overhead of one MTP layer per step, batch 1, on the default model (CPU).

The default model (SmolLM2-135M, Llama) ships no MTP layers, so this writes a DeepSeek-layout
MTP checkpoint for it with random weights (`model.layers.{N}.enorm / hnorm / eh_proj /
shared_head.norm` and a Llama decoder layer at index N, initialised as transformers
initialises one) into a temporary directory: the cost of a step does not depend on the
weights' values, only the acceptance does (random weights accept ~nothing, so this measures
cost, not speedup). Then `generate(..., timing=True, adaptive=False)` with a chain of k MTP
drafts prints the per-step split: draft (the MTP layer: catch-up on the accepted tokens plus
k - 1 further forwards, and the LM head), verify (the target's tree forward and `verify`),
accept; the draft share is draft / verify per step.

    python tools/mtp_overhead.py [--tokens 64] [--chain 1 3] [--threads 2] [--mtp DIR]

--mtp DIR times a trained MTP head (`specdec train-draft --kind mtp --out DIR`, drafting over
its own draft vocabulary) instead of the random layer; it also accepts drafts, so a step
covers more tokens and the catch-up feeds the layer more of them.
"""

import argparse
import tempfile
import time
from pathlib import Path

import torch


def write_random_mtp(target, folder: Path, seed: int = 0) -> Path:
    """A DeepSeek-layout MTP checkpoint (MTP keys only) for `target` with random weights."""
    from safetensors.torch import save_file

    cfg = target.config
    n, hidden = cfg.num_hidden_layers, cfg.hidden_size
    torch.manual_seed(seed)
    layer = type(target.model.layers[0])(cfg, n)
    for name, p in layer.named_parameters():
        with torch.no_grad():
            p.copy_(torch.ones_like(p) if name.endswith("norm.weight") else torch.randn_like(p) * cfg.initializer_range)
    prefix = f"model.layers.{n}."
    tensors = {prefix + k: v.detach().float().contiguous() for k, v in layer.state_dict().items()}
    tensors.update({prefix + "enorm.weight": torch.ones(hidden), prefix + "hnorm.weight": torch.ones(hidden),
                    prefix + "eh_proj.weight": torch.randn(hidden, 2 * hidden) * cfg.initializer_range,
                    prefix + "shared_head.norm.weight": torch.ones(hidden)})
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per run")
    parser.add_argument("--chain", type=int, nargs="+", default=[1, 3], help="MTP chain lengths to time")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mtp", default=None, metavar="DIR", help="a trained MTP head instead of the random layer")
    parser.add_argument("--draft-vocab", action="store_true",
                        help="also time chains restricted to the shipped EAGLE head's draft vocabulary (8192 tokens)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import specdec_kernels as sk
    from specdec_kernels.models import load_model

    target, tokenizer = load_model()
    prompt = tokenizer("Write a Python function that returns the n-th Fibonacci number, with a docstring.",
                       return_tensors="pt").input_ids
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.mtp) if args.mtp else write_random_mtp(target, Path(tmp))
        rows = []
        plain = None
        vocab = None
        if args.draft_vocab:
            from specdec_kernels.heads import find_head
            from specdec_kernels.heads.common import read_head

            vocab = read_head(find_head(target, kind="eagle"))[1]["draft_vocab"]
        configs = [(0, None)] + [(k, None) for k in args.chain] + ([(k, vocab) for k in args.chain] if vocab is not None else [])
        for k, ids in configs:
            best = None
            for _ in range(args.repeats):
                drafter = None if k == 0 else sk.MtpDrafter(target, folder, num_tokens=k, min_score=0.0, draft_vocab=ids)
                t0 = time.perf_counter()
                out = sk.generate(target, prompt, drafter=drafter, max_new_tokens=args.tokens, timing=True, adaptive=False,
                                  eos_token_id=[])
                wall = time.perf_counter() - t0
                s = out.stats
                row = dict(k=k, vocab=len(ids) if ids is not None else "all", steps=s.steps, draft_ms=1e3 * s.time_draft / s.steps, verify_ms=1e3 * s.time_verify / s.steps,
                           accept_ms=1e3 * s.time_accept / s.steps, tokens_per_step=s.tokens_per_step, wall_s=wall)
                print(f"  run: {row}", flush=True)
                if best is None or row["draft_ms"] + row["verify_ms"] < best["draft_ms"] + best["verify_ms"]:
                    best = row
            if k == 0:
                plain = best
            rows.append(best)
        print(f"default model, B=1, CPU threads {args.threads}, {args.tokens} new tokens, best of {args.repeats}")
        print(f"{'drafter':<20}{'steps':>6}{'draft ms':>10}{'verify ms':>11}{'accept ms':>11}"
              f"{'draft/verify':>14}{'draft/plain step':>18}{'tok/step':>10}")
        plain_step = plain["verify_ms"] + plain["accept_ms"]
        for r in rows:
            name = "plain" if r["k"] == 0 else f"mtp chain {r['k']}" + ("" if r["vocab"] == "all" else f" v{r['vocab']}")
            print(f"{name:<20}{r['steps']:>6}{r['draft_ms']:>10.2f}{r['verify_ms']:>11.2f}{r['accept_ms']:>11.2f}"
                  f"{r['draft_ms'] / r['verify_ms']:>14.1%}{r['draft_ms'] / plain_step:>18.1%}{r['tokens_per_step']:>10.2f}")


if __name__ == "__main__":
    main()
