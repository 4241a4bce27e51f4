"""Tree attention on the GPU: our kernels against peers measured in the same run.

    specdec bench kernels                             # runs this (short sweep) with the other kernel benchmarks
    python bench/bench_tree_attention.py              # a few configs (GPU; --quick says the same)
    python bench/bench_tree_attention.py --full       # the full sweep (GPU)
    python bench/bench_tree_attention.py --smoke      # CPU: tiny config under the Triton
                                                      # interpreter, only to show the code runs;
                                                      # its numbers mean nothing and are not recorded

Sweep: T in {1, 4, 16, 64, 128} tree nodes (random trees), prefix in {512, 2k, 8k, 32k},
batch in {1, 8, 32}, shapes llama3-8b (Hq=32, Hkv=8, D=128) and qwen2.5-7b (Hq=28, Hkv=4,
D=128), bf16, every row of a batch the same prefix length, cache allocated at prefix + T.

Methods:
  triton      tree_attention(backend="triton"): split-KV Triton kernel
  cuda        tree_attention(backend="cuda"), when the extension has a CUDA kernel
  sdpa_dense_mask   what HF does: repeat_kv to Hq heads, a dense [B, 1, T, S] bool mask
              (prefix + ancestors), torch SDPA
  flex        compiled FlexAttention (enable_gqa) with a BlockMask built from the same mask
              (block mask built outside the timing)
  flashinfer  BatchPrefillWithRaggedKVCacheWrapper with a custom mask (planned outside the
              timing), when flashinfer imports (else the JSON's peers_skipped says why)
Each method's output is checked against the reference before timing; a method that fails
or runs out of memory is reported as such, not timed.

Floor: max(bytes / BW, flops / peak), bytes = K and V of the visible prefix and tree read
once + q + output, flops = 4 * B * Hq * T * (prefix + T) * D; BW is measured in this run
(a large device-to-device copy), peak from a large bf16 matmul in this run.
Times: median of CUDA-event-timed calls after warm-up calls (benchmarks.common.time_kernel), L2
flushed before each call (the caches are too large to rotate copies of; launch overhead of the
Python wrappers included, as a user sees it; input value checks off, as in `generate`).
Writes bench/results/tree_attention_<device>.json and .png (not in --smoke mode); the JSON is
rewritten after every config ("complete": false until the last), so a run stopped mid-sweep keeps
its rows.
"""

import argparse
import os
import sys

import torch

from . import common

SHAPES = {"llama3-8b": (32, 8, 128), "qwen2.5-7b": (28, 4, 128)}
NODES = (1, 4, 16, 64, 128)
PREFIXES = (512, 2048, 8192, 32768)
BATCHES = (1, 8, 32)

ARGS = None  # the parsed command line (set by main)
PEERS_SKIPPED = {}  # peer -> why it cannot run here (set by main; written to the results)
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
config = tree_attention = _extension = pack_tree_mask = reference = tree_mask = None  # imported by main (after TRITON_INTERPRET is set)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="bench_tree_attention", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="a few configs (the default)")
    mode.add_argument("--full", action="store_true", help="every shape x batch x prefix x nodes")
    mode.add_argument("--goal", action="store_true",
                      help="the goal configuration alone (issue 37: llama3-8b shape, B=8, T=64, prefix 8k)")
    mode.add_argument("--smoke", action="store_true", help="CPU: tiny interpreted run of the table code, nothing recorded")
    parser.add_argument("--out", default=None, help="JSON path (default bench/results/tree_attention_<device>.json)")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--no-peers", action="store_true")
    parser.add_argument("--skip", action="append", default=[], help="skip a method by name (repeatable), e.g. flex")
    return parser.parse_args(argv)


def _import_package():
    """Import the package's ops into this module's globals. On a CPU-only --smoke run the
    Triton interpreter is switched on first (the kernel module is imported lazily, on first use)."""
    global config, tree_attention, _extension, pack_tree_mask, reference, tree_mask
    if ARGS.smoke and not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
    from .. import config as package_config
    from ..ops import _extension as extension
    from ..ops import reference as ref
    from ..ops.tree import pack_tree_mask as pack
    from ..ops.tree import tree_mask as mask
    from ..ops.tree_attention import tree_attention as op

    config, tree_attention, _extension, pack_tree_mask, reference, tree_mask = package_config, op, extension, pack, ref, mask


