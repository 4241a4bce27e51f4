"""`specdec bench vllm`: vLLM plain, vLLM's own n-gram speculation and vLLM with our proposer
(`specdec_kernels.integrations.vllm.SpecdecProposer`), beside our own `generate`, on the dev
workloads at batch 1 and with several concurrent requests.

vLLM lives in its own virtual environment (`tools/vllm_env.sh`; found at $SPECDEC_VLLM_VENV,
default ~/.cache/specdec_kernels/vllm-venv). This module runs in the main environment: it builds
the prompts (token ids, with our tokenizer), times our `generate` in-process, and keeps one
persistent worker process per vLLM method in the venv (`python -m specdec_kernels.benchmarks.vllm
--serve job.json`: one engine, built once, runs sent over stdin), so each (workload, concurrency)
row runs every method back to back, the order rotated per repeat. The engine runs inside the
worker's process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so our proposer's counters can be read.
Only the worker half imports vLLM.

Throughput: generated tokens / wall seconds of the `LLM.generate` calls (`concurrency` requests
submitted together; at concurrency 1 the prompts one after another). Latency: per request,
seconds from entering vLLM's queue to its last token (vLLM's RequestStateStats). Greedy
identity: every vLLM method's tokens are compared with vLLM plain's (a difference is marked in
the row and makes the command exit 1); our generate runs transformers' kernels, so its agreement
with vLLM is reported but not required.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

DEFAULT_VENV = "~/.cache/specdec_kernels/vllm-venv"
PROPOSER = "specdec_kernels.integrations.vllm.SpecdecProposer"
WORKER_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
              "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false"}


def venv_python() -> Optional[Path]:
    """The vLLM venv's python ($SPECDEC_VLLM_VENV or the default), None when absent."""
    venv = Path(os.path.expanduser(os.environ.get("SPECDEC_VLLM_VENV", DEFAULT_VENV)))
    python = venv / "bin" / "python"
    return python if python.is_file() else None


def method_config(method: str, k: Optional[int] = None) -> Optional[dict]:
    """vLLM's speculative_config for a method name: "plain", "ngram" (vLLM's own), "ours"."""
    if method == "plain":
        return None
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": int(k or 5), "prompt_lookup_max": 4,
                "prompt_lookup_min": 1}
    if method == "ours":
        return {"method": "custom_class", "model": PROPOSER, "num_speculative_tokens": int(k or 10)}
    raise ValueError(f"method: expected plain, ngram or ours, got {method!r}")


# ----------------------------------------------------------------------------- driver (main environment)

VLLM_METHODS = ("vllm_plain", "vllm_ngram5", "vllm_ngram10", "vllm_ours")
METHODS = ("generate",) + VLLM_METHODS  # generate: our own loop (n-gram drafter, adaptive), in this process


def vllm_method(method: str, default_k: int):
    """(kind, k) of a vLLM method name: vllm_plain (k None), vllm_ngram<K> (vLLM's own n-gram,
    K drafts), vllm_ours or vllm_ours<K> (our proposer, K drafts at most; default_k without
    K); None for a name that is none of these."""
    match = re.fullmatch(r"vllm_(plain|ngram(\d+)|ours(\d*))", method)
    if match is None:
        return None
    if match.group(1) == "plain":
        return "plain", None
    k = int(match.group(2) or match.group(3) or default_k)
    return ("ngram" if match.group(2) else "ours", k) if k >= 1 else None


SHORT = dict(prompts=2, max_new_tokens=64, concurrency=(1, 8, 32))
SMOKE = dict(prompts=1, max_new_tokens=16, concurrency=(1, 2), workloads=("code_edit",))


def _csv(kind):
    return lambda text: tuple(kind(x) for x in text.split(",") if x.strip())


