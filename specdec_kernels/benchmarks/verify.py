"""Verification (rejection sampling from logits) on the GPU: our kernels against peers in the same run.

    specdec bench kernels                     # runs this (short sweep) with the other kernel benchmarks
    python bench/bench_verify.py              # a short sweep (GPU; --quick says the same)
    python bench/bench_verify.py --full       # the whole sweep (GPU)
    python bench/bench_verify.py --smoke      # CPU: tiny config under the Triton interpreter,
                                              # only to show the code runs; nothing recorded

Sweep (--full): B in {1, 8, 64, 256}; trees: chains of k in {1, 4, 8} drafts and random trees
of 16 / 64 nodes; V in {32000, 128256, 151936}; bf16 logits; modes greedy (temperature 0),
sampled (temperature 1; chains with draft probabilities, trees with deterministic drafts) and
mixed (even rows greedy, odd rows sampled). Drafted tokens get a logit bump so that most are
accepted, as with a good drafter (the accepted path length is printed).

Methods:
  triton        verify(backend="triton"): one program per row walking the tree over the vocab
  cuda          verify(backend="cuda"), when the extension has a CUDA verify kernel
  torch_native  what HF / gpt-fast do (written here): softmax over every node's logits, then
                gather / compare / cumprod for the first rejection, the residual at the
                rejected node and torch.multinomial; chains only
  reference     verify(backend="reference") (torch ops, one tree depth per step): tree peer
  flashinfer    flashinfer.sampling.chain_speculative_sampling on softmax(logits) (the softmax
                counted), chains with draft probabilities, when flashinfer imports (else the
                JSON's peers_skipped says why)
Ours is checked against the reference before timing (greedy rows exactly, sampled rows on
the same Philox draws).

Floor: bytes actually needed / bandwidth measured in this run (a large device copy), with
bytes = the logits of the nodes on the accepted path (plus the node the last token is sampled
at) + the draft probabilities read at those nodes + the outputs. Times: median of CUDA-event
timed calls after warm-up (benchmarks.common.time_cuda), inputs rotated over copies and L2
(50 MB) flushed before each call, so that no call finds its inputs in L2; input value checks
off as in `generate` (each call's input checks sync with the host).
Writes bench/results/verify_<device>.json and .png (not in --smoke mode); the JSON is rewritten
after every config ("complete": false until the last), so a run stopped mid-sweep keeps its rows.
"""

import argparse
import os
import sys
from pathlib import Path

import torch

from . import common
from .. import config
from ..ops import _extension
from ..ops._extension import available_backends
from ..ops.verify import verify

BATCHES = (1, 8, 64, 256)
VOCABS = (32000, 128256, 151936)
TREES = (("chain", 1), ("chain", 4), ("chain", 8), ("tree", 16), ("tree", 64))
MODES = ("greedy", "sampled", "mixed")
ROTATE_BYTES = 256 * 1024**2  # rotate input copies until this much: several times L2
WARMUP = 3  # untimed calls before the timed ones (compilation, autotuning, allocator)


def parse_args(argv=None):
    """The command line: the `specdec bench kernels` runner's flags (--quick / --full / --smoke,
    --out, --out-dir) plus this benchmark's own (--reps, --no-peers)."""
    parser = argparse.ArgumentParser(prog="bench_verify", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="a short sweep (the default)")
    mode.add_argument("--full", action="store_true", help="the whole sweep")
    mode.add_argument("--goal", action="store_true",
                      help="the goal configurations alone (issue 37: B=64, V=128256, chain of 4 and a 64-node "
                           "tree, greedy and sampled)")
    mode.add_argument("--smoke", action="store_true",
                      help="CPU: tiny interpreted run of the table code, nothing recorded")
    parser.add_argument("--out", default=None, help="JSON path (default bench/results/verify_<device>.json; "
                                                    "the plot goes beside it)")
    parser.add_argument("--out-dir", default=None, help="results folder for verify_<device>.json when --out is not "
                                                        "given (default bench/results of the checkout)")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--no-peers", action="store_true")
    return parser.parse_args(argv)


# ----------------------------------------------------------------------------- inputs