# ----------------------------------------------------------------------------- inputs


def random_parents(batch, num_nodes, gen):
    parents = torch.full((batch, num_nodes), -1, dtype=torch.int64)
    for i in range(1, num_nodes):
        parents[:, i] = torch.randint(0, i, (batch,), generator=gen)
    return parents


def make_inputs(batch, num_nodes, prefix, q_heads, kv_heads, head_dim, dtype, gen):
    cache_len = prefix + num_nodes
    # Drawn on the device, seeded from `gen`: the largest caches hold 2e9 values, many seconds
    # of the CPU generator per config (and 8 GB of fp32 in host memory).
    dgen = common.device_generator(gen, DEVICE)
    k = torch.randn(batch, cache_len, kv_heads, head_dim, generator=dgen, device=DEVICE, dtype=dtype)
    v = torch.randn(batch, cache_len, kv_heads, head_dim, generator=dgen, device=DEVICE, dtype=dtype)
    q = torch.randn(batch, num_nodes, q_heads, head_dim, generator=dgen, device=DEVICE, dtype=dtype)
    bool_mask = tree_mask(random_parents(batch, num_nodes, gen)).to(DEVICE)
    seqlens = torch.full((batch,), prefix, dtype=torch.int32, device=DEVICE)
    return q, k, v, bool_mask, seqlens


def dense_visibility(bool_mask, seqlens, cache_len):
    """bool [B, T, S]: the mask HF would build (prefix, then the tree's ancestor mask)."""
    batch, num_nodes, _ = bool_mask.shape
    pos = torch.arange(cache_len, device=bool_mask.device)
    tree_col = pos[None, :] - seqlens[:, None].long()  # [B, S]
    in_tree = (tree_col >= 0) & (tree_col < num_nodes)
    gathered = torch.gather(bool_mask, 2, tree_col.clamp(0, num_nodes - 1)[:, None, :].expand(-1, num_nodes, -1))
    return (pos[None, None, :] < seqlens[:, None, None]) | (gathered & in_tree[:, None, :])


# ----------------------------------------------------------------------------- methods


def method_ours(backend):
    def build(q, k, v, bool_mask, seqlens, scale):
        packed = pack_tree_mask(bool_mask)
        return lambda: tree_attention(q, k, v, packed, seqlens, scale=scale, backend=backend)

    return build


def build_sdpa_dense(q, k, v, bool_mask, seqlens, scale):
    group = q.shape[2] // k.shape[2]
    mask = dense_visibility(bool_mask, seqlens, k.shape[1])[:, None]  # [B, 1, T, S]
    qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # HF layout views

    def call():
        # HF's eager/sdpa path: repeat_kv materialises Hq heads of K and V every layer.
        kr = kh.repeat_interleave(group, dim=1)
        vr = vh.repeat_interleave(group, dim=1)
        out = torch.nn.functional.scaled_dot_product_attention(qh, kr, vr, attn_mask=mask, scale=scale)
        return out.transpose(1, 2)

    return call


_FLEX = None


def build_flex(q, k, v, bool_mask, seqlens, scale):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    batch, num_nodes, _, _ = q.shape
    cache_len = k.shape[1]
    lens = seqlens.long()

    def mask_mod(b, h, q_idx, kv_idx):
        col = kv_idx - lens[b]
        in_tree = (col >= 0) & (col < num_nodes)
        return (kv_idx < lens[b]) | (in_tree & bool_mask[b, q_idx, col.clamp(0, num_nodes - 1)])

    global _FLEX
    if _FLEX is None:
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 512)  # one compile per shape
        _FLEX = torch.compile(flex_attention, dynamic=False)
    block_mask = create_block_mask(mask_mod, batch, None, num_nodes, cache_len, device=q.device)
    compiled = _FLEX
    qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    return lambda: compiled(qh, kh, vh, block_mask=block_mask, scale=scale, enable_gqa=True).transpose(1, 2)