def add_arguments(parser):
    """The `specdec bench vllm` options."""
    from ..workloads import WORKLOADS

    parser.add_argument("--workloads", type=_csv(str), default=WORKLOADS, help="comma-separated (default all four)")
    parser.add_argument("--prompts", type=int, default=SHORT["prompts"],
                        help=f"distinct prompts per workload at concurrency 1 (default {SHORT['prompts']}); at "
                             "concurrency c, c distinct prompts (fewer where the workload has fewer: chat has 9)")
    parser.add_argument("--concurrency", type=_csv(int), default=SHORT["concurrency"],
                        help="requests in flight, comma-separated (default 1,8,32)")
    parser.add_argument("--max-new-tokens", type=int, default=SHORT["max_new_tokens"])
    parser.add_argument("--methods", type=_csv(str), default=METHODS,
                        help=f"comma-separated (default {','.join(METHODS)}); vllm_ngram<K> and vllm_ours<K> "
                             "set K, the drafts per step")
    parser.add_argument("--k", type=int, default=10, help="vllm_ours and generate: drafts per step at most (default 10)")
    parser.add_argument("--specdec", type=json.loads, default=None, metavar="JSON",
                        help='vllm_ours: our proposer\'s settings (additional_config["specdec"]), e.g. \'{"max_n": 8}\'')
    parser.add_argument("--generate-max-concurrency", type=int, default=8,
                        help="our generate runs batches up to this size (default 8; larger rows are skipped)")
    parser.add_argument("--threads", type=int, default=1,
                        help="threads of every method: OMP_NUM_THREADS and NUMBA_NUM_THREADS of the vLLM workers "
                             "(vLLM's CPU ops are OpenMP regions; it drops torch to 1 thread, but its n-gram proposer's "
                             "numba pool raises OpenMP's count again) and torch.set_num_threads for our generate "
                             "(default 1: on a shared VM, OpenMP barriers over busy cores cost vLLM ms per op)")
    parser.add_argument("--repeats", type=int, default=1, help="timed passes per row, median reported (default 1)")
    parser.add_argument("--smoke", action="store_true", help="code_edit, 1 prompt, 16 tokens, concurrency 1,2")
    parser.add_argument("--out-dir", default=None, help="results folder (default bench/results of the checkout)")
    parser.add_argument("--name", default="vllm_cpu", help="file stem of the JSON and PNG (default vllm_cpu)")
    return parser


def _plan(args, tokenizer):
    """{(workload, concurrency): [prompt token ids]}, prompts distinct (load_workload dedups)."""
    from ..workloads import load_workload

    plan = {}
    for workload in args.workloads:
        most = max(max(args.concurrency), args.prompts)
        requests = load_workload(workload, limit=most)
        ids = [r.input_ids(tokenizer)[0].tolist() for r in requests]
        for c in args.concurrency:
            plan[(workload, c)] = ids[: args.prompts] if c == 1 else ids[:c]
    return plan