def make_inputs(batch, kind, size, vocab, mode, device, gen):
    """(logits bf16 [B, T, V], tree_tokens [B, T], parents [B, T], draft_probs or None, temperature [B])."""
    if kind == "chain":
        num_nodes = size + 1
        parents = torch.arange(-1, size).expand(batch, -1).clone()
    else:
        num_nodes = size
        parents = torch.full((batch, num_nodes), -1, dtype=torch.int64)
        for i in range(1, num_nodes):  # random tree, siblings made distinct below
            parents[:, i] = torch.randint(0, i, (batch,), generator=gen)
    tokens = torch.randint(0, vocab, (batch, num_nodes), generator=gen)
    if kind == "tree":  # distinct siblings: token = parent-dependent offset + node index
        tokens = (tokens[:, :1] + torch.arange(num_nodes) * 7919) % vocab
    tokens, parents = tokens.to(device), parents.to(device)
    # The [B, T, V] tensors are drawn on the device, seeded from `gen` (up to 2.5e9 values: many
    # seconds of the CPU generator per config).
    dgen = common.device_generator(gen, device)
    logits = torch.randn(batch, num_nodes, vocab, generator=dgen, device=device).mul_(2.0)
    rows = torch.arange(batch, device=device)
    for i in range(1, num_nodes):
        logits[rows, parents[:, i], tokens[:, i]] += 12.0  # a likely draft (siblings compete)
    with_probs = mode != "greedy" and kind == "chain"
    draft_probs = None
    if with_probs:
        draft_probs = torch.softmax(torch.randn(batch, num_nodes, vocab, generator=dgen, device=device), -1) * 0.5
        for i in range(1, num_nodes):
            draft_probs[rows, parents[:, i], tokens[:, i]] += 0.5
    if mode == "greedy":
        temperature = torch.zeros(batch)
    elif mode == "sampled":
        temperature = torch.ones(batch)
    else:
        temperature = torch.where(torch.arange(batch) % 2 == 0, 0.0, 1.0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return logits.to(dtype), tokens, parents, draft_probs, temperature.to(device)


# ----------------------------------------------------------------------------- peers


def torch_native_chain(logits, tokens, draft_probs, temperature, greedy_only=False):
    """HF / gpt-fast style chain verification: softmax over every node, then vectorised accept.

    Sampled rows: accept draft i iff rand < p_i(x_i) / q_i(x_i); the first rejection's residual
    max(p - q, 0) is sampled with torch.multinomial, or the bonus token from the last node.
    Greedy rows: argmax of every node compared with the drafts. greedy_only (every row greedy,
    known when the inputs are built, so no host sync): HF's greedy path, argmax alone, without
    the softmax and sampling no greedy row needs.
    """
    batch, num_nodes, vocab = logits.shape
    k = num_nodes - 1
    drafts = tokens[:, 1:]
    rows = torch.arange(batch, device=logits.device)
    if greedy_only:
        greedy_tok = logits.argmax(-1)
        num_accepted = (greedy_tok[:, :k] == drafts).int().cumprod(-1).sum(-1)
        out = torch.full((batch, num_nodes), -1, dtype=torch.int64, device=logits.device)
        keep = torch.arange(k, device=logits.device)[None, :] < num_accepted[:, None]
        out[:, :k] = torch.where(keep, drafts, -1)
        out[rows, num_accepted.long()] = greedy_tok[rows, num_accepted.long()]
        return num_accepted, out
    temp = torch.where(temperature > 0, temperature, 1.0)
    probs = torch.softmax(logits.float() / temp[:, None, None], dim=-1)  # every node's logits
    greedy_tok = logits.argmax(-1)
    if draft_probs is not None:
        p_x = probs[:, :k].gather(-1, drafts[..., None])[..., 0]
        q_x = draft_probs[:, :k].gather(-1, drafts[..., None])[..., 0]
        accept = torch.rand(batch, k, device=logits.device) < p_x / q_x
    else:  # deterministic drafts: sample from p at each node and compare
        sampled = torch.multinomial(probs.reshape(-1, vocab), 1).view(batch, num_nodes)
        accept = sampled[:, :k] == drafts
    accept = torch.where((temperature == 0)[:, None], greedy_tok[:, :k] == drafts, accept)
    num_accepted = accept.int().cumprod(-1).sum(-1)
    at = num_accepted.long()
    p_at = probs[rows, at]
    if draft_probs is not None:
        q_at = torch.where((at < k)[:, None], draft_probs[rows, at.clamp(max=k - 1)], 0.0)
        residual = (p_at - q_at).clamp(min=0)
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_at)
    else:
        residual = p_at
    last = torch.multinomial(residual, 1)[:, 0]
    last = torch.where(temperature == 0, greedy_tok[rows, at], last)
    out = torch.full((batch, num_nodes), -1, dtype=torch.int64, device=logits.device)
    keep = torch.arange(k, device=logits.device)[None, :] < num_accepted[:, None]
    out[:, :k] = torch.where(keep, drafts, -1)
    out[rows, at] = last
    return num_accepted, out


