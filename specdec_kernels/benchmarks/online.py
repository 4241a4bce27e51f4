"""Online draft adaptation: a stream of prompts from one workload, online head against frozen.

    specdec bench online                              # summarisation and chat streams, default model
    specdec bench online --workloads chat --max-new-tokens 64

Each workload's stream is its first `--prompts` requests: the requests the shipped head held
out of its training (`heads/trained/*/README.md`: the first 10 of every workload), so the
head meets them for the first time. Two drafters serve the stream, both `default_drafter`
(the shipped EAGLE head merged with n-gram drafts, adaptive planner on), or with `--drafter
head` both the head alone: `frozen`
(online=False) and `online` (online=True, or `--online` settings), one object each for the
whole stream, so the online head keeps what it learned from one prompt to the next. Every
prompt runs under both, greedy, in alternating order (frozen first on even prompts), so
load on the shared machine hits both alike; each drafter keeps its own planner memory.

Per prompt: tokens per step, tokens/s (update time included: the updates run in the
decoding loop), the online head's update seconds and their share of its generation time,
its updates and rollbacks, and whether both outputs are identical (greedy: they must be).
The summary gives, per workload, the online / frozen ratios over the prompts after the first
`--warmup` (the goal: tokens per step >= 1.2x, tokens/s > 1x, update share <= 10%).
Writes bench/results/online_<device>.json and online_<device>.png (tokens per step over the
stream's generated tokens, a moving average, online against frozen).
"""

import argparse
import time
from pathlib import Path

import torch

from . import common

WORKLOADS = ("summarization", "chat")
DRAFTERS = ("default", "head")
HELD_OUT = 10  # the shipped head's training left out requests 0 .. 9 of every workload


def _csv(text):
    return tuple(x.strip() for x in text.split(",") if x.strip())


def _online_settings(text):
    """"key=value,..." -> dict (numbers parsed, true/false as bools)."""
    out = {}
    for part in _csv(text):
        key, sep, value = part.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"--online: expected key=value, got {part!r}")
        lowered = value.strip().lower()
        if lowered in ("true", "false"):
            out[key.strip()] = lowered == "true"
            continue
        for kind in (int, float):
            try:
                out[key.strip()] = kind(value)
                break
            except ValueError:
                continue
        else:
            out[key.strip()] = value.strip()
    return out