def _kv_bytes_per_token(model_dir: str) -> int:
    """fp32 K and V of one token over all layers, from the checkpoint's config.json."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return int(config["num_hidden_layers"]) * 2 * int(heads) * int(head_dim) * 4


def _vllm_job(method, model_dir, plan, args):
    """The engine of one vLLM method: rows for the largest concurrency, KV for the largest
    group of requests in flight (+25%), context for the longest prompt."""
    kind, k = vllm_method(method, args.k)
    most = max(args.concurrency)
    longest = max(len(p) for prompts in plan.values() for p in prompts)
    per_token = _kv_bytes_per_token(model_dir)
    drafts = max(k or 0, args.k)
    in_flight = max(sum(len(p) + args.max_new_tokens + drafts + 16 for p in prompts[i: i + c])
                    for (_, c), prompts in plan.items() for i in range(0, len(prompts), c))
    engine = {"max_num_seqs": max(most, 1), "max_model_len": longest + args.max_new_tokens + drafts + 16,
              "kv_cache_bytes": max(int(in_flight * per_token * 1.25), 256 << 20)}
    return {"model": model_dir, "method": kind, "k": k, "engine": engine,
            "warmup_prompt": next(iter(plan.values()))[0], "specdec": args.specdec if kind == "ours" else None}


def _time_generate(model, tokenizer, prompts, concurrency, args):
    """Our loop (n-gram drafter, adaptive) over `prompts` in batches of `concurrency`:
    (seconds, new tokens, per-request latencies, token lists, CPU seconds of this process)."""
    import torch

    from ..loop.drafters import NgramDrafter
    from ..loop.generate import generate
    from ..methods import stop_ids

    eos, pad = stop_ids(model, tokenizer)
    eos_ids = torch.tensor(eos if isinstance(eos, (list, tuple)) else [eos]) if eos is not None else None
    total, cpu, outs, latencies = 0.0, 0.0, [], []
    for begin in range(0, len(prompts), concurrency):
        group = prompts[begin: begin + concurrency]
        width = max(len(p) for p in group)
        ids = torch.full((len(group), width), pad if pad is not None else 0, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for b, p in enumerate(group):
            ids[b, width - len(p):] = torch.tensor(p)
            mask[b, width - len(p):] = 1
        start, cpu0 = time.perf_counter(), time.process_time()
        out = generate(model, ids, drafter=NgramDrafter(num_tokens=args.k), max_new_tokens=args.max_new_tokens,
                       eos_token_id=eos, attention_mask=mask, adaptive=True)
        seconds = time.perf_counter() - start
        total += seconds
        cpu += time.process_time() - cpu0
        for row in out.sequences[:, width:]:
            row = row.tolist()
            if eos_ids is not None:
                for j, t in enumerate(row):
                    if t in eos_ids.tolist():
                        row = row[: j + 1]
                        break
            outs.append(row)
            latencies.append(seconds)
    return total, sum(len(o) for o in outs), latencies, outs, cpu


def _row(method, workload, c, prompts, seconds, new_tokens, latencies, args, **extra):
    return {"config": {"workload": workload, "concurrency": c, "method": method, "prompts": len(prompts),
                       "max_new_tokens": args.max_new_tokens},
            "tokens_per_s": new_tokens / seconds if seconds > 0 else None, "seconds": seconds,
            "new_tokens": new_tokens, "latency_mean_s": statistics.mean(latencies) if latencies else None,
            "latency_max_s": max(latencies) if latencies else None, **extra}


def _agree(a, b) -> float:
    """Share of requests whose tokens are identical."""
    return sum(x == y for x, y in zip(a, b)) / max(len(a), 1)


def run_args(args) -> int:
    """Run the plan: each vLLM method in its own worker process (one engine), our generate here;
    print the table, write bench/results/<name>.json and .png. Returns 1 when a speculative vLLM
    method's greedy tokens differ from vLLM plain's."""
    from transformers import AutoTokenizer

    from . import common
    from ..models import default_model_dir, load_model

    if args.smoke:
        args.prompts, args.max_new_tokens, args.concurrency = SMOKE["prompts"], SMOKE["max_new_tokens"], SMOKE["concurrency"]
        args.workloads = SMOKE["workloads"]
    unknown = [m for m in args.methods if m != "generate" and vllm_method(m, args.k) is None]
    if unknown:
        raise SystemExit(f"--methods: unknown {unknown}; choose from generate, vllm_plain, vllm_ngram<K>, "
                         f"vllm_ours or vllm_ours<K> (K >= 1 drafts)")
    model_dir = str(default_model_dir())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    plan = _plan(args, tokenizer)
    python = venv_python()
    out_dir = Path(args.out_dir) if args.out_dir else common.results_dir()
    result = common.metadata("vllm", "cpu", "vllm-cpu", model="SmolLM2-135M-Instruct", dtype="float32",
                             vllm=_venv_version(python), settings={k: (list(v) if isinstance(v, tuple) else v)
                                                                   for k, v in vars(args).items() if k != "func"})
    path = out_dir / f"{args.name}.json"
    rows, tokens = [], {}
    planned = len(plan) * len(args.methods)
    vllm_methods = [m for m in args.methods if m != "generate"]
    if vllm_methods and python is None:
        print(f"{', '.join(vllm_methods)}: skipped, no vLLM venv (tools/vllm_env.sh)", flush=True)
        vllm_methods = []
    model = None
    import torch

    torch.set_num_threads(args.threads)
    if "generate" in args.methods:
        model, _ = load_model(model_dir)
        # untimed: the planner's cost model is measured on first use (then cached)
        first = next(iter(plan.values()))[:1]
        _time_generate(model, tokenizer, first, 1, argparse.Namespace(k=args.k, max_new_tokens=8))
    workers = {}
    try:
        for method in vllm_methods:  # all engines up first, so every row's methods run back to back
            workers[method] = Worker(_vllm_job(method, model_dir, plan, args), python=python, threads=args.threads)
            print(f"{method}: engine up in {workers[method].init_seconds:.1f} s", flush=True)
        methods = [m for m in args.methods if m in workers or (m == "generate" and model is not None)]
        for (workload, c), prompts in plan.items():
            passes = {m: [] for m in methods}
            for rep in range(args.repeats):
                order = methods[rep % len(methods):] + methods[: rep % len(methods)]  # rotate who goes first
                for method in order:
                    if method == "generate":
                        if c > args.generate_max_concurrency:
                            continue
                        seconds, new, lat, outs, cpu = _time_generate(model, tokenizer, prompts, c, args)
                        passes[method].append({"seconds": seconds, "new_tokens": new, "latencies": lat,
                                               "tokens": outs, "cpu_seconds": cpu})
                    else:
                        run = {"name": f"{workload}|{c}", "prompts": prompts, "max_tokens": args.max_new_tokens,
                               "concurrency": c}
                        passes[method].append(workers[method].request(run))
            for method, reps in passes.items():
                if not reps:
                    continue
                best = sorted(reps, key=lambda r: r["seconds"])[len(reps) // 2]  # the median pass
                extra = {"repeats": len(reps), "seconds_all": [r["seconds"] for r in reps],
                         "cpu_seconds": best.get("cpu_seconds"),
                         "tokens_per_cpu_s": best["new_tokens"] / best["cpu_seconds"] if best.get("cpu_seconds") else None,
                         "threads": args.threads}
                if method in workers:
                    extra["init_seconds"] = workers[method].init_seconds
                    sm = best.get("spec_metrics") or {}
                    extra["spec_metrics"] = sm
                    if sm.get("spec_decode_num_draft_tokens"):
                        extra["acceptance"] = sm.get("spec_decode_num_accepted_tokens", 0) / \
                            sm["spec_decode_num_draft_tokens"]
                    if best.get("proposer"):
                        prop = best["proposer"]
                        extra["proposer"] = prop
                        extra["proposer_share"] = prop["propose_seconds"] / best["seconds"] if best["seconds"] else None
                rows.append(_row(method, workload, c, prompts, best["seconds"], best["new_tokens"],
                                 best["latencies"], args, **extra))
                tokens[(method, workload, c)] = best["tokens"]
                print(f"{method:>13} {workload:>16} c={c:<3} {rows[-1]['tokens_per_s']:7.1f} tok/s", flush=True)
            common.write_rows(result, rows, path, planned=planned, complete=False)
        for method, worker in workers.items():
            result.setdefault("proposer_stats", {})[method] = worker.request("stats").get("proposer_stats")
    finally:
        for worker in workers.values():
            worker.close()
    dump = os.environ.get("SPECDEC_VLLM_DUMP_TOKENS")
    if dump:  # prompts and every method's tokens, for offline analysis (not part of the results)
        Path(dump).write_text(json.dumps({"plan": {f"{w}|{c}": p for (w, c), p in plan.items()},
                                          "tokens": {"|".join(map(str, k)): v for k, v in tokens.items()}}))
    failed = _compare(rows, tokens)
    _add_ratios(rows)
    _print(rows, args)
    result["fastest_vllm_settings"] = _fastest(rows)
    common.write_rows(result, rows, path, planned=planned, complete=True)
    _plot(rows, out_dir / f"{args.name}.png", args)
    _plot(rows, out_dir / f"{args.name}_cpu.png", args, "tokens_per_cpu_s", "tokens per CPU-second")
    return 1 if failed else 0


def _venv_version(python) -> Optional[str]:
    if python is None:
        return None
    try:
        return subprocess.run([str(python), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                              capture_output=True, text=True, timeout=60).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _compare(rows, tokens) -> bool:
    """Mark each row's greedy identity against vllm_plain (vLLM methods must match exactly; our
    generate runs HF's kernels, so its agreement is informative only). True if a vLLM method differs."""
    failed = False
    for row in rows:
        cfg = row["config"]
        ref = tokens.get(("vllm_plain", cfg["workload"], cfg["concurrency"]))
        mine = tokens.get((cfg["method"], cfg["workload"], cfg["concurrency"]))
        if ref is None or mine is None or cfg["method"] == "vllm_plain":
            continue
        row["identical_to_vllm_plain"] = mine == ref
        row["requests_identical_share"] = _agree(mine, ref)
        if cfg["method"].startswith("vllm_") and mine != ref:
            failed = True
    return failed


