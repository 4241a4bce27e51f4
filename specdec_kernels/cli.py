"""`specdec` command line: `demo`, `generate`, `info`, `bench` (also `python -m specdec_kernels`).

    specdec demo                      plain HF greedy decoding vs ours (default_drafter), same prompt
    specdec generate --prompt "..."   one generation (default_drafter, or --method), stats at the end
    specdec info                      versions, compiled extension, backends per op, device
    specdec bench kernels|e2e|online|linear|vllm|all   the benchmark suite (specdec_kernels.benchmarks), results in bench/results
"""

import argparse
import importlib.metadata
import inspect
import os
import platform
import sys
import time

import torch

from ._platform import cpu_name
from .methods import (DRAFT_TREE_WIDTHS, METHODS, NEEDS_DRAFT_MODEL, NGRAM_TREE_WIDTH, first_difference, make_drafter,
                      stop_ids)

DEMO_METHODS = ("default", "ngram")  # `specdec demo --method`
DEMO_MAX_NEW_TOKENS = 128  # long enough for the n-gram drafts to pay off, short enough for ~1 min on 2 CPU cores


def _fail(message: str) -> SystemExit:
    """A SystemExit that prints `specdec: error: message` to stderr and exits with status 1."""
    return SystemExit(f"specdec: error: {message}")


def _generate_api():
    """`specdec_kernels` with its decoding loop, or a clear error if this build lacks it."""
    import specdec_kernels

    missing = [n for n in ("generate", "NgramDrafter", "DraftModelDrafter", "MergedDrafter") if not hasattr(specdec_kernels, n)]
    if missing:
        raise _fail(f"this build of specdec_kernels has no {', '.join(missing)} (the decoding loop is not available)")
    return specdec_kernels


def _load(name, label="model", dtype="float32"):
    """load_model with a one-line report, turning load errors into a clean CLI error."""
    from .models import DEFAULT_MODEL, load_model

    start = time.perf_counter()
    try:
        model, tokenizer = load_model(name, dtype=dtype)
    except (ImportError, OSError, ValueError) as error:  # missing wheel/extra, unknown model, bad directory
        raise _fail(str(error)) from None
    print(f"{label}: {name or DEFAULT_MODEL} ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M params, "
          f"{model.dtype}, loaded in {time.perf_counter() - start:.1f} s)", flush=True)
    return model, tokenizer


def _encode(tokenizer, text: str, chat: bool) -> torch.Tensor:
    """int64 [1, L]: `text` as a chat user turn (template applied) or as raw text to continue."""
    from .workloads import Request

    return Request("cli", "prompt", text, chat=chat).input_ids(tokenizer)


def _read_prompt_file(path: str) -> str:
    """The text of `path` ('-' reads standard input)."""
    if path == "-":
        return sys.stdin.read()
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as error:
        raise _fail(f"--prompt-file: {error}") from None


def cut_mark(new_tokens, max_new_tokens: int, eos) -> str:
    """The mark to append to a generation's text when it ran into the token cap rather than
    ending at an eos id (so its text stops mid-line): " ... [stopped at max_new_tokens=N]" (with
    an ellipsis character), else "". new_tokens: the generated ids (a list or a 1-D tensor);
    eos: an id, a list of ids, or None."""
    tokens = new_tokens.tolist() if isinstance(new_tokens, torch.Tensor) else list(new_tokens)
    eos_ids = set() if eos is None else ({eos} if isinstance(eos, int) else set(eos))
    if len(tokens) < max_new_tokens or (tokens and tokens[-1] in eos_ids):
        return ""
    return f" \u2026 [stopped at max_new_tokens={max_new_tokens}]"