def flashinfer_chain(logits, tokens, draft_probs, temperature):
    """flashinfer's chain speculative sampling on softmax(logits / T) (the softmax is part of the call)."""
    import flashinfer

    temp = torch.where(temperature > 0, temperature, 1.0)
    target_probs = torch.softmax(logits.float() / temp[:, None, None], dim=-1)
    k = logits.shape[1] - 1
    return flashinfer.sampling.chain_speculative_sampling(draft_probs[:, :k].contiguous(), tokens[:, 1:].int(),
                                                          target_probs)


# ----------------------------------------------------------------------------- timing


def measure_bandwidth(device):
    """Bytes/s of a large device-to-device copy (read + write), None off the GPU."""
    if device.type != "cuda":
        return None
    src = torch.empty(2 * 1024**3, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_us = common.time_kernel(lambda i: dst.copy_(src), device, reps=20, warmup=WARMUP).median_us
    del src, dst
    return 2 * 2 * 1024**3 / (copy_us * 1e-6)


# ----------------------------------------------------------------------------- sweep


def configs(args):
    """The configs of the chosen mode (--smoke, --full, or the short default)."""
    if args.smoke:
        return [dict(B=2, kind="chain", size=3, V=1000, mode="mixed"),
                dict(B=2, kind="tree", size=6, V=1000, mode="sampled")]
    if args.full:
        return [dict(B=b, kind=kind, size=size, V=v, mode=m)
                for v in VOCABS for kind, size in TREES for b in BATCHES for m in MODES]
    if args.goal:  # what the goals are stated at: the first minutes of a GPU window measure these
        return [dict(B=64, kind=kind, size=size, V=128256, mode=m)
                for kind, size in (("chain", 4), ("tree", 64)) for m in ("greedy", "sampled")]
    return [dict(B=b, kind=kind, size=size, V=128256, mode=m)
            for kind, size in (("chain", 4), ("tree", 16)) for b in BATCHES for m in ("greedy", "sampled")]


def run_config(cfg, ours, args, bandwidth, device, gen):
    """One row of the results: ours checked against the reference, then every method timed."""
    logits, tokens, parents, draft_probs, temperature = make_inputs(
        cfg["B"], cfg["kind"], cfg["size"], cfg["V"], cfg["mode"], device, gen)
    seed = torch.arange(cfg["B"], dtype=torch.int64, device=device)
    per_copy = logits.numel() * logits.element_size() + (0 if draft_probs is None else draft_probs.numel() * 4)
    copies = 1 if device.type != "cuda" else max(1, min(8, -(-ROTATE_BYTES // per_copy)))
    inputs = [(logits, draft_probs)] + [(logits.clone(), None if draft_probs is None else draft_probs.clone())
                                        for _ in range(copies - 1)]
    ref = verify(logits, tokens, parents, draft_probs=draft_probs, temperature=temperature, seed=seed,
                    backend="reference")
    row = {"config": {"B": cfg["B"], "tree": f"{cfg['kind']}{cfg['size']}", "T": logits.shape[1], "V": cfg["V"],
                      "mode": cfg["mode"], "dtype": str(logits.dtype).replace("torch.", ""),
                      "draft_probs": draft_probs is not None},
           "ours_us": None, "ours_backend": None, "peers_us": {}, "errors": {},
           "mean_accepted": float(ref.num_accepted.float().mean())}
    reps = 2 if args.smoke else args.reps
    times = {}

    def ours_fn(backend):
        return lambda i: verify(inputs[i % copies][0], tokens, parents, draft_probs=inputs[i % copies][1],
                                   temperature=temperature, seed=seed, backend=backend)

    methods = [(name, ours_fn(name)) for name in ours]
    if not args.no_peers:
        if cfg["kind"] == "chain":
            greedy_only = cfg["mode"] == "greedy"
            methods.append(("torch_native", lambda i: torch_native_chain(inputs[i % copies][0], tokens,
                                                                         inputs[i % copies][1], temperature,
                                                                         greedy_only)))
            if draft_probs is not None and args.flashinfer and cfg["mode"] == "sampled":
                methods.append(("flashinfer", lambda i: flashinfer_chain(inputs[i % copies][0], tokens,
                                                                         inputs[i % copies][1], temperature)))
        else:
            methods.append(("reference", ours_fn("reference")))
    greedy = (temperature == 0).cpu()
    for name, fn in methods:
        try:
            out = fn(0)
            if name in ours:
                same = (out.output_tokens.cpu() == ref.output_tokens.cpu()).all(1)
                if not same[greedy].all():
                    raise AssertionError("greedy rows differ from the reference")
                if (~same[~greedy]).float().mean() > 0.05:
                    raise AssertionError(f"{int((~same[~greedy]).sum())} sampled rows differ from the reference")
            elif name == "torch_native" and not (out[1].cpu() == ref.output_tokens.cpu()).all(1)[greedy].all():
                raise AssertionError("greedy rows differ from the reference")
            # Timed as `generate` calls the ops: without the input value checks, whose host syncs
            # (and, with draft probs, a pass over every checked row) would be timed as ours. L2 is
            # flushed as well: a call reads only the visited nodes' rows, a fraction of its copy,
            # and 8 copies of a small batch are a few MB, so rotation alone can leave them in L2.
            with config.value_checks(False):
                times[name] = common.time_kernel(fn, device, reps=reps, n_sets=copies, warmup=WARMUP,
                                                 flush_l2=True).median_us
        except Exception as error:  # a method that cannot run this config is reported, not fatal
            row["errors"][name] = f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"
    for name in ours:
        if name in times and row["ours_backend"] is None:
            row["ours_us"], row["ours_backend"] = times[name], name
        elif name in times:
            row["peers_us"][f"ours_{name}"] = times[name]
    for name, _ in methods:
        if name not in ours and name in times:
            row["peers_us"][name] = times[name]
    # Bytes needed: logits of the visited nodes, draft probs read there (sampled rows), outputs.
    visited = (ref.num_accepted.long() + 1).cpu()
    elt = logits.element_size()
    bytes_needed = int(visited.sum()) * cfg["V"] * elt
    if draft_probs is not None:
        bytes_needed += int(visited[(temperature > 0).cpu()].sum()) * cfg["V"] * draft_probs.element_size()
    bytes_needed += cfg["B"] * logits.shape[1] * (4 + 8) + cfg["B"] * 4
    row["bytes"] = bytes_needed
    row["floor_us"] = bytes_needed / bandwidth * 1e6 if bandwidth else None
    if not row["errors"]:
        del row["errors"]
    return row


# ----------------------------------------------------------------------------- output


TABLE_HEADERS = ["B", "tree", "V", "mode", "acc", "ours", "us", "%floor"]


def table_cells(row, peer_names):
    """One table row: config, mean accepted, our backend and time, % of the floor, then each
    peer as "us (peer / ours x)"."""
    c, us = row["config"], row["ours_us"]
    pct = 100 * row["floor_us"] / us if us and row["floor_us"] else None
    cells = [c["B"], c["tree"], c["V"], c["mode"], common.fmt(row["mean_accepted"], 2), row["ours_backend"] or "-",
             common.fmt(us), common.fmt(pct, 0)]
    return cells + [common.peer_cell(row["peers_us"].get(p), us) for p in peer_names]


def plot(rows, path):
    """us per call against batch, one panel per (tree, mode) at the largest vocab: ours, floor, peers."""
    vocab = max(r["config"]["V"] for r in rows)
    panels = []
    for tree, mode in sorted({(r["config"]["tree"], r["config"]["mode"]) for r in rows}):
        sub = sorted((r for r in rows if r["config"]["tree"] == tree and r["config"]["mode"] == mode
                      and r["config"]["V"] == vocab), key=lambda r: r["config"]["B"])
        series = {"ours": [r["ours_us"] for r in sub], "floor": [r["floor_us"] for r in sub]}
        for name in sorted({n for r in sub for n in r["peers_us"]}):
            series[name] = [r["peers_us"].get(name) for r in sub]
        panels.append((f"{tree} {mode} V={vocab}", [r["config"]["B"] for r in sub], series))
    common.plot_panels(path, panels, xlabel="batch", ylabel="us per call", panel_width=3.6, height=3.4)


def output_path(args, device) -> str:
    """--out; else verify_<device>.json in --out-dir (verify_<device>_smoke.json with --smoke,
    verify_<device>_goal.json with --goal);
    else bench/results/verify_<device>.json, or /tmp/bench_verify_smoke.json with --smoke (a smoke
    run is never a recorded result)."""
    if args.out:
        return args.out
    name = f"verify_{common.device_slug(device)}" + ("_smoke" if args.smoke else "_goal" if args.goal else "") + ".json"
    if args.out_dir:
        return str(Path(args.out_dir) / name)
    if args.smoke:
        return os.path.join("/tmp", "bench_verify_smoke.json")
    return str(common.results_dir() / name)


def main(argv=None) -> int:
    """Run the sweep on the GPU (or the --smoke config on the CPU); returns the exit status."""
    args = parse_args(argv)
    has_cuda = torch.cuda.is_available()
    if args.smoke and not has_cuda:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernel module is imported (lazily, on first use)
    elif not has_cuda:
        print("bench_verify measures GPU kernels and needs a CUDA GPU; none is visible here. "
              "Use --smoke to run a tiny config under the Triton interpreter (numbers not recorded).", file=sys.stderr)
        return 2
    device = torch.device("cuda" if has_cuda else "cpu")
    ours = [b for b in ("cuda", "triton") if b in available_backends("verify", device.type)]
    if device.type == "cpu" and _extension.HAS_TRITON:
        module = _extension.triton_kernel("verify").__module__
        if sys.modules[module].interpreted():
            ours = ["triton"]  # --smoke only
    if not ours:
        print("no kernel of ours can run here (need the CUDA extension or triton)", file=sys.stderr)
        return 1
    gen = torch.Generator().manual_seed(0)
    device_name = common.device_name(device) if has_cuda else "CPU (Triton interpreter smoke run)"
    bandwidth = measure_bandwidth(device)
    if bandwidth:
        print(f"{device_name}: copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    peers = [] if args.no_peers else ["torch_native", "flashinfer", "reference"]
    # flashinfer runs on CUDA tensors only; a GPU run without it says so in the results.
    why = common.import_error("flashinfer") if has_cuda and not args.no_peers else None
    args.flashinfer = has_cuda and not args.no_peers and why is None
    peers_skipped = {"flashinfer": f"not importable ({why})"} if why else {}
    if why:
        print(f"flashinfer peer skipped: not importable ({why})", flush=True)
    peer_names = [f"ours_{n}" for n in ours[1:]] + peers
    result = common.metadata(
        "verify", device, ours[0],
        mode="smoke" if args.smoke else ("full" if args.full else ("goal" if args.goal else "quick")),
        copy_bandwidth_Bps=bandwidth,
        peers_skipped=peers_skipped,
        stat=f"median of CUDA-event-timed calls after {WARMUP} warm-up calls, inputs rotated over copies, L2 "
             "flushed before each, input value checks off (as generate calls "
             "the ops); ours_us = best available of ours (cuda, then triton); floor_us = bytes needed / copy "
             "bandwidth",
    )
    result["device"] = device_name
    out = output_path(args, device)
    todo = configs(args)
    rows = []
    for i, cfg in enumerate(todo, 1):
        row = run_config(cfg, ours, args, bandwidth, device, gen)
        rows.append(row)
        common.write_rows(result, rows, out, planned=len(todo), complete=False)
        c = row["config"]
        common.print_progress(i, len(todo), f"B={c['B']} {c['tree']} V={c['V']} {c['mode']}", row)
        if has_cuda:
            torch.cuda.empty_cache()
    print()
    print("times in us; peer columns: us (peer / ours, > 1 means ours is faster); %floor: floor / ours; "
          "acc: mean accepted drafts per row")
    common.print_table(TABLE_HEADERS + peer_names, [table_cells(r, peer_names) for r in rows])
    common.write_rows(result, rows, out, planned=len(todo), complete=True)
    plot(rows, os.path.splitext(out)[0] + ".png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