def _add_ratios(rows):
    plain = {(r["config"]["workload"], r["config"]["concurrency"]): r["tokens_per_s"] for r in rows
             if r["config"]["method"] == "vllm_plain"}
    best_ngram = {}
    for r in rows:
        key = (r["config"]["workload"], r["config"]["concurrency"])
        if r["config"]["method"].startswith("vllm_ngram") and r["tokens_per_s"]:
            best_ngram[key] = max(best_ngram.get(key, 0), r["tokens_per_s"])
    plain_cpu = {(r["config"]["workload"], r["config"]["concurrency"]): r.get("tokens_per_cpu_s") for r in rows
                 if r["config"]["method"] == "vllm_plain"}
    for r in rows:
        key = (r["config"]["workload"], r["config"]["concurrency"])
        if plain.get(key) and r["tokens_per_s"]:
            r["ratio_vs_vllm_plain"] = r["tokens_per_s"] / plain[key]
        if plain_cpu.get(key) and r.get("tokens_per_cpu_s"):
            r["cpu_ratio_vs_vllm_plain"] = r["tokens_per_cpu_s"] / plain_cpu[key]
        if best_ngram.get(key) and r["tokens_per_s"]:
            r["ratio_vs_best_vllm_ngram"] = r["tokens_per_s"] / best_ngram[key]