class _ProgressStreamer:
    """HF streamer protocol (`put(token_ids)`, `end()`) driving a tqdm bar of generated tokens.

    The first `put` is the prompt and is skipped. Cost per call is a counter update, small
    next to a forward pass, so it does not distort the timings it accompanies.
    """

    def __init__(self, total: int, desc: str):
        from tqdm import tqdm

        # disable=None: no bar when stderr is not a terminal (logs, CI), where each redraw
        # would land as text in the middle of the output.
        self.bar = tqdm(total=total, desc=desc, unit="tok", leave=False, file=sys.stderr, dynamic_ncols=True,
                        disable=None)
        self.seen_prompt = False

    def put(self, value):
        """Count the tokens of one step (the first call, the prompt, is skipped)."""
        if not self.seen_prompt:
            self.seen_prompt = True
            return
        self.bar.update(int(value.numel()))

    def end(self):
        """Close the bar (it is not left on screen)."""
        self.bar.close()


class _TextStreamer:
    """HF streamer protocol printing the decoded text as tokens arrive (prompt skipped)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.tokens, self.printed, self.seen_prompt = tokenizer, [], 0, False

    def put(self, value):
        """Print the text the new tokens complete (the first call, the prompt, is skipped)."""
        if not self.seen_prompt:
            self.seen_prompt = True
            return
        self.tokens += value.reshape(-1).tolist()
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        # Hold back a trailing replacement char: an incomplete multi-byte character so far.
        safe = len(text.rstrip("\ufffd"))
        if safe > self.printed:
            print(text[self.printed:safe], end="", flush=True)
            self.printed = safe

    def end(self):
        """Print whatever is left and end the line."""
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        print(text[self.printed:], flush=True)


def _streamer_kwargs(generate_fn, streamer) -> dict:
    """{'streamer': streamer} if our generate accepts an HF-style streamer, else {}."""
    return {"streamer": streamer} if "streamer" in inspect.signature(generate_fn).parameters else {}


def _hf_generate(model, input_ids, max_new_tokens, eos, pad, progress_desc=None, **kwargs):
    """HF `generate` greedy; returns (sequences [1, L + new], seconds)."""
    streamer = _ProgressStreamer(max_new_tokens, progress_desc) if progress_desc else None
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                             max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=pad,
                             streamer=streamer, **kwargs)
    return out, time.perf_counter() - start


def _print_stats(stats, seconds: float, new_tokens: int, indent: str = "  ") -> None:
    """Steps, tokens per step, acceptance per depth and the time split of one `generate` call."""
    print(f"{indent}steps: {stats.steps}, tokens per step: {stats.tokens_per_step:.2f}, "
          f"{new_tokens} tokens in {seconds:.2f} s = {new_tokens / seconds:.1f} tokens/s")
    if stats.acceptance_per_depth:
        depths = "  ".join(f"{d + 1}:{a:.2f}" for d, a in enumerate(stats.acceptance_per_depth))
        print(f"{indent}acceptance per depth (fraction of steps accepting >= d drafts): {depths}")
    if stats.nodes_per_step:
        print(f"{indent}verified draft nodes per row and step (adaptive planner): {stats.nodes_per_step:.2f}")
    if stats.time_draft + stats.time_verify + stats.time_accept > 0:  # generate(timing=True)
        print(f"{indent}time: prefill {stats.time_prefill:.2f} s, draft {stats.time_draft:.2f} s, "
              f"verify {stats.time_verify:.2f} s, accept {stats.time_accept:.2f} s")
    else:
        print(f"{indent}time: prefill {stats.time_prefill:.2f} s, steps {stats.time_total - stats.time_prefill:.2f} s")
    if getattr(stats, "time_compile", 0.0) > 0:
        print(f"{indent}compiling the verify forward (torch.compile, inside the time above): {stats.time_compile:.1f} s")


COMPILE_CHOICES = {"auto": "auto", "off": False, "on": True, "reduce-overhead": "reduce-overhead"}  # --compile -> compile=


# ----------------------------------------------------------------------------- demo


def _demo_prompt(args):
    """(label, text, chat) of the demo's prompt: --prompt-file, else a code-edit request."""
    from .workloads import code_edit_prompts

    if args.prompt_file:
        return f"{args.prompt_file} (as a chat request)", _read_prompt_file(args.prompt_file), True
    requests = code_edit_prompts(limit=args.prompt_index + 1)
    if args.prompt_index >= len(requests):
        raise _fail(f"--prompt-index {args.prompt_index}: only {len(requests)} code-edit prompt(s) available")
    request = requests[args.prompt_index]
    source = "shared HumanEval prompts" if not request.id.startswith("builtin/") else "built-in snippet (shared/ not found)"
    return f"code edit {request.id}, {source}", request.text, True


