"""Verification (rejection sampling from logits) on the GPU: our kernels against peers in the same run.

    python bench/bench_verify.py              # a short sweep (GPU)
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
                counted), chains with draft probabilities, when flashinfer imports
Ours is checked against the reference before timing (greedy rows exactly, sampled rows on
the same Philox draws).

Floor: bytes actually needed / bandwidth measured in this run (a large device copy), with
bytes = the logits of the nodes on the accepted path (plus the node the last token is sampled
at) + the draft probabilities read at those nodes + the outputs. Times: median of CUDA-event
timed calls after warm-up, inputs rotated over copies so L2 (50 MB) does not hold them.
Writes bench/results/verify_<device>.json and .png (not in --smoke mode).
"""

import argparse
import datetime
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
RESULTS = os.path.join(ROOT, "bench", "results")

BATCHES = (1, 8, 64, 256)
VOCABS = (32000, 128256, 151936)
TREES = (("chain", 1), ("chain", 4), ("chain", 8), ("tree", 16), ("tree", 64))
MODES = ("greedy", "sampled", "mixed")
ROTATE_BYTES = 256 * 1024**2  # rotate input copies until this much: several times L2


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--full", action="store_true", help="the whole sweep (default: a short one)")
    mode.add_argument("--smoke", action="store_true", help="CPU: tiny interpreted run of the table code, nothing recorded")
    parser.add_argument("--out", default=None, help="JSON path (default bench/results/verify_<device>.json)")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--no-peers", action="store_true")
    return parser.parse_args(argv)


# ----------------------------------------------------------------------------- inputs


def make_inputs(torch, batch, kind, size, vocab, mode, device, gen):
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
    logits = torch.randn(batch, num_nodes, vocab, generator=gen) * 2.0
    rows = torch.arange(batch)
    for i in range(1, num_nodes):
        logits[rows, parents[:, i], tokens[:, i]] += 12.0  # a likely draft (siblings compete)
    with_probs = mode != "greedy" and kind == "chain"
    draft_probs = None
    if with_probs:
        draft_probs = torch.softmax(torch.randn(batch, num_nodes, vocab, generator=gen), -1) * 0.5
        for i in range(1, num_nodes):
            draft_probs[rows, parents[:, i], tokens[:, i]] += 0.5
    if mode == "greedy":
        temperature = torch.zeros(batch)
    elif mode == "sampled":
        temperature = torch.ones(batch)
    else:
        temperature = torch.where(torch.arange(batch) % 2 == 0, 0.0, 1.0)
    to = lambda x: None if x is None else x.to(device)  # noqa: E731
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return (logits.to(device, dtype), to(tokens), to(parents), None if draft_probs is None else draft_probs.to(device),
            to(temperature))


# ----------------------------------------------------------------------------- peers


def torch_native_chain(torch, logits, tokens, draft_probs, temperature):
    """HF / gpt-fast style chain verification: softmax over every node, then vectorised accept.

    Sampled rows: accept draft i iff rand < p_i(x_i) / q_i(x_i); the first rejection's residual
    max(p - q, 0) is sampled with torch.multinomial, or the bonus token from the last node.
    Greedy rows: argmax of every node compared with the drafts.
    """
    batch, num_nodes, vocab = logits.shape
    k = num_nodes - 1
    drafts = tokens[:, 1:]
    temp = torch.where(temperature > 0, temperature, 1.0)
    probs = torch.softmax(logits.float() / temp[:, None, None], dim=-1)  # every node's logits
    greedy_tok = logits.argmax(-1)
    rows = torch.arange(batch, device=logits.device)
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


def flashinfer_chain(torch, logits, tokens, draft_probs, temperature):
    import flashinfer

    temp = torch.where(temperature > 0, temperature, 1.0)
    target_probs = torch.softmax(logits.float() / temp[:, None, None], dim=-1)
    k = logits.shape[1] - 1
    return flashinfer.sampling.chain_speculative_sampling(draft_probs[:, :k].contiguous(), tokens[:, 1:].int(),
                                                          target_probs)


# ----------------------------------------------------------------------------- timing