def _fastest(rows) -> dict:
    """Per (workload, concurrency): the fastest vLLM method measured."""
    best = {}
    for r in rows:
        cfg = r["config"]
        if not cfg["method"].startswith("vllm_") or not r["tokens_per_s"]:
            continue
        key = f"{cfg['workload']}|{cfg['concurrency']}"
        if key not in best or r["tokens_per_s"] > best[key]["tokens_per_s"]:
            best[key] = {"method": cfg["method"], "tokens_per_s": r["tokens_per_s"]}
    return best


def _print(rows, args):
    _print_metric(rows, args, "tokens_per_s", "ratio_vs_vllm_plain", "tokens/s (wall)")
    _print_metric(rows, args, "tokens_per_cpu_s", "cpu_ratio_vs_vllm_plain",
                  f"tokens per CPU-second of the method's process ({args.threads} thread(s) each)")


def _print_metric(rows, args, field, ratio, label):
    from . import common

    methods = [m for m in args.methods if any(r["config"]["method"] == m for r in rows)]
    keys = sorted({(r["config"]["workload"], r["config"]["concurrency"]) for r in rows},
                  key=lambda k: (list(args.workloads).index(k[0]) if k[0] in args.workloads else 99, k[1]))
    table = []
    for workload, c in keys:
        line = [workload, str(c)]
        for m in methods:
            row = next((r for r in rows if r["config"]["method"] == m and r["config"]["workload"] == workload
                        and r["config"]["concurrency"] == c), None)
            if row is None or not row.get(field):
                line.append("-")
                continue
            cell = f"{row[field]:.1f}"
            if row.get(ratio) and m != "vllm_plain":
                cell += f" ({row[ratio]:.2f}x)"
            if row.get("identical_to_vllm_plain") is False and m.startswith("vllm_"):
                cell += " DIFF"
            line.append(cell)
        table.append(line)
    print(f"{label}, greedy, {args.max_new_tokens} new tokens (ratio: vs vllm_plain in the same run)")
    common.print_table(["workload", "conc."] + methods, table)


