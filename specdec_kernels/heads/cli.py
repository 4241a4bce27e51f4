"""`specdec train-draft`: train an EAGLE or Medusa head for a model (see `train_draft_head`).

Prompts come from JSON-lines files (`--prompts`, repeatable: objects with "prompt", a user
turn, or "text", raw text to continue) and/or the shared dev workloads (`--workloads`, with
the first `--holdout` requests of each left out so benchmarks measure unseen requests), plus
user turns the model writes itself (`--self-prompts N`) and requests to summarise news
articles it writes itself (`--self-articles N`).

Example (a small head in minutes; the shipped head's full command, and what it took, are in
specdec_kernels/heads/trained/<name>/README.md):
    specdec train-draft --kind eagle --workloads code_completion:16,code_edit:16,summarization:16 \\
        --holdout 10 --self-prompts 48 --steps 200 --out my_head
"""

import argparse
import shlex
import sys


def _parse_workloads(text: str):
    """"name[:count],..." -> [(name, count or None)]."""
    from ..workloads import WORKLOADS

    out = []
    for part in text.split(","):
        name, _, count = part.strip().partition(":")
        if name == "all":
            out += [(w, None) for w in WORKLOADS]
            continue
        if name not in WORKLOADS:
            raise argparse.ArgumentTypeError(f"unknown workload {name!r} (one of {', '.join(WORKLOADS)}, or all)")
        try:
            out.append((name, int(count) if count else None))
        except ValueError:
            raise argparse.ArgumentTypeError(f"--workloads: count of {name!r} must be an integer, got {count!r}") from None
    return out


def add_parser(sub) -> None:
    """Register the `train-draft` subcommand on an argparse subparsers object."""
    p = sub.add_parser("train-draft", help="train an EAGLE or Medusa draft head for a model (self-distillation)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF model directory or cached hub name (default: SmolLM2-135M-Instruct)")
    p.add_argument("--kind", choices=("eagle", "medusa", "mtp"), default="eagle")
    p.add_argument("--prompts", action="append", default=[], metavar="JSONL", help="prompt file (repeatable)")
    p.add_argument("--workloads", type=_parse_workloads, default=None, metavar="NAME[:N],...",
                   help="shared dev workloads to take prompts from (after --holdout), e.g. chat,summarization:20 or all")
    p.add_argument("--holdout", type=int, default=10, help="requests left out at the start of each workload (default 10)")
    p.add_argument("--self-prompts", type=int, default=0, help="user turns the model writes itself (default 0)")
    p.add_argument("--self-articles", type=int, default=0,
                   help="summarisation requests over news articles the model writes itself (default 0)")
    p.add_argument("--out", required=True, help="output directory (head.safetensors, config.json, train_log.jsonl)")
    p.add_argument("--work-dir", default=None, help="resumable state (default <out>/work)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="response length per prompt (default 128)")
    p.add_argument("--collect-batch-size", type=int, default=32, help="prompts answered together (default 32)")
    p.add_argument("--generation-dtype", choices=("bfloat16", "float16", "float32", "model"), default="bfloat16",
                   help="dtype of the copy of the model that writes the responses (default bfloat16; "
                        "'model': the model itself); labels always come from the model's LM head")
    p.add_argument("--feature-dtype", choices=("model", "bfloat16"), default="model",
                   help="dtype of the forward that computes the features (default model: the model itself; "
                        "bfloat16: a bf16 copy, ~2x faster on CPUs with bf16 units; labels always from the model's LM head). "
                        "The same dtype as --generation-dtype: the writer records them as it writes, no extra forward")
    p.add_argument("--draft-vocab", type=int, default=8192, help="tokens the head can propose (default 8192)")
    p.add_argument("--num-heads", type=int, default=4, help="Medusa heads (default 4)")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch-tokens", type=int, default=2048)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--unroll", type=int, default=2, metavar="D",
                   help="EAGLE and MTP: also train draft depths 2 .. D + 1 on the head's own predicted features "
                        "(training-time test; default 2, 0: off)")
    p.add_argument("--prompt-weight", type=float, default=1.0,
                   help="EAGLE: loss weight of positions predicting prompt tokens (responses: 1; default 1)")
    p.add_argument("--feature-layers", default=None, metavar="eagle3|I,J,..",
                   help="EAGLE: fuse these hidden states of the model into the head's input (EAGLE-3): 'eagle3' "
                        "(the outputs of layers 2, L/2 and L-3) or indices (0 the embeddings, i the output of layer i); "
                        "default: the LM head's input alone")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.set_defaults(func=run)


def run(args) -> int:
    """Run `train-draft` from parsed arguments."""
    from ..models import load_model
    from .data import read_prompts_jsonl
    from .train import train_draft_head
    from ..workloads import load_workload

    import torch

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    prompts, sources = [], []
    for path in args.prompts:
        rows = read_prompts_jsonl(path)
        prompts += rows
        sources.append(f"{path}: {len(rows)}")
    for name, count in args.workloads or []:
        reqs = load_workload(name)[args.holdout :]
        reqs = reqs[:count] if count is not None else reqs
        prompts += reqs
        sources.append(f"workload {name}: requests {args.holdout}..{args.holdout + len(reqs) - 1} "
                       f"(the first {args.holdout} held out)")
    if not prompts and args.self_prompts <= 0 and args.self_articles <= 0:
        print("specdec train-draft: give --prompts, --workloads, --self-prompts or --self-articles", file=sys.stderr)
        return 2
    layers = args.feature_layers
    if layers is not None and layers != "eagle3":
        try:
            layers = [int(i) for i in layers.split(",")]
        except ValueError:
            print(f"specdec train-draft: --feature-layers must be 'eagle3' or comma-separated integers, got {layers!r}",
                  file=sys.stderr)
            return 2
    model, tokenizer = load_model(args.model)
    notes = {"command": "specdec " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[1:2] == ["train-draft"] else None,
             "prompt_sources": sources + ([f"self-written user turns: {args.self_prompts}"] if args.self_prompts else [])
             + ([f"summaries of self-written articles: {args.self_articles}"] if args.self_articles else [])}
    out = train_draft_head(model, prompts, kind=args.kind, out_dir=args.out, tokenizer=tokenizer, work_dir=args.work_dir,
                           max_new_tokens=args.max_new_tokens, self_prompt_count=args.self_prompts,
                           self_article_count=args.self_articles,
                           collect_batch_size=args.collect_batch_size,
                           generation_dtype=None if args.generation_dtype == "model" else getattr(torch, args.generation_dtype),
                           feature_dtype=None if args.feature_dtype == "model" else getattr(torch, args.feature_dtype),
                           draft_vocab_size=args.draft_vocab, num_heads=args.num_heads, steps=args.steps,
                           batch_tokens=args.batch_tokens, lr=args.lr, seed=args.seed, unroll=args.unroll,
                           prompt_weight=args.prompt_weight, feature_layers=layers, notes=notes)
    print(f"specdec train-draft: head written to {out}")
    return 0