def build_flashinfer(q, k, v, bool_mask, seqlens, scale):
    import flashinfer

    batch, num_nodes, q_heads, head_dim = q.shape
    cache_len, kv_heads = k.shape[1], k.shape[2]
    dense = dense_visibility(bool_mask, seqlens, cache_len)  # every row uses the whole cache here
    qo_indptr = torch.arange(0, (batch + 1) * num_nodes, num_nodes, dtype=torch.int32, device=q.device)
    kv_indptr = torch.arange(0, (batch + 1) * cache_len, cache_len, dtype=torch.int32, device=q.device)
    workspace = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device=q.device)
    wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD")
    wrapper.plan(qo_indptr, kv_indptr, q_heads, kv_heads, head_dim, custom_mask=dense.reshape(-1),
                 q_data_type=q.dtype, sm_scale=scale)
    q2, k2, v2 = q.reshape(-1, q_heads, head_dim), k.reshape(-1, kv_heads, head_dim), v.reshape(-1, kv_heads, head_dim)
    return lambda: wrapper.run(q2, k2, v2).view(batch, num_nodes, q_heads, head_dim)


def methods():
    ours = [("triton", method_ours("triton"))] if "triton" in _available() else []
    if "cuda" in _available():
        ours.insert(0, ("cuda", method_ours("cuda")))
    peers = [] if ARGS.no_peers else [("sdpa_dense_mask", build_sdpa_dense)]
    if not ARGS.no_peers and DEVICE.type == "cuda":
        peers.append(("flex", build_flex))
        if "flashinfer" not in PEERS_SKIPPED:
            peers.append(("flashinfer", build_flashinfer))
    keep = lambda methods: [(n, b) for n, b in methods if n not in ARGS.skip]  # noqa: E731
    return keep(ours), keep(peers)


def _available():
    found = _extension.available_backends("tree_attention", DEVICE.type)
    if DEVICE.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1" and _extension.HAS_TRITON:
        found = ["triton"] + found  # --smoke only
    return found


# ----------------------------------------------------------------------------- timing