def _plot(rows, path, args, field="tokens_per_s", ylabel="tokens/s (wall)"):
    from . import common

    panels = []
    for workload in args.workloads:
        series = {}
        for m in args.methods:
            pts = sorted((r["config"]["concurrency"], r.get(field)) for r in rows
                         if r["config"]["method"] == m and r["config"]["workload"] == workload)
            if pts:
                series[m] = dict(pts)
        xs = sorted({c for s in series.values() for c in s})
        if xs:
            panels.append((workload, xs, {m: [s.get(x) for x in xs] for m, s in series.items()}))
    if panels:
        common.plot_panels(path, panels, xlabel="concurrent requests", ylabel=ylabel,
                           title=f"vLLM CPU, SmolLM2-135M fp32, greedy, {args.max_new_tokens} new tokens")


def main(argv=None) -> int:
    """`specdec bench vllm`: parse argv, then `run_args`."""
    parser = add_arguments(argparse.ArgumentParser(prog="specdec bench vllm", description=__doc__,
                                                   formatter_class=argparse.RawDescriptionHelpFormatter))
    return run_args(parser.parse_args(argv))


# ----------------------------------------------------------------------------- worker (venv)


def _engine(job: dict):
    from vllm import LLM

    engine = job.get("engine", {})
    kwargs = dict(model=job["model"], dtype=engine.get("dtype", "float32"), enforce_eager=True,
                  max_model_len=int(engine.get("max_model_len", 4096)),
                  max_num_seqs=int(engine.get("max_num_seqs", 32)), seed=0,
                  kv_cache_memory_bytes=int(engine.get("kv_cache_bytes", 1 << 30)),
                  disable_log_stats=False, enable_prefix_caching=bool(engine.get("prefix_caching", False)),
                  speculative_config=method_config(job["method"], job.get("k")))
    if "max_num_batched_tokens" in engine:
        kwargs["max_num_batched_tokens"] = int(engine["max_num_batched_tokens"])
    if job.get("specdec"):
        kwargs["additional_config"] = {"specdec": job["specdec"]}
    return LLM(**kwargs)


def _spec_metrics(llm) -> dict:
    """vLLM's speculative-decoding counters (drafts, draft tokens, accepted tokens)."""
    out = {}
    try:
        for metric in llm.get_metrics():
            if metric.name.startswith("vllm:spec_decode") and hasattr(metric, "value"):
                out[metric.name.split(":", 1)[1]] = out.get(metric.name.split(":", 1)[1], 0) + metric.value
    except Exception as error:  # metrics are a report, never a failure
        out["error"] = repr(error)
    return out


def _proposer_stats() -> Optional[dict]:
    from specdec_kernels.integrations.vllm import proposers

    live = proposers()
    return live[0].stats() if live else None


def _latency(output, start: float, end: float) -> float:
    """Seconds from this request's entering vLLM's queue to its last token (vLLM's per-request
    RequestStateStats, engine-core monotonic clock), else the whole generate call's."""
    stats = getattr(output, "metrics", None)
    queued, last = getattr(stats, "queued_ts", 0.0) or 0.0, getattr(stats, "last_token_ts", 0.0) or 0.0
    if queued > 0 and last >= queued:
        return float(last - queued)
    return end - start