def timer(torch, fn, reps, device):
    if device.type != "cuda":
        import time

        times = []
        for i in range(max(1, reps)):
            start = time.perf_counter()
            fn(i)
            times.append((time.perf_counter() - start) * 1e6)
        return sorted(times)[len(times) // 2]
    for i in range(3):
        fn(i)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        starts[i].record()
        fn(i)
        ends[i].record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends))
    return times[len(times) // 2]


def measure_bandwidth(torch, device):
    if device.type != "cuda":
        return None
    src = torch.empty(2 * 1024**3, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_us = timer(torch, lambda i: dst.copy_(src), 20, device)
    del src, dst
    return 2 * 2 * 1024**3 / (copy_us * 1e-6)


# ----------------------------------------------------------------------------- sweep


def configs(args):
    if args.smoke:
        return [dict(B=2, kind="chain", size=3, V=1000, mode="mixed"), dict(B=2, kind="tree", size=6, V=1000, mode="sampled")]
    if args.full:
        return [dict(B=b, kind=kind, size=size, V=v, mode=m)
                for v in VOCABS for kind, size in TREES for b in BATCHES for m in MODES]
    return [dict(B=b, kind=kind, size=size, V=128256, mode=m)
            for kind, size in (("chain", 4), ("tree", 16)) for b in BATCHES for m in ("greedy", "sampled")]


def run_config(torch, sk, cfg, ours, args, bandwidth, device, gen):
    logits, tokens, parents, draft_probs, temperature = make_inputs(
        torch, cfg["B"], cfg["kind"], cfg["size"], cfg["V"], cfg["mode"], device, gen)
    seed = torch.arange(cfg["B"], dtype=torch.int64, device=device)
    per_copy = logits.numel() * logits.element_size() + (0 if draft_probs is None else draft_probs.numel() * 4)
    copies = 1 if device.type != "cuda" else max(1, min(8, -(-ROTATE_BYTES // per_copy)))
    inputs = [(logits, draft_probs)] + [(logits.clone(), None if draft_probs is None else draft_probs.clone())
                                        for _ in range(copies - 1)]
    ref = sk.verify(logits, tokens, parents, draft_probs=draft_probs, temperature=temperature, seed=seed,
                    backend="reference")
    row = {"config": {"B": cfg["B"], "tree": f"{cfg['kind']}{cfg['size']}", "T": logits.shape[1], "V": cfg["V"],
                      "mode": cfg["mode"], "dtype": str(logits.dtype).replace("torch.", ""),
                      "draft_probs": draft_probs is not None},
           "ours_us": None, "ours_backend": None, "peers_us": {}, "errors": {},
           "mean_accepted": float(ref.num_accepted.float().mean())}
    reps = 2 if args.smoke else args.reps
    times = {}

    def ours_fn(backend):
        return lambda i: sk.verify(inputs[i % copies][0], tokens, parents, draft_probs=inputs[i % copies][1],
                                   temperature=temperature, seed=seed, backend=backend)

    methods = [(name, ours_fn(name)) for name in ours]
    if not args.no_peers:
        if cfg["kind"] == "chain":
            methods.append(("torch_native", lambda i: torch_native_chain(torch, inputs[i % copies][0], tokens,
                                                                         inputs[i % copies][1], temperature)))
            if draft_probs is not None and device.type == "cuda" and cfg["mode"] == "sampled":
                try:
                    import flashinfer  # noqa: F401

                    methods.append(("flashinfer", lambda i: flashinfer_chain(torch, inputs[i % copies][0], tokens,
                                                                             inputs[i % copies][1], temperature)))
                except ImportError:
                    pass
        else:
            methods.append(("reference", ours_fn("reference")))
    for name, fn in methods:
        try:
            if name in ours:
                out = fn(0)
                greedy = (temperature == 0).cpu()
                same = (out.output_tokens.cpu() == ref.output_tokens.cpu()).all(1)
                if not same[greedy].all():
                    raise AssertionError("greedy rows differ from the reference")
                if (~same[~greedy]).float().mean() > 0.05:
                    raise AssertionError(f"{int((~same[~greedy]).sum())} sampled rows differ from the reference")
            else:
                fn(0)
            times[name] = timer(torch, fn, reps, device)
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


def fmt(x, digits=1):
    return "-" if x is None else f"{x:.{digits}f}"


def print_header(peer_names):
    cols = ["B", "tree", "V", "mode", "acc", "ours", "us", "%floor"] + list(peer_names)
    print(" | ".join(f"{c:>12}" for c in cols), flush=True)


def print_row(row, peer_names):
    c, us = row["config"], row["ours_us"]
    pct = 100 * row["floor_us"] / us if us and row["floor_us"] else None
    cells = [c["B"], c["tree"], c["V"], c["mode"], fmt(row["mean_accepted"], 2), row["ours_backend"] or "-", fmt(us),
             fmt(pct, 0)]
    for p in peer_names:
        t = row["peers_us"].get(p)
        cells.append("-" if t is None else (f"{t:.1f} ({t / us:.2f}x)" if us else f"{t:.1f}"))
    print(" | ".join(f"{str(x):>12}" for x in cells), flush=True)
    for name, error in row.get("errors", {}).items():
        print(f"    {name}: {error}", flush=True)


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["config"]["tree"], r["config"]["mode"]) for r in rows})
    vocab = max(r["config"]["V"] for r in rows)
    fig, axes = plt.subplots(1, len(groups), figsize=(3.6 * len(groups), 3.4), squeeze=False)
    for ax, (tree, mode) in zip(axes[0], groups):
        sub = sorted((r for r in rows if r["config"]["tree"] == tree and r["config"]["mode"] == mode
                      and r["config"]["V"] == vocab), key=lambda r: r["config"]["B"])
        xs = [r["config"]["B"] for r in sub]
        series = {"ours": [r["ours_us"] for r in sub], "floor": [r["floor_us"] for r in sub]}
        for name in sorted({n for r in sub for n in r["peers_us"]}):
            series[name] = [r["peers_us"].get(name) for r in sub]
        for name, ys in series.items():
            pts = [(x, y) for x, y in zip(xs, ys) if y]
            if pts:
                ax.plot(*zip(*pts), marker="o", linestyle="--" if name == "floor" else "-", label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{tree} {mode} V={vocab}", fontsize=9)
        ax.set_xlabel("batch")
    axes[0][0].set_ylabel("us per call")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    has_cuda = torch.cuda.is_available()
    if args.smoke and not has_cuda:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernel module is imported
    elif not has_cuda:
        print("bench_verify.py measures GPU kernels and needs a CUDA GPU; none is visible here. "
              "Use --smoke to run a tiny config under the Triton interpreter (numbers not recorded).", file=sys.stderr)
        return 2
    import specdec_kernels as sk
    from specdec_kernels import _extension

    device = torch.device("cuda" if has_cuda else "cpu")
    ours = [b for b in ("cuda", "triton") if b in sk.available_backends("verify", device.type)]
    if device.type == "cpu" and _extension.HAS_TRITON:
        module = _extension.triton_kernel("verify").__module__
        if sys.modules[module].interpreted():
            ours = ["triton"]  # --smoke only
    if not ours:
        print("no kernel of ours can run here (need the CUDA extension or triton)", file=sys.stderr)
        return 1
    gen = torch.Generator().manual_seed(0)
    device_name = torch.cuda.get_device_name(device) if has_cuda else "CPU (Triton interpreter smoke run)"
    bandwidth = measure_bandwidth(torch, device)
    if bandwidth:
        print(f"{device_name}: copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    peer_names = [f"ours_{n}" for n in ours[1:]] + ([] if args.no_peers else ["torch_native", "flashinfer", "reference"])
    print("times in us; peer columns: us (peer / ours, > 1 means ours is faster); %floor: floor / ours; "
          "acc: mean accepted drafts per row")
    print_header(peer_names)
    rows = []
    for cfg in configs(args):
        row = run_config(torch, sk, cfg, ours, args, bandwidth, device, gen)
        rows.append(row)
        print_row(row, peer_names)
        if has_cuda:
            torch.cuda.empty_cache()
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    try:
        commit = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    result = {
        "benchmark": "verify",
        "device": device_name,
        "backend": ours[0],
        "torch": torch.__version__,
        "triton": triton_version,
        "commit": commit,
        "date": datetime.date.today().isoformat(),
        "mode": "smoke" if args.smoke else ("full" if args.full else "short"),
        "copy_bandwidth_Bps": bandwidth,
        "stat": "median of CUDA-event-timed calls after warm-up, inputs rotated over copies (> L2); "
                "ours_us = best available of ours (cuda, then triton); floor_us = bytes needed / copy bandwidth",
        "rows": rows,
    }
    if args.smoke:
        out = args.out or os.path.join("/tmp", "bench_verify_smoke.json")  # never a recorded result
    else:
        slug = re.sub(r"[^a-z0-9]+", "_", device_name.lower()).strip("_")
        out = args.out or os.path.join(RESULTS, f"verify_{slug}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {out}")
    try:
        plot(rows, os.path.splitext(out)[0] + ".png")
    except ImportError:
        print("matplotlib not installed: no plot")
    return 0


if __name__ == "__main__":
    sys.exit(main())