def describe_drafter(drafter) -> str:
    """A drafter in a few words for the CLI's output: its class, or its parts' for a merged one."""
    if drafter is None:
        return "no drafts"
    parts = getattr(drafter, "drafters", None)
    return " + ".join(describe_drafter(d) for d in parts) if parts else type(drafter).__name__


def cmd_demo(args) -> int:
    """Plain HF greedy decoding vs specdec (default_drafter, or n-gram drafts) on one code-edit prompt."""
    sk = _generate_api()
    model, tokenizer = _load(args.model)
    label, text, chat = _demo_prompt(args)
    input_ids = _encode(tokenizer, text, chat)
    eos, pad = stop_ids(model, tokenizer)
    n = args.max_new_tokens
    print(f"prompt: {label}, {input_ids.shape[1]} tokens; greedy, up to {n} new tokens; "
          f"CPU threads: {torch.get_num_threads()}", flush=True)
    first_line = text.strip().splitlines()[0] if text.strip() else ""
    print(f"  user: {first_line[:100]}{' ...' if len(text.strip()) > len(first_line) else ''}\n", flush=True)
    drafter = make_drafter(args.method, num_tokens=args.num_tokens if args.method == "ngram" else None, target=model)
    name = f"{args.method} ({describe_drafter(drafter)})"

    # Warm up both paths (first calls allocate and fill caches) so neither pays it in the timing.
    _hf_generate(model, input_ids, 2, eos, pad)
    if args.hf_prompt_lookup:
        _hf_generate(model, input_ids, 2, eos, pad, prompt_lookup_num_tokens=args.hf_prompt_lookup)
    sk.generate(model, input_ids, drafter=drafter, max_new_tokens=2, eos_token_id=eos)

    rows = []
    print("[1] HF generate(do_sample=False) ...", flush=True)
    hf_out, hf_s = _hf_generate(model, input_ids, n, eos, pad, progress_desc="HF generate")
    hf_new = hf_out.shape[1] - input_ids.shape[1]
    rows.append(("HF generate (greedy)", hf_new, hf_s, hf_new, 1.0))
    if args.hf_prompt_lookup:
        print(f"[1b] HF generate(prompt_lookup_num_tokens={args.hf_prompt_lookup}) ...", flush=True)
        pl_out, pl_s = _hf_generate(model, input_ids, n, eos, pad, progress_desc="HF prompt lookup",
                                    prompt_lookup_num_tokens=args.hf_prompt_lookup)
        pl_new = pl_out.shape[1] - input_ids.shape[1]
        rows.append((f"HF prompt lookup (k={args.hf_prompt_lookup})", pl_new, pl_s, None, None))
    print(f"[2] specdec_kernels.loop.generate with drafter {name} ...", flush=True)
    progress = _ProgressStreamer(n, f"specdec {args.method}") if _streamer_kwargs(sk.generate, None) else None
    if progress is None:
        print("    (no progress bar: specdec_kernels.loop.generate has no streaming hook)", flush=True)
    start = time.perf_counter()
    ours = sk.generate(model, input_ids, drafter=drafter, max_new_tokens=n, eos_token_id=eos,
                       **_streamer_kwargs(sk.generate, progress))
    ours_s = time.perf_counter() - start
    if progress is not None:
        progress.end()
    ours_seq = ours.sequences[0]
    ours_new = ours_seq.numel() - input_ids.shape[1]
    ours_label = f"specdec + n-gram (k={args.num_tokens})" if args.method == "ngram" else "specdec + default_drafter"
    rows.append((ours_label, ours_new, ours_s, ours.stats.steps, ours.stats.tokens_per_step))

    print("\n--- generated text (specdec) " + "-" * 40)
    new_ids = ours_seq[input_ids.shape[1]:]
    print(tokenizer.decode(new_ids, skip_special_tokens=True) + cut_mark(new_ids, n, eos))
    print("-" * 69)
    hf_rate = hf_new / hf_s
    print(f"{'method':<30} {'tokens':>6} {'time s':>7} {'tok/s':>7} {'steps':>6} {'tok/step':>8} {'speedup':>8}")
    for name, tokens, seconds, steps, per_step in rows:
        rate = tokens / seconds
        steps_s = f"{steps:>6}" if steps is not None else f"{'-':>6}"
        per_step_s = f"{per_step:>8.2f}" if per_step is not None else f"{'-':>8}"
        print(f"{name:<30} {tokens:>6} {seconds:>7.2f} {rate:>7.1f} {steps_s} {per_step_s} {rate / hf_rate:>7.2f}x")
    _print_stats(ours.stats, ours_s, ours_new, indent="specdec ")
    if args.hf_prompt_lookup:
        same = first_difference(pl_out[0], hf_out[0]) is None
        print(f"HF prompt lookup output identical to HF generate: {'yes' if same else 'no'}")
    where = first_difference(ours_seq, hf_out[0])
    if where is None:
        print(f"Output identical to HF generate: YES ({ours_new} tokens, token for token)")
        return 0
    print(f"Output identical to HF generate: NO -- first difference at position {where} "
          f"(prompt has {input_ids.shape[1]} tokens); this is a bug, please report it")
    return 1