def _run_once(llm, run: dict) -> dict:
    """One timed pass of `run` (prompts as token ids, max_tokens (int or per prompt), concurrency:
    groups of that many requests submitted together): tokens, seconds, latencies, counters."""
    from vllm import SamplingParams

    prompts, concurrency = run["prompts"], int(run["concurrency"])
    limits = run["max_tokens"] if isinstance(run["max_tokens"], list) else [run["max_tokens"]] * len(prompts)
    # temperature (default 0: greedy) and seed: `specdec bench e2e`'s sampled rows (no top-k / top-p,
    # as its HF rows sample)
    temperature, seed = float(run.get("temperature", 0.0)), run.get("seed")
    params = [SamplingParams(temperature=temperature, max_tokens=int(m), ignore_eos=bool(run.get("ignore_eos")),
                             **({} if temperature == 0 else dict(top_k=0, top_p=1.0, seed=seed)))
              for m in limits]
    before, metrics_before = _proposer_stats(), _spec_metrics(llm)
    outs, latencies = [], []
    t0, cpu0 = time.perf_counter(), time.process_time()
    for begin in range(0, len(prompts), concurrency):
        group = [{"prompt_token_ids": p} for p in prompts[begin: begin + concurrency]]
        g0 = time.perf_counter()
        got = llm.generate(group, params[begin: begin + concurrency], use_tqdm=False)
        g1 = time.perf_counter()
        for o in got:
            outs.append(list(o.outputs[0].token_ids))
            latencies.append(_latency(o, g0, g1))
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - cpu0
    after, metrics_after = _proposer_stats(), _spec_metrics(llm)
    spec = {k: metrics_after.get(k, 0) - metrics_before.get(k, 0) for k in metrics_after
            if isinstance(metrics_after.get(k), (int, float))}
    proposer = None
    if after is not None:
        proposer = {k: (after[k] - (before or {}).get(k, 0)) for k in
                    ("steps", "decode_rows", "drafted", "verified", "accepted", "propose_seconds",
                     "step_seconds", "timed_steps") if isinstance(after.get(k), (int, float))}
        proposer["token_cost_ratio"] = after.get("token_cost_ratio")
    return {"name": run.get("name"), "concurrency": concurrency, "tokens": outs, "seconds": seconds,
            "cpu_seconds": cpu_seconds,
            "new_tokens": sum(len(o) for o in outs), "latencies": latencies, "spec_metrics": spec,
            "proposer": proposer}


def _start(job: dict):
    from vllm import SamplingParams

    start = time.perf_counter()
    llm = _engine(job)
    init = time.perf_counter() - start
    warm = SamplingParams(temperature=0.0, max_tokens=8)
    llm.generate([{"prompt_token_ids": job["warmup_prompt"]}], warm, use_tqdm=False)  # first-call costs
    return llm, init


def run_worker(job: dict) -> dict:
    """Run `job["runs"]` on one engine, each `repeats` times in a row. Returns per run the
    tokens of every request (first repeat) and per repeat the timings."""
    job = dict(job, warmup_prompt=job["runs"][0]["prompts"][0])
    llm, init = _start(job)
    result = {"method": job["method"], "k": job.get("k"), "init_seconds": init, "runs": []}
    for run in job["runs"]:
        repeats = [_run_once(llm, run) for _ in range(int(run.get("repeats", 1)))]
        tokens = repeats[0]["tokens"]
        for rep in repeats:
            if rep.pop("tokens") != tokens:
                rep["differs_from_first_repeat"] = True
        result["runs"].append({"name": run.get("name"), "concurrency": int(run["concurrency"]), "tokens": tokens,
                               "repeats": repeats})
    result["proposer_stats"] = _proposer_stats()
    return result


SENTINEL = "@@SPECDEC@@ "


def _serve_main(job_path: str) -> int:
    """Persistent worker: build the engine, then one run per line of stdin (JSON), each answered
    by a SENTINEL line of JSON on stdout; "quit" ends it. Lets the driver interleave methods."""
    job = json.loads(Path(job_path).read_text())
    llm, init = _start(job)
    print(SENTINEL + json.dumps({"ready": True, "init_seconds": init}), flush=True)
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        if line == "quit":
            break
        try:
            if line == "stats":
                answer = {"proposer_stats": _proposer_stats()}
            else:
                answer = _run_once(llm, json.loads(line))
        except Exception as error:  # reported to the driver, which fails the row
            answer = {"error": repr(error)}
        print(SENTINEL + json.dumps(answer), flush=True)
    return 0