def add_arguments(parser):
    """The `specdec bench online` options."""
    parser.add_argument("--workloads", type=_csv, default=WORKLOADS,
                        help=f"comma-separated, each its own stream (default {','.join(WORKLOADS)})")
    parser.add_argument("--prompts", type=int, default=HELD_OUT,
                        help=f"stream length: the workload's first N requests (default {HELD_OUT}, the shipped head's "
                             "held-out requests; more would include its training prompts)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=3, help="prompts left out of the summary ratios (default 3)")
    parser.add_argument("--online", type=_online_settings, default={},
                        help="online settings, e.g. interval=8,lr=3e-4,loss=jsd (default: OnlineOptions' defaults)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: torch's; 1 is steadier on a shared, loaded machine)")
    parser.add_argument("--model", default=None, help="target (default SmolLM2-135M-Instruct; needs a trained head)")
    parser.add_argument("--drafter", choices=DRAFTERS, default="default",
                        help="default: default_drafter (the head merged with n-gram drafts); head: the head "
                             "alone (EagleDrafter / MedusaDrafter), so its own acceptance is what is measured")
    parser.add_argument("--head", default=None, metavar="DIR",
                        help="the head both arms start from (default: the target's shipped or saved head)")
    parser.add_argument("--out-dir", default=None, help="results folder (default bench/results of the checkout)")
    return parser


def main(argv=None) -> int:
    """`specdec bench online`: parse argv, then `run_args`."""
    parser = add_arguments(argparse.ArgumentParser(prog="specdec bench online", description=__doc__,
                                                   formatter_class=argparse.RawDescriptionHelpFormatter))
    return run_args(parser.parse_args(argv))


class _Arm:
    """One drafter serving the stream, with its own planner memory (the planner remembers
    acceptance per kind of drafter, and both arms are the same kind)."""

    def __init__(self, name, drafter):
        self.name, self.drafter, self.memory = name, drafter, {}

    def generate(self, target, ids, max_new_tokens):
        from ..loop import generate
        from ..loop import planner as planner_module

        saved = dict(planner_module._LEARNED)
        planner_module._LEARNED.clear()
        planner_module._LEARNED.update(self.memory)
        try:
            start = time.perf_counter()
            out = generate(target, ids, drafter=self.drafter, max_new_tokens=max_new_tokens)
            seconds = time.perf_counter() - start
            self.memory = dict(planner_module._LEARNED)
        finally:
            planner_module._LEARNED.clear()
            planner_module._LEARNED.update(saved)
        return out, seconds


def _result(out, seconds) -> dict:
    new = int(out.stats.new_tokens[0])
    return {"new_tokens": new, "steps": out.stats.steps, "tokens_per_step": round(out.stats.tokens_per_step, 4),
            "tokens_per_s": round(new / seconds, 3), "seconds": round(seconds, 3),
            "nodes_per_step": round(out.stats.nodes_per_step, 3),
            # tokens emitted per step, in order (the plot's curve)
            "step_tokens": [round(t["accepted_per_row"] + 1) for t in out.stats.trace]}


def make_drafter(target, kind: str, *, online=False, head=None):
    """The drafter an arm serves with: `default_drafter(target, online=, head=)` for kind
    "default"; for "head" the head alone (`heads.head_drafter`: the `EagleDrafter` or
    `MedusaDrafter` of `head`, or of the target's shipped or saved head), adaptive planner on
    in both."""
    from ..heads import default_drafter, head_drafter

    if kind == "default":
        return default_drafter(target, online=online, head=head)
    if kind != "head":
        raise ValueError(f"drafter: expected one of {DRAFTERS}, got {kind!r}")
    return head_drafter(target, head, online=online)


def run_stream(target, tokenizer, workload, requests, *, max_new_tokens, online_settings, head=None, drafter="default",
               log=print):
    """Serve `requests` with a frozen and an online drafter (`make_drafter`: `drafter`
    "default" or "head", with `head`, a head directory, instead of the target's own); one
    row per request."""
    frozen = _Arm("frozen", make_drafter(target, drafter, head=head))
    online = _Arm("online", make_drafter(target, drafter, online=online_settings or True, head=head))
    learner = online.drafter.online
    if learner is None:
        raise ValueError("model: no trained head for this target: nothing to adapt online")
    rows = []
    for i, request in enumerate(requests):
        ids = request.input_ids(tokenizer)
        before = learner.stats.as_dict()
        results = {}
        for arm in ([frozen, online] if i % 2 == 0 else [online, frozen]):
            results[arm.name] = arm.generate(target, ids, max_new_tokens)
        (f_out, f_s), (o_out, o_s) = results["frozen"], results["online"]
        after = learner.stats.as_dict()
        f_row, o_row = _result(f_out, f_s), _result(o_out, o_s)
        update_s = after["update_seconds"] - before["update_seconds"]
        head_steps = after["head_steps"] - before["head_steps"]
        o_row.update({"update_s": round(update_s, 3), "update_share": round(update_s / o_s, 4),
                      "updates": after["updates"] - before["updates"], "rollbacks": after["rollbacks"] - before["rollbacks"],
                      "head_accepted_per_drafting_step": round((after["head_accepted"] - before["head_accepted"]) /
                                                               max(head_steps, 1), 4),
                      "loss": round(after["last_loss"], 4)})
        row = {"config": {"workload": workload, "index": i, "request": request.id, "prompt_tokens": int(ids.shape[1]),
                          "max_new_tokens": max_new_tokens},
               "frozen": f_row, "online": o_row,
               "ratio_tokens_per_step": round(o_row["tokens_per_step"] / f_row["tokens_per_step"], 4),
               "ratio_tokens_per_s": round(o_row["tokens_per_s"] / f_row["tokens_per_s"], 4),
               "identical": bool(torch.equal(f_out.sequences, o_out.sequences))}
        rows.append(row)
        log(f"  {workload} [{i + 1}/{len(requests)}] {request.id}: tokens/step frozen {f_row['tokens_per_step']:.2f} "
            f"online {o_row['tokens_per_step']:.2f} ({row['ratio_tokens_per_step']:.2f}x), tokens/s "
            f"{f_row['tokens_per_s']:.1f} / {o_row['tokens_per_s']:.1f} ({row['ratio_tokens_per_s']:.2f}x), "
            f"updates {o_row['update_s']:.2f} s ({100 * o_row['update_share']:.1f}%), identical {row['identical']}")
    return rows, learner.stats.as_dict()


def summarize(rows, warmup: int) -> dict:
    """Per workload, over the prompts with index >= warmup: mean tokens per step and tokens/s
    of each arm and their ratio (ratio of sums: long prompts weigh more), the update share of
    the online arm's generation time, and whether every output was identical."""
    out = {}
    for workload in dict.fromkeys(r["config"]["workload"] for r in rows):
        later = [r for r in rows if r["config"]["workload"] == workload and r["config"]["index"] >= warmup]
        every = [r for r in rows if r["config"]["workload"] == workload]
        if not later:
            continue

        def total(arm, key):
            return sum(r[arm][key] for r in later)

        def rate(arm):
            return total(arm, "new_tokens") / max(total(arm, "steps"), 1), total(arm, "new_tokens") / total(arm, "seconds")

        f_tps, f_rate = rate("frozen")
        o_tps, o_rate = rate("online")
        out[workload] = {"prompts": len(later), "from_index": warmup,
                         "frozen_tokens_per_step": round(f_tps, 4), "online_tokens_per_step": round(o_tps, 4),
                         "ratio_tokens_per_step": round(o_tps / f_tps, 4),
                         "frozen_tokens_per_s": round(f_rate, 3), "online_tokens_per_s": round(o_rate, 3),
                         "ratio_tokens_per_s": round(o_rate / f_rate, 4),
                         "update_share": round(total("online", "update_s") / total("online", "seconds"), 4),
                         "update_share_all_prompts": round(sum(r["online"]["update_s"] for r in every) /
                                                           sum(r["online"]["seconds"] for r in every), 4),
                         "identical": all(r["identical"] for r in every)}
    return out


def plot(rows, path, window: int = 16):
    """Tokens per step over the stream's generated tokens (moving average over `window`
    steps), online against frozen, a panel per workload; dotted lines at prompt boundaries."""
    plt = common.pyplot()
    if plt is None:
        return None
    workloads = list(dict.fromkeys(r["config"]["workload"] for r in rows))
    fig, axes = plt.subplots(1, len(workloads), figsize=(6.0 * len(workloads), 3.8), squeeze=False)
    for ax, workload in zip(axes[0], workloads):
        stream = [r for r in rows if r["config"]["workload"] == workload]
        for arm, style in (("frozen", dict(color="tab:gray")), ("online", dict(color="tab:blue"))):
            steps = [t for r in stream for t in r[arm]["step_tokens"]]
            xs, ys, made, recent = [], [], 0, []
            for t in steps:
                made += t
                recent = (recent + [t])[-window:]
                xs.append(made)
                ys.append(sum(recent) / len(recent))
            ax.plot(xs, ys, label=arm, linewidth=1.2, **style)
        edge = 0
        for r in stream[:-1]:
            edge += r["frozen"]["new_tokens"]
            ax.axvline(edge, color="black", linestyle=":", linewidth=0.6)
        ax.set_title(f"{workload}: {len(stream)} held-out prompts")
        ax.set_xlabel("generated tokens (stream)")
        ax.set_ylabel(f"tokens per step ({window}-step mean)")
        ax.grid(alpha=0.3)
    axes[0][-1].legend()
    return common.save_figure(plt, fig, path)


def run_args(args) -> int:
    """Run the streams, print the table, write JSON and PNG; 1 if any output differed."""
    from ..models import load_model
    from ..workloads import load_workload

    if args.prompts < 1:
        raise ValueError(f"--prompts must be >= 1, got {args.prompts}")
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    if args.prompts > HELD_OUT:
        print(f"note: --prompts {args.prompts} > {HELD_OUT}: the stream includes requests the shipped head trained on")
    target, tokenizer = load_model(args.model, verbose=False)
    device = next(target.parameters()).device
    # Warm-up (not measured): loads the kernels and the planner's cost model for this target,
    # on a request after the held-out ones, with a frozen head.
    from ..heads import default_drafter

    warm = load_workload(args.workloads[0])[HELD_OUT:HELD_OUT + 1] or load_workload(args.workloads[0])[:1]
    from ..loop import generate

    generate(target, warm[0].input_ids(tokenizer), drafter=default_drafter(target), max_new_tokens=16)
    rows, learners = [], {}
    start = time.perf_counter()
    for workload in args.workloads:
        requests = load_workload(workload)[: args.prompts]
        print(f"{workload}: {len(requests)} prompts, {args.max_new_tokens} new tokens each", flush=True)
        stream_rows, learners[workload] = run_stream(target, tokenizer, workload, requests,
                                                     max_new_tokens=args.max_new_tokens, online_settings=args.online,
                                                     head=args.head, drafter=args.drafter)
        rows += stream_rows
    summary = summarize(rows, args.warmup)
    headers = ["workload", "prompt", "tok/step frozen", "tok/step online", "ratio", "tok/s frozen", "tok/s online",
               "ratio", "update share", "same"]
    table = [[r["config"]["workload"], str(r["config"]["index"]), r["frozen"]["tokens_per_step"],
              r["online"]["tokens_per_step"], f"{r['ratio_tokens_per_step']:.2f}x", r["frozen"]["tokens_per_s"],
              r["online"]["tokens_per_s"], f"{r['ratio_tokens_per_s']:.2f}x", f"{100 * r['online']['update_share']:.1f}%",
              "yes" if r["identical"] else "NO"] for r in rows]
    print()
    common.print_table(headers, table)
    print()
    for workload, s in summary.items():
        print(f"{workload}, prompts {s['from_index']}+: tokens/step {s['online_tokens_per_step']:.2f} vs "
              f"{s['frozen_tokens_per_step']:.2f} ({s['ratio_tokens_per_step']:.2f}x), tokens/s "
              f"{s['online_tokens_per_s']:.1f} vs {s['frozen_tokens_per_s']:.1f} ({s['ratio_tokens_per_s']:.2f}x), "
              f"update share {100 * s['update_share']:.1f}%, identical {s['identical']}")
    from ..heads.online import OnlineOptions

    options = OnlineOptions.coerce(args.online or True)
    out_dir = Path(args.out_dir) if args.out_dir else common.results_dir()
    result = common.metadata("online", device, "cpu" if device.type == "cpu" else "cuda",
                             model=getattr(target.config, "_name_or_path", None), head=args.head, drafter=args.drafter,
                             greedy=True,
                             max_new_tokens=args.max_new_tokens, warmup=args.warmup,
                             online_options=vars(options).copy(), learner_stats=learners,
                             load_average=_load_average(), wall_s=round(time.perf_counter() - start, 1))
    result.update({"summary": summary, "rows": rows})
    slug = common.device_slug(device)
    common.write_json(result, out_dir / f"online_{slug}.json")
    plot(rows, out_dir / f"online_{slug}.png")
    return 0 if all(r["identical"] for r in rows) else 1


def _load_average():
    try:
        import os

        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return None