# ------------------------------------------------------------------------- generate


def _parse_widths(text: str) -> tuple:
    try:
        widths = tuple(int(w) for w in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 2,2,1, got {text!r}") from None
    if not widths or min(widths) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return widths


def cmd_generate(args) -> int:
    """One generation with the chosen drafter; streams text if the loop supports it, then stats."""
    sk = _generate_api()
    needs_draft = args.method in NEEDS_DRAFT_MODEL
    if needs_draft and not args.draft_model:
        raise _fail(f"--method {args.method} needs --draft-model (a local HF model directory, a cached hub name, "
                    "or 'default' for the default model)")
    if args.prompt is None and args.prompt_file is None:
        raise _fail("give the prompt with --prompt TEXT or --prompt-file FILE ('-' for standard input)")
    if args.head is not None and args.method not in ("default", "mtp"):
        raise _fail(f"--head: only --method default and --method mtp use a head, not {args.method}")
    text = args.prompt if args.prompt is not None else _read_prompt_file(args.prompt_file)
    model, tokenizer = _load(args.model, "target", args.dtype)
    draft_model = None
    if needs_draft:
        draft_model, draft_tokenizer = _load(None if args.draft_model == "default" else args.draft_model, "draft",
                                             args.dtype)
        if draft_tokenizer.get_vocab() != tokenizer.get_vocab():
            raise _fail("the draft model's tokenizer differs from the target's; drafts must use the same vocabulary")
    try:
        drafter = make_drafter(args.method, draft_model=draft_model, num_tokens=args.num_tokens,
                               ngram_tree_width=args.ngram_tree_width, draft_tree_widths=args.draft_tree_widths,
                               target=model, head=args.head)
    except ValueError as error:  # a head for another target, a folder without a head
        raise _fail(str(error)) from None
    if args.chat and getattr(tokenizer, "chat_template", None) is None:
        raise _fail("--chat: this model's tokenizer has no chat template")
    input_ids = _encode(tokenizer, text, args.chat)
    print(f"prompt: {input_ids.shape[1]} tokens; method {args.method} ({describe_drafter(drafter)}); "
          f"{'greedy' if args.temperature == 0 else f'temperature {args.temperature}'}\n", flush=True)

    n = args.num_return_sequences
    if n < 1:
        raise _fail(f"--num-return-sequences: expected >= 1, got {n}")
    if n > 1:
        return _generate_several(sk, args, model, tokenizer, drafter, input_ids, n)
    streamer = _TextStreamer(tokenizer)
    stream = _streamer_kwargs(sk.generate, streamer)
    if not stream:
        print("(specdec_kernels.loop.generate has no streaming hook: the text is printed when it is done)", flush=True)
    start = time.perf_counter()
    out = sk.generate(model, input_ids, drafter=drafter, max_new_tokens=args.max_new_tokens,
                      temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                      kv_page_size=args.kv_page_size, compile=COMPILE_CHOICES[args.compile], **stream)
    seconds = time.perf_counter() - start
    new = out.sequences[0, input_ids.shape[1]:]
    if not stream:  # the loop has no streaming hook: print the text once it is done
        print(tokenizer.decode(new, skip_special_tokens=True), flush=True)
    mark = cut_mark(new, args.max_new_tokens, stop_ids(model, tokenizer)[0])
    if mark:
        print(mark.strip(), flush=True)
    print()
    _print_stats(out.stats, seconds, int(out.stats.new_tokens[0]) if out.stats.new_tokens else new.numel())
    return 0


def _generate_several(sk, args, model, tokenizer, drafter, input_ids, n: int) -> int:
    """--num-return-sequences n > 1: one call, n rows of the prompt (drafting from each other
    with the suffix cache), each printed when all are done, then the stats."""
    start = time.perf_counter()
    out = sk.generate(model, input_ids, drafter=drafter, max_new_tokens=args.max_new_tokens,
                      temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                      kv_page_size=args.kv_page_size, num_return_sequences=n, compile=COMPILE_CHOICES[args.compile])
    seconds = time.perf_counter() - start
    eos = stop_ids(model, tokenizer)[0]
    for i in range(n):
        new = out.sequences[i, input_ids.shape[1]:][: out.stats.new_tokens[i]]
        print(f"--- sequence {i + 1} of {n} ---", flush=True)
        print(tokenizer.decode(new, skip_special_tokens=True) + cut_mark(new, args.max_new_tokens, eos), flush=True)
    print()
    _print_stats(out.stats, seconds, sum(out.stats.new_tokens))
    return 0


# ----------------------------------------------------------------------------- info


def _version(dist: str) -> str:
    """Installed version of a distribution, without importing it ('not installed' if absent)."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def cmd_info(args) -> int:
    """Versions, whether `_C` loaded, backends per op and device, the default model's state."""
    import specdec_kernels
    from specdec_kernels.ops import _extension
    from . import models

    print(f"specdec_kernels {specdec_kernels.__version__} ({os.path.dirname(specdec_kernels.__file__)})")
    print(f"python {platform.python_version()}, torch {torch.__version__}, triton {_version('triton')}, "
          f"transformers {_version('transformers')}, gguf {_version('gguf')}")
    c = "loaded" if specdec_kernels.LOAD_ERROR is None else f"NOT loaded: {specdec_kernels.LOAD_ERROR}"
    print(f"compiled extension specdec_kernels._C: {c}")
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    print(f"device: CPU {cpu_name()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            print(f"device: cuda:{i} {torch.cuda.get_device_name(i)} (CUDA {torch.version.cuda})")
    else:
        print(f"device: no CUDA GPU (torch built {'with CUDA ' + torch.version.cuda if torch.version.cuda else 'for CPU only'})")
    print("backends per op (best first):")
    for op in _extension.OPS:
        per_device = "   ".join(f"{d}: {', '.join(specdec_kernels.available_backends(op, d))}" for d in devices)
        print(f"  {op:<20} {per_device}")
    try:
        gguf = models.default_gguf_path()
        cached = models.cache_dir() / models.DEFAULT_MODEL
        state = f"cached at {cached}" if models._default_cache_is_valid(cached, gguf) else \
            f"not converted yet (first load converts it to {cached})"
        print(f"default model: {models.DEFAULT_MODEL} from {gguf.name}, {state}")
    except ModuleNotFoundError as error:
        print(f"default model: unavailable: {error}")
    return 0


# ----------------------------------------------------------------------------- bench


def cmd_bench_kernels(args) -> int:
    """The per-op kernel benchmarks (specdec_kernels.benchmarks.kernels)."""
    from .benchmarks import kernels

    return kernels.run(args)


def cmd_bench_e2e(args) -> int:
    """The end-to-end benchmark (specdec_kernels.benchmarks.e2e)."""
    from .benchmarks import e2e

    return e2e.run_args(args)


def cmd_bench_online(args) -> int:
    """Online draft adaptation against the frozen head (specdec_kernels.benchmarks.online)."""
    from .benchmarks import online

    return online.run_args(args)


def cmd_bench_linear(args) -> int:
    """The target's forward with few-row linears by our kernel and by F.linear (specdec_kernels.benchmarks.linear)."""
    from .benchmarks import linear

    return linear.run_args(args)


def cmd_bench_vllm(args) -> int:
    """vLLM plain / vLLM n-gram / vLLM with our proposer / our generate (specdec_kernels.benchmarks.vllm)."""
    from .benchmarks import vllm

    return vllm.run_args(args)


def cmd_bench_all(args) -> int:
    """Kernels, then end to end, same --full / --out-dir: every table and plot of the README."""
    from .benchmarks import e2e, kernels

    start = time.perf_counter()
    status = kernels.run(argparse.Namespace(full=args.full, smoke=False, out_dir=args.out_dir, only=None))
    print(flush=True)
    status = e2e.run_args(args) or status
    print(f"specdec bench all: {time.perf_counter() - start:.0f} s", flush=True)
    return status


def _add_bench_parser(sub) -> None:
    from .benchmarks import e2e, kernels, linear, online

    bench = sub.add_parser("bench", help="benchmark suite: kernels, e2e, online, linear, or all (results in bench/results)",
                           description="Benchmarks with peers measured in the same run; JSON, Markdown and PNG "
                                       "results under bench/results (or --out-dir).")
    kinds = bench.add_subparsers(dest="bench", metavar="{kernels,e2e,online,linear,vllm,all}")
    kinds.required = True
    k = kinds.add_parser("kernels", help="per-op benchmarks (n-gram drafting; verify and tree attention on a GPU)",
                         description=kernels.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    kernels.add_arguments(k)
    k.set_defaults(func=cmd_bench_kernels)
    e = kinds.add_parser("e2e", help="end-to-end decoding vs HF generate on the four workloads",
                         description=e2e.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    e2e.add_arguments(e)
    e.set_defaults(func=cmd_bench_e2e)
    o = kinds.add_parser("online", help="online draft-head adaptation vs the frozen head on a prompt stream",
                         description=online.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    online.add_arguments(o)
    o.set_defaults(func=cmd_bench_online)
    li = kinds.add_parser("linear", help="the target's forward with few-row linears by our kernel and by F.linear (CPU)",
                          description=linear.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    linear.add_arguments(li)
    li.set_defaults(func=cmd_bench_linear)
    from .benchmarks import vllm as vllm_bench

    v = kinds.add_parser("vllm", help="vLLM (its CPU build, in the venv of tools/vllm_env.sh): plain, its n-gram, "
                                      "our proposer; and our generate", description=vllm_bench.__doc__,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    vllm_bench.add_arguments(v)
    v.set_defaults(func=cmd_bench_vllm)
    a = kinds.add_parser("all", help="kernels then e2e (the e2e options apply to the e2e part)")
    e2e.add_arguments(a)
    a.set_defaults(func=cmd_bench_all)


# ----------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    """The `specdec` argument parser (subcommands demo, generate, info, bench)."""
    parser = argparse.ArgumentParser(prog="specdec", description="Lossless speculative decoding: demo, generate, info, "
                                                                 "bench.")
    sub = parser.add_subparsers(dest="command", metavar="{demo,generate,info,bench,train-draft}")
    sub.required = True

    demo = sub.add_parser("demo", help="HF greedy decoding vs ours: speed and identical output",
                          description="Runs HF generate(do_sample=False) and specdec_kernels.loop.generate with "
                                      "default_drafter (the model's trained draft head merged with n-gram drafts; "
                                      "n-gram alone for a model without a head) or n-gram drafts (--method ngram) on "
                                      "a code-edit prompt and checks that the outputs are identical.")
    demo.add_argument("--model", default=None, help="HF model directory or cached hub name (default: SmolLM2-135M-Instruct)")
    demo.add_argument("--max-new-tokens", type=int, default=DEMO_MAX_NEW_TOKENS, help=f"default {DEMO_MAX_NEW_TOKENS}")
    demo.add_argument("--prompt-file", default=None, help="file with the user request (chat template applied); "
                                                          "default: a code-edit request")
    demo.add_argument("--prompt-index", type=int, default=0, help="which shared code-edit prompt (default 0)")
    demo.add_argument("--method", choices=DEMO_METHODS, default="default",
                      help="our drafter: default (default_drafter, the default) or ngram (n-gram drafts alone)")
    demo.add_argument("--num-tokens", type=int, default=10,
                      help="--method ngram: draft length (default 10, the k HF prompt lookup is compared at)")
    demo.add_argument("--hf-prompt-lookup", type=int, nargs="?", const=10, default=0, metavar="K",
                      help="also time HF's own prompt lookup decoding (prompt_lookup_num_tokens=K, default 10)")
    demo.set_defaults(func=cmd_demo)

    gen = sub.add_parser("generate", help="generate from a prompt with a chosen drafter, print stats")
    gen.add_argument("--model", default=None, help="target: HF model directory or cached hub name (default: SmolLM2-135M-Instruct)")
    gen.add_argument("--draft-model", default=None, help="draft model for draft/draft-tree/merged ('default': the default model)")
    gen.add_argument("--method", choices=METHODS, default="default",
                     help="drafter (default: default, the model's trained draft head merged with n-gram drafts, "
                          "or n-gram drafts alone for a model without a head)")
    gen.add_argument("--head", default=None, metavar="DIR",
                     help="--method default or mtp: this trained head (specdec train-draft --out DIR; --kind mtp for "
                          "--method mtp) instead of the model's own")
    gen.add_argument("--num-tokens", type=int, default=None,
                     help="draft length of n-gram drafts and draft-model chains (default: the drafter's)")
    gen.add_argument("--ngram-tree-width", type=int, default=NGRAM_TREE_WIDTH,
                     help=f"n-gram tree: continuations (ngram-tree, merged; default {NGRAM_TREE_WIDTH})")
    gen.add_argument("--draft-tree-widths", type=_parse_widths, default=DRAFT_TREE_WIDTHS,
                     help="draft-model tree: children per depth (draft-tree, merged; default "
                          f"{','.join(map(str, DRAFT_TREE_WIDTHS))})")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--num-return-sequences", type=int, default=1, metavar="N",
                     help="N samples of the prompt in one batch (best-of-N; use --temperature > 0): the rows "
                          "draft from each other through the suffix cache (default 1)")
    gen.add_argument("--kv-page-size", type=int, default=None, metavar="N",
                     help="paged KV cache with N slots per page (default: dense)")
    gen.add_argument("--compile", choices=list(COMPILE_CHOICES), default="auto",
                     help="the target's verify forward through torch.compile: on, off, auto (default: eager, the "
                          "measured choice), reduce-overhead (CUDA graphs, CUDA only: "
                          "7.7x eager's step on an H200 for the default model, ~28 s per graph to compile); the "
                          "first steps compile (minutes for a large model on a CPU)")
    gen.add_argument("--dtype", choices=("float32", "bfloat16", "auto"), default="float32",
                     help="weights of the target (and draft model): float32 (default: greedy output equal to HF's "
                          "fp32 generate), bfloat16, or auto (bfloat16 on a CPU with bf16 arithmetic, AVX512-BF16 "
                          "or AMX; float32 elsewhere)")
    source = gen.add_mutually_exclusive_group()
    source.add_argument("--prompt", default=None, help="prompt text")
    source.add_argument("--prompt-file", default=None, help="file with the prompt ('-': standard input)")
    gen.add_argument("--chat", action="store_true", help="send the prompt as a user turn through the chat template")
    gen.set_defaults(func=cmd_generate)

    info = sub.add_parser("info", help="versions, compiled extension, backends per op, device")
    info.set_defaults(func=cmd_info)
    _add_bench_parser(sub)
    from .heads import cli as heads_cli

    heads_cli.add_parser(sub)
    return parser


def main(argv=None) -> int:
    """Entry point of the `specdec` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    max_new_tokens = getattr(args, "max_new_tokens", None)
    if max_new_tokens is not None and max_new_tokens < 1:
        raise _fail("--max-new-tokens must be >= 1")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