SERVE_ARGV = ("-m", "specdec_kernels.benchmarks.vllm", "--serve")


class Worker:
    """A persistent worker process in a peer's venv (one engine, one method): by default a vLLM
    engine (`--serve` of this module); `argv` runs another program that speaks the same protocol
    (the job file's path appended; one JSON request per stdin line, each answered by a SENTINEL
    line on stdout), e.g. `specdec bench e2e`'s llama.cpp worker. `name` labels its errors."""

    def __init__(self, job: dict, *, python: Optional[Path] = None, threads: int = 1, argv=SERVE_ARGV,
                 name: str = "vLLM"):
        python = python or venv_python()
        if python is None:
            raise RuntimeError("no vLLM venv: run tools/vllm_env.sh (or set SPECDEC_VLLM_VENV)")
        self.name = name
        self.tmp = tempfile.TemporaryDirectory(prefix="specdec-worker-")
        job_path = Path(self.tmp.name) / "job.json"
        job_path.write_text(json.dumps(job))
        self.log_path = Path(self.tmp.name) / "worker.log"
        self._log = open(self.log_path, "w")
        env = dict(os.environ, **WORKER_ENV, OMP_NUM_THREADS=str(threads), NUMBA_NUM_THREADS=str(threads))
        env.pop("PYTHONPATH", None)
        self.proc = subprocess.Popen([str(python), *argv, str(job_path)],
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     text=True, cwd=self.tmp.name)
        self.ready = self._answer()
        self.init_seconds = self.ready.get("init_seconds")

    def _answer(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(SENTINEL):
                return json.loads(line[len(SENTINEL):])
        self._log.flush()
        tail = self.log_path.read_text()[-4000:]
        raise RuntimeError(f"{self.name} worker exited (status {self.proc.wait()}):\n{tail}")

    def request(self, message) -> dict:
        self.proc.stdin.write((message if isinstance(message, str) else json.dumps(message)) + "\n")
        self.proc.stdin.flush()
        answer = self._answer()
        if "error" in answer:
            raise RuntimeError(f"{self.name} worker: {answer['error']}")
        return answer

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired, BrokenPipeError):
            self.proc.kill()
        self._log.close()
        self.tmp.cleanup()


def call_worker(job: dict, *, timeout: float = 3600, python: Optional[Path] = None, threads: int = 1) -> dict:
    """Run `job` in the vLLM venv (RuntimeError with the worker's output tail when it fails)."""
    python = python or venv_python()
    if python is None:
        raise RuntimeError("no vLLM venv: run tools/vllm_env.sh (or set SPECDEC_VLLM_VENV)")
    with tempfile.TemporaryDirectory(prefix="specdec-vllm-") as tmp:
        job_path, out_path = Path(tmp) / "job.json", Path(tmp) / "out.json"
        job_path.write_text(json.dumps(job))
        env = dict(os.environ, **WORKER_ENV, OMP_NUM_THREADS=str(threads), NUMBA_NUM_THREADS=str(threads))
        env.pop("PYTHONPATH", None)
        proc = subprocess.run([str(python), "-m", "specdec_kernels.benchmarks.vllm", "--worker", str(job_path),
                               str(out_path)], env=env, capture_output=True, text=True, timeout=timeout,
                              cwd=tmp)
        if proc.returncode != 0 or not out_path.is_file():
            tail = (proc.stdout + proc.stderr)[-4000:]
            raise RuntimeError(f"vLLM worker failed (exit {proc.returncode}):\n{tail}")
        return json.loads(out_path.read_text())


def _worker_main(job_path: str, out_path: str) -> int:
    job = json.loads(Path(job_path).read_text())
    result = run_worker(job)
    Path(out_path).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "--worker":
        sys.exit(_worker_main(sys.argv[2], sys.argv[3]))
    if len(sys.argv) >= 2 and sys.argv[1] == "--serve":
        sys.exit(_serve_main(sys.argv[2]))
    sys.exit(main())