def measure_hardware():
    """(bytes/s, flop/s) measured now: a big device copy and a big bf16 matmul."""
    if DEVICE.type != "cuda":
        return None, None
    src = torch.empty(2 * 1024**3, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    copy_us = common.time_kernel(lambda _: dst.copy_(src), DEVICE, reps=20, warmup=3, flush_l2=True).median_us
    bandwidth = 2 * src.numel() / (copy_us * 1e-6)
    del src, dst
    a = torch.randn(8192, 8192, device=DEVICE, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=DEVICE, dtype=torch.bfloat16)
    mm_us = common.time_kernel(lambda _: a @ b, DEVICE, reps=20, warmup=3, flush_l2=True).median_us
    peak = 2 * 8192**3 / (mm_us * 1e-6)
    return bandwidth, peak


def floor_terms(batch, num_nodes, prefix, q_heads, kv_heads, head_dim, elt):
    keys = prefix + num_nodes
    bytes_moved = elt * (2 * batch * keys * kv_heads * head_dim + 2 * batch * num_nodes * q_heads * head_dim)
    flops = 4 * batch * q_heads * num_nodes * keys * head_dim
    return bytes_moved, flops


# ----------------------------------------------------------------------------- sweep


def configs():
    if ARGS.smoke:
        return [dict(shape="tiny", heads=(4, 2, 64), B=2, T=5, prefix=40)]
    if ARGS.goal:  # what the goals are stated at: the first minutes of a GPU window measure this
        return [dict(shape="llama3-8b", heads=SHAPES["llama3-8b"], B=8, T=64, prefix=8192)]
    if not ARGS.full:
        return [
            dict(shape="llama3-8b", heads=SHAPES["llama3-8b"], B=batch, T=t, prefix=p)
            for batch, t, p in ((1, 1, 8192), (1, 16, 8192), (8, 16, 2048), (8, 64, 8192), (32, 4, 32768))
        ]
    return [
        dict(shape=name, heads=heads, B=batch, T=t, prefix=p)
        for name, heads in SHAPES.items()
        for batch in BATCHES
        for p in PREFIXES
        for t in NODES
    ]


def run_config(cfg, hardware, gen):
    q_heads, kv_heads, head_dim = cfg["heads"]
    dtype = torch.float32 if DEVICE.type == "cpu" else torch.bfloat16
    q, k, v, bool_mask, seqlens = make_inputs(cfg["B"], cfg["T"], cfg["prefix"], q_heads, kv_heads, head_dim, dtype, gen)
    scale = head_dim**-0.5
    expected = reference.tree_attention(q, k, v, bool_mask, seqlens, scale)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    reps = 3 if ARGS.smoke else ARGS.reps
    ours, peers = methods()
    row = {
        "config": {"shape": cfg["shape"], "B": cfg["B"], "T": cfg["T"], "prefix": cfg["prefix"],
                   "Hq": q_heads, "Hkv": kv_heads, "D": head_dim, "dtype": str(dtype).replace("torch.", "")},
        "ours_us": None, "ours_backend": None, "peers_us": {}, "errors": {},
    }
    times = {}
    for name, build in ours + peers:
        try:
            fn = build(q, k, v, bool_mask, seqlens, scale)
            out = fn()
            err = (out.float() - expected.float()).abs().max().item()
            if not err <= tol:
                raise AssertionError(f"max abs error {err:.3g} > {tol}")
            # Timed as `generate` calls the op: without the input value checks, whose host sync
            # would be timed as ours.
            with config.value_checks(False):
                times[name] = common.time_kernel(lambda _: fn(), DEVICE, reps=reps, warmup=3, flush_l2=True).median_us
        except Exception as error:  # a peer that cannot run this config is reported, not fatal
            row["errors"][name] = f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"
            if DEVICE.type == "cuda":
                torch.cuda.empty_cache()
        finally:
            fn = None
    for name, _ in ours:
        if name in times:
            row["ours_us"], row["ours_backend"] = times[name], name
            break
    for name, _ in ours:
        if name in times and name != row["ours_backend"]:
            row["peers_us"][f"ours_{name}"] = times[name]
    for name, _ in peers:
        if name in times:
            row["peers_us"][name] = times[name]
    bytes_moved, flops = floor_terms(cfg["B"], cfg["T"], cfg["prefix"], q_heads, kv_heads, head_dim, q.element_size())
    bandwidth, peak = hardware
    row["bytes"], row["flops"] = bytes_moved, flops
    row["floor_us"] = max(bytes_moved / bandwidth, flops / peak) * 1e6 if bandwidth else None
    if not row["errors"]:
        del row["errors"]
    return row


TABLE_HEADERS = ["shape", "B", "T", "prefix", "ours", "us", "TB/s", "TFLOP/s", "%floor"]


def table_cells(row, peer_names):
    """One table row: config, our backend and time, achieved bandwidth and flop rate, % of the
    floor, then each peer as "us (peer / ours x)"."""
    c, us = row["config"], row["ours_us"]
    tbs = row["bytes"] / (us * 1e-6) / 1e12 if us else None
    tflops = row["flops"] / (us * 1e-6) / 1e12 if us else None
    pct = 100 * row["floor_us"] / us if us and row["floor_us"] else None
    cells = [c["shape"], c["B"], c["T"], c["prefix"], row["ours_backend"] or "-", common.fmt(us), common.fmt(tbs, 2),
             common.fmt(tflops, 1), common.fmt(pct, 0)]
    return cells + [common.peer_cell(row["peers_us"].get(p), us) for p in peer_names]


def plot(rows, path):
    """us per call against prefix length, one panel per T, for the first shape at batch 8 (or
    the first batch): ours, floor, peers."""
    shape = rows[0]["config"]["shape"]
    batch = 8 if any(r["config"]["B"] == 8 for r in rows) else rows[0]["config"]["B"]
    picked = [r for r in rows if r["config"]["shape"] == shape and r["config"]["B"] == batch]
    panels = []
    for t in sorted({r["config"]["T"] for r in picked}):
        sub = sorted((r for r in picked if r["config"]["T"] == t), key=lambda r: r["config"]["prefix"])
        series = {"ours": [r["ours_us"] for r in sub], "floor": [r["floor_us"] for r in sub]}
        for name in dict.fromkeys(n for r in sub for n in r["peers_us"]):
            series[name] = [r["peers_us"].get(name) for r in sub]
        panels.append((f"{shape} B={batch} T={t}", [r["config"]["prefix"] for r in sub], series))
    common.plot_panels(path, panels, xlabel="prefix length", ylabel="us per call")


def main(argv=None) -> int:
    """Run the sweep on the GPU (or the --smoke config on the CPU); returns the exit status."""
    global ARGS
    ARGS = parse_args(argv)
    if not ARGS.smoke and not torch.cuda.is_available():
        print("bench_tree_attention measures GPU kernels and needs a CUDA GPU; none is visible here. "
              "Use --smoke to run a tiny config under the Triton interpreter (numbers not recorded).", file=sys.stderr)
        return 2
    _import_package()
    gen = torch.Generator().manual_seed(0)
    device_name = torch.cuda.get_device_name(DEVICE) if DEVICE.type == "cuda" else "CPU (Triton interpreter smoke run)"
    if DEVICE.type == "cuda" and not ARGS.no_peers and "flashinfer" not in ARGS.skip:
        why = common.import_error("flashinfer")
        if why:
            PEERS_SKIPPED["flashinfer"] = f"not importable ({why})"
            print(f"flashinfer peer skipped: {PEERS_SKIPPED['flashinfer']}", flush=True)
    hardware = measure_hardware()
    if hardware[0]:
        print(f"{device_name}: copy bandwidth {hardware[0] / 1e12:.2f} TB/s, bf16 matmul {hardware[1] / 1e12:.0f} TFLOP/s")
    ours, peers = methods()
    peer_names = [f"ours_{n}" for n, _ in ours[1:]] + [n for n, _ in peers]
    if not ours:
        print("no kernel of ours can run here (need the CUDA extension or triton)", file=sys.stderr)
        return 2
    result = common.metadata(
        "tree_attention", DEVICE, ours[0][0],
        mode="smoke" if ARGS.smoke else ("full" if ARGS.full else ("goal" if ARGS.goal else "quick")),
        copy_bandwidth_Bps=hardware[0],
        matmul_peak_flops=hardware[1],
        peers_skipped=PEERS_SKIPPED,
        stat="median of CUDA-event-timed calls after 3 warm-up calls, L2 flushed before each, input value checks "
             "off (as generate calls the op); ours_us = best available of ours (cuda, then triton); floor_us = "
             "max(bytes / copy bandwidth, flops / matmul peak)",
    )
    result["device"] = device_name
    if ARGS.smoke:
        out = ARGS.out or os.path.join("/tmp", "bench_tree_attention_smoke.json")  # never a recorded result
    else:
        goal = "_goal" if ARGS.goal else ""
        out = ARGS.out or str(common.results_dir() / f"tree_attention_{common.slug(device_name)}{goal}.json")
    todo = configs()
    rows = []
    for i, cfg in enumerate(todo, 1):
        row = run_config(cfg, hardware, gen)
        rows.append(row)
        common.write_rows(result, rows, out, planned=len(todo), complete=False)
        c = row["config"]
        common.print_progress(i, len(todo), f"{c['shape']} B={c['B']} T={c['T']} prefix={c['prefix']}", row)
    print()
    print("times in us; peer columns: us (peer / ours, > 1 means ours is faster); %floor: floor / ours")
    common.print_table(TABLE_HEADERS + peer_names, [table_cells(r, peer_names) for r in rows])
    common.write_rows(result, rows, out, planned=len(todo), complete=True)
    plot(rows, os.path.splitext(out)[0] + ".png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
