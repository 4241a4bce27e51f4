"""Tree attention against two oracles written differently from the reference:

* a brute force: for each row, query and head, the list of visible keys (the prefix, then the
  query's ancestors found by walking parent links) and a float64 softmax over them (numpy);
* the per-branch oracle: a node's output equals plain causal attention (torch SDPA,
  is_causal=True, float64) over the prefix followed by its root-to-node path.

Every backend available on the CPU (and backend=None) is compared against `reference`.
"""

import math
import os
import platform
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import specdec_kernels as sk
from specdec_kernels import pack_tree_mask, tree_attention, tree_mask

from conftest import TREE_KINDS, ancestors, randint, tree_parents

BACKENDS = [None] + sk.available_backends("tree_attention", "cpu")

# Tolerances against the float64 oracles on the same (rounded) inputs: the output is rounded
# once to the dtype, and low-precision kernels may keep P in that dtype too.
TOL = {
    torch.float32: dict(atol=2e-5, rtol=1e-4),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
    torch.float16: dict(atol=3e-3, rtol=3e-3),
}
# Between implementations: one or two output roundings apart.
TOL_BACKEND = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
}


# ----------------------------------------------------------------------------- inputs


def make_case(
    gen,
    *,
    batch,
    num_nodes,
    q_heads,
    kv_heads,
    head_dim,
    kind="random",
    ragged=True,
    dtype=torch.float32,
    max_prefix=40,
    hf_layout=False,
    shared_tree=False,
    prefix=None,
):
    """Random inputs; slots no query may see hold large garbage."""
    parents = tree_parents(gen, batch, num_nodes, kind, ragged, shared_tree)
    if prefix is None:
        prefix = randint(gen, 0, max_prefix + 1, (batch,))
        prefix[int(randint(gen, 0, batch))] = int(randint(gen, 0, 2))  # a row with an empty / tiny prefix
    cache_len = int(prefix.max()) + num_nodes + int(randint(gen, 0, 6))
    if hf_layout:
        # HF caches are [B, H, S, D]; the kernels take [B, S, H, D] views of them, no copy.
        k_hf = torch.randn(batch, kv_heads, cache_len, head_dim, generator=gen).to(dtype)
        v_hf = torch.randn(batch, kv_heads, cache_len, head_dim, generator=gen).to(dtype)
        q_hf = torch.randn(batch, q_heads, num_nodes, head_dim, generator=gen).to(dtype)
        k, v, q = k_hf.transpose(1, 2), v_hf.transpose(1, 2), q_hf.transpose(1, 2)
    else:
        k = torch.randn(batch, cache_len, kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(batch, cache_len, kv_heads, head_dim, generator=gen).to(dtype)
        q = torch.randn(batch, num_nodes, q_heads, head_dim, generator=gen).to(dtype)
    for b in range(batch):  # finite garbage past the tree: must be masked out, not just down-weighted
        end = int(prefix[b]) + num_nodes
        k[b, end:] = 50.0
        v[b, end:] = 1e3
    return q, k, v, parents, prefix.to(torch.int32)


def brute_attention(q, k, v, parents, prefix, scale=None, window=None, softcap=None):
    """float64 numpy [B, T, Hq, Dv]: loop over rows, queries and heads, softmax over visible
    keys. window: positions along the query's own path (prefix key s at s, an ancestor at
    L + its depth), a key visible only if query position - key position < window."""
    q64 = q.double().numpy()
    k64 = k.double().numpy()
    v64 = v.double().numpy()
    batch, num_nodes, q_heads, head_dim = q.shape
    group = q_heads // k.shape[2]
    scale = head_dim**-0.5 if scale is None else scale
    out = np.zeros((batch, num_nodes, q_heads, v.shape[3]))
    for b in range(batch):
        row = parents[b].tolist()
        length = int(prefix[b])
        for i in range(num_nodes):
            path = ancestors(row, i)[::-1]  # root first: the node at depth d is path[d]
            positions = list(range(length)) + [length + d for d in range(len(path))]
            visible = list(range(length)) + [length + j for j in path]
            if window is not None:
                query_pos = length + len(path) - 1
                visible = [s for s, pos in zip(visible, positions) if query_pos - pos < window]
            for h in range(q_heads):
                keys = k64[b, visible, h // group]  # [n, D]
                scores = keys @ q64[b, i, h] * scale
                if softcap is not None:
                    scores = softcap * np.tanh(scores / softcap)
                weights = np.exp(scores - scores.max())
                weights /= weights.sum()
                out[b, i, h] = weights @ v64[b, visible, h // group]
    return torch.from_numpy(out)


def branch_oracle(q, k, v, parents, prefix, scale=None, nodes_per_row=3, gen=None):
    """{(b, node): float64 [Hq, D]} from causal SDPA over prefix + root-to-node path."""
    batch, num_nodes, q_heads, head_dim = q.shape
    group = q_heads // k.shape[2]
    results = {}
    for b in range(batch):
        row = parents[b].tolist()
        real = [i for i in range(num_nodes) if i == 0 or row[i] >= 0]
        leaves = [i for i in real if i not in row]
        picks = leaves if len(leaves) <= nodes_per_row else [leaves[int(randint(gen, 0, len(leaves)))] for _ in range(nodes_per_row)]
        length = int(prefix[b])
        for leaf in set(picks):
            path = ancestors(row, leaf)[::-1]  # root first
            keys = torch.cat([k[b, :length], k[b, [length + j for j in path]]]).double()  # [n, Hkv, D]
            values = torch.cat([v[b, :length], v[b, [length + j for j in path]]]).double()
            queries = torch.zeros(length + len(path), q_heads, head_dim, dtype=torch.float64)
            queries[length:] = q[b, path].double()
            keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, n, D]
            values = values.repeat_interleave(group, dim=1).transpose(0, 1)
            out = F.scaled_dot_product_attention(queries.transpose(0, 1), keys, values, is_causal=True, scale=scale)
            for pos, node in enumerate(path):
                results[(b, node)] = out[:, length + pos]
    return results


def check_all(q, k, v, mask, parents, prefix, *, scale=None, gen=None, branch=True):
    """Reference and every backend against both oracles and each other."""
    dtype = q.dtype
    expected = brute_attention(q, k, v, parents, prefix, scale)
    oracle = branch_oracle(q, k, v, parents, prefix, scale, gen=gen) if branch else {}
    ref = tree_attention(q, k, v, mask, prefix, scale=scale, backend="reference")
    assert ref.shape == q.shape and ref.dtype == dtype
    torch.testing.assert_close(ref.double(), expected, **TOL[dtype])
    for (b, node), want in oracle.items():
        torch.testing.assert_close(ref[b, node].double(), want, **TOL[dtype])
    for backend in BACKENDS:
        out = tree_attention(q, k, v, mask, prefix, scale=scale, backend=backend)
        assert out.shape == q.shape and out.dtype == dtype, backend
        torch.testing.assert_close(out.double(), expected, **TOL[dtype], msg=lambda m: f"backend={backend}: {m}")
        torch.testing.assert_close(out, ref, **TOL_BACKEND[dtype], msg=lambda m: f"backend={backend} vs reference: {m}")
    return ref


# ----------------------------------------------------------------------------- correctness


@pytest.mark.parametrize("num_nodes", (1, 2, 5, 17, 33, 70))
@pytest.mark.parametrize("kind", TREE_KINDS)
def test_tree_shapes(gen, kind, num_nodes):
    q, k, v, parents, prefix = make_case(gen, batch=3, num_nodes=num_nodes, q_heads=4, kv_heads=2, head_dim=16, kind=kind)
    check_all(q, k, v, tree_mask(parents), parents, prefix, gen=gen)


@pytest.mark.parametrize("head_dim", (16, 40, 64, 128))  # 40: not a multiple of the CPU kernel's 16 lanes
@pytest.mark.parametrize("q_heads, kv_heads", [(4, 4), (4, 1), (8, 2), (8, 1), (16, 2)])
def test_gqa_and_head_dims(gen, q_heads, kv_heads, head_dim):
    num_nodes = int(randint(gen, 1, 12))
    q, k, v, parents, prefix = make_case(
        gen, batch=2, num_nodes=num_nodes, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, max_prefix=25
    )
    check_all(q, k, v, tree_mask(parents), parents, prefix, gen=gen)


@pytest.mark.parametrize("max_prefix", (0, 1, 63, 129, 301))
def test_ragged_prefix_lengths(gen, max_prefix):
    prefix = randint(gen, 0, max_prefix + 1, (4,))
    prefix[0] = max_prefix  # one row at the limit, one empty (or tiny), the others anywhere
    prefix[1] = int(randint(gen, 0, 2))
    q, k, v, parents, prefix = make_case(
        gen, batch=4, num_nodes=int(randint(gen, 1, 20)), q_heads=4, kv_heads=2, head_dim=16, prefix=prefix
    )
    check_all(q, k, v, tree_mask(parents), parents, prefix, gen=gen)


def _grow_cache(gen, k, v, min_len):
    """Pad the cache along S with random (visible-prefix) entries so min_len fits."""
    batch, cache_len, heads, dim = k.shape
    if cache_len >= min_len:
        return k, v
    extra = min_len - cache_len
    k = torch.cat([k, torch.randn(batch, extra, heads, dim, generator=gen).to(k.dtype)], dim=1)
    v = torch.cat([v, torch.randn(batch, extra, heads, dim, generator=gen).to(v.dtype)], dim=1)
    return k, v


@pytest.mark.parametrize("hf_layout", (False, True), ids=("bshd", "hf_views"))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16), ids=str)
def test_dtypes_and_layouts(gen, dtype, hf_layout):
    q, k, v, parents, prefix = make_case(
        gen, batch=3, num_nodes=int(randint(gen, 2, 40)), q_heads=8, kv_heads=2, head_dim=64, dtype=dtype, hf_layout=hf_layout,
        max_prefix=77,
    )
    if hf_layout:
        assert not q.is_contiguous() and not k.is_contiguous() and q.stride(-1) == 1 and k.stride(-1) == 1
    check_all(q, k, v, tree_mask(parents), parents, prefix, gen=gen)


def test_sliced_cache_views(gen):
    """Caches that are slices of larger buffers (longer S, more heads, wider D) with odd strides."""
    q, k, v, parents, prefix = make_case(gen, batch=2, num_nodes=9, q_heads=6, kv_heads=3, head_dim=16, max_prefix=30)
    big_k = torch.randn(3, k.shape[1] + 7, 5, 40, generator=gen)
    big_v = torch.randn(3, k.shape[1] + 7, 5, 40, generator=gen)
    big_k[1:, 3 : 3 + k.shape[1], 1:4, 8:24] = k
    big_v[1:, 3 : 3 + k.shape[1], 1:4, 8:24] = v
    k_view = big_k[1:, 3 : 3 + k.shape[1], 1:4, 8:24]
    v_view = big_v[1:, 3 : 3 + k.shape[1], 1:4, 8:24]
    big_q = torch.randn(2, 9, 7, 20, generator=gen)
    big_q[:, :, :6, 2:18] = q
    q_view = big_q[:, :, :6, 2:18]
    check_all(q_view, k_view, v_view, tree_mask(parents), parents, prefix, gen=gen)


@pytest.mark.parametrize("form", ("bool", "bool_shared", "packed", "packed_shared"))
@pytest.mark.parametrize("num_nodes", (3, 64, 65, 70))
def test_mask_forms(gen, form, num_nodes):
    shared = form.endswith("shared")
    q, k, v, parents, prefix = make_case(
        gen, batch=2, num_nodes=num_nodes, q_heads=2, kv_heads=1, head_dim=16, shared_tree=shared, max_prefix=20
    )
    mask = tree_mask(parents[0] if shared else parents)
    if form.startswith("packed"):
        mask = pack_tree_mask(mask)
        assert mask.dtype == torch.int64 and mask.shape[-1] == (num_nodes + 63) // 64
    assert mask.dim() == (2 if shared else 3)
    out = check_all(q, k, v, mask, parents, prefix, gen=gen, branch=False)
    dense = tree_attention(q, k, v, tree_mask(parents), prefix, backend="reference")
    torch.testing.assert_close(out, dense, atol=0, rtol=0)


@pytest.mark.parametrize("scale", (0.05, 1.0, 0.3))
def test_custom_scale(gen, scale):
    prefix = torch.tensor([5, int(randint(gen, 0, 30))])
    q, k, v, parents, prefix = make_case(gen, batch=2, num_nodes=11, q_heads=4, kv_heads=4, head_dim=32, prefix=prefix)
    out = check_all(q, k, v, tree_mask(parents), parents, prefix, scale=scale, gen=gen)
    default = tree_attention(q, k, v, tree_mask(parents), prefix, backend="reference")
    explicit = tree_attention(q, k, v, tree_mask(parents), prefix, scale=32**-0.5, backend="reference")
    torch.testing.assert_close(default, explicit, atol=0, rtol=0)
    assert not torch.allclose(out, default)


@pytest.mark.parametrize("kind", TREE_KINDS)
def test_per_branch_oracle_all_nodes(gen, kind):
    """Every real node (not only leaves) equals causal attention over prefix + its path."""
    q, k, v, parents, prefix = make_case(gen, batch=2, num_nodes=int(randint(gen, 1, 30)), q_heads=4, kv_heads=2, head_dim=16, kind=kind)
    out = tree_attention(q, k, v, tree_mask(parents), prefix)
    oracle = branch_oracle(q, k, v, parents, prefix, nodes_per_row=10**9, gen=gen)
    real = {(b, i) for b in range(2) for i in range(q.shape[1]) if i == 0 or parents[b, i] >= 0}
    assert set(oracle) == real  # leaves' paths cover every real node
    for (b, node), want in oracle.items():
        torch.testing.assert_close(out[b, node].double(), want, **TOL[torch.float32])


def test_padding_nodes_see_prefix_and_themselves(gen):
    q, k, v, _, prefix = make_case(gen, batch=1, num_nodes=6, q_heads=2, kv_heads=2, head_dim=16)
    parents = torch.tensor([[-1, 0, 1, -1, -1, -1]])
    out = tree_attention(q, k, v, tree_mask(parents), prefix)
    length = int(prefix[0])
    for node in (3, 4, 5):
        keys = torch.cat([k[0, :length], k[0, length + node : length + node + 1]]).double().transpose(0, 1)
        values = torch.cat([v[0, :length], v[0, length + node : length + node + 1]]).double().transpose(0, 1)
        want = F.scaled_dot_product_attention(q[0, node].double()[:, None], keys, values)[:, 0]
        torch.testing.assert_close(out[0, node].double(), want, **TOL[torch.float32])


def test_rows_are_independent(gen):
    q, k, v, parents, prefix = make_case(gen, batch=3, num_nodes=13, q_heads=4, kv_heads=2, head_dim=16, max_prefix=50)
    mask = tree_mask(parents)
    for backend in BACKENDS:
        full = tree_attention(q, k, v, mask, prefix, backend=backend)
        for b in range(3):
            alone = tree_attention(q[b : b + 1], k[b : b + 1], v[b : b + 1], mask[b : b + 1], prefix[b : b + 1], backend=backend)
            torch.testing.assert_close(full[b : b + 1], alone, atol=1e-6, rtol=1e-6)


def test_check_values_off_same_result(gen):
    q, k, v, parents, prefix = make_case(gen, batch=2, num_nodes=7, q_heads=2, kv_heads=1, head_dim=16)
    expected = tree_attention(q, k, v, tree_mask(parents), prefix)
    old = sk.config.check_values
    sk.config.check_values = False
    try:
        out = tree_attention(q, k, v, tree_mask(parents), prefix)
    finally:
        sk.config.check_values = old
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


def test_garbage_nan_outside_visible_region(gen):
    q, k, v, parents, prefix = make_case(gen, batch=2, num_nodes=5, q_heads=2, kv_heads=1, head_dim=16)
    k, v = _grow_cache(gen, k, v, k.shape[1] + 3)
    backends = BACKENDS + ["reference"]
    # Each backend against itself on the clean cache: backends may round differently.
    clean = [tree_attention(q, k, v, tree_mask(parents), prefix, backend=backend) for backend in backends]
    for b in range(2):
        end = int(prefix[b]) + 5
        k[b, end:] = float("nan")
        v[b, end:] = float("nan")
    for backend, want in zip(backends, clean):
        out = tree_attention(q, k, v, tree_mask(parents), prefix, backend=backend)
        torch.testing.assert_close(out, want, atol=0, rtol=0, msg=lambda m: f"backend={backend}: {m}")



def test_nan_in_tree_slot_nobody_sees(gen):
    """A tree key hidden from every query (not even itself) may hold NaN: it must not leak."""
    q, k, v, _, _ = make_case(gen, batch=2, num_nodes=6, q_heads=4, kv_heads=2, head_dim=16)
    prefix = torch.tensor([0, int(randint(gen, 1, 30))], dtype=torch.int32)
    k, v = _grow_cache(gen, k, v, int(prefix.max()) + 6)
    mask = tree_mask(torch.tensor([-1, 0, 1, 2, 3, 4]).expand(2, -1)).clone()
    mask[:, :, 4] = False  # every query still sees something: node 0 at least
    backends = BACKENDS + ["reference"]
    clean = [tree_attention(q, k, v, mask, prefix, backend=backend) for backend in backends]
    for b in range(2):
        k[b, int(prefix[b]) + 4] = float("nan")
        v[b, int(prefix[b]) + 4] = float("nan")
    for backend, want in zip(backends, clean):
        out = tree_attention(q, k, v, mask, prefix, backend=backend)
        torch.testing.assert_close(out, want, atol=0, rtol=0, msg=lambda m: f"backend={backend}: {m}")
        torch.testing.assert_close(out, clean[-1], **TOL_BACKEND[torch.float32])


def nan_cases(gen, batch=2, num_nodes=7, q_heads=4, kv_heads=2):
    """(name, q, k, v, which outputs must be NaN [B, T, Hq, D] bool) for NaN in q, a prefix key,
    a tree key, a tree value (one dim): NaN in, NaN out for the queries that see it, only them."""
    q, k, v, parents, prefix = make_case(gen, batch=batch, num_nodes=num_nodes, q_heads=q_heads, kv_heads=kv_heads,
                                         head_dim=16, kind="random", ragged=False, prefix=torch.tensor([5, 9]))
    mask = tree_mask(parents)
    group = q_heads // kv_heads
    cases = []
    nan_q, want = q.clone(), torch.zeros(*q.shape, dtype=torch.bool)
    nan_q[0, 2, 1, 5] = float("nan")
    want[0, 2, 1] = True
    cases.append(("q", nan_q, k, v, want))
    nan_k, want = k.clone(), torch.zeros(*q.shape, dtype=torch.bool)
    nan_k[1, 3, 0, 0] = float("nan")  # a prefix key of row 1, KV head 0: every query of that head group
    want[1, :, :group] = True
    cases.append(("prefix-k", q, nan_k, v, want))
    j = 3  # tree node 3 of row 0, KV head 1: the queries that have it as an ancestor (or are it)
    nan_k, want = k.clone(), torch.zeros(*q.shape, dtype=torch.bool)
    nan_k[0, 5 + j, 1, 7] = float("nan")
    want[0, mask[0, :, j], group:] = True
    cases.append(("tree-k", q, nan_k, v, want))
    nan_v, want = v.clone(), torch.zeros(*q.shape, dtype=torch.bool)
    nan_v[0, 5 + j, 0, 4] = float("nan")  # one value dim: only that dim of the queries that see node j
    want[0, mask[0, :, j], :group, 4] = True
    cases.append(("tree-v", q, k, nan_v, want))
    return mask, torch.tensor([5, 9], dtype=torch.int32), cases


def check_nan_in_nan_out(gen, backend, **kwargs):
    mask, prefix, cases = nan_cases(gen)
    for name, q, k, v, want in cases:
        clean = tree_attention(*[x.nan_to_num(0.0) for x in (q, k, v)], mask, prefix, backend=backend, **kwargs)
        out = tree_attention(q, k, v, mask, prefix, backend=backend, **kwargs)
        assert out.isnan()[want].all(), f"{name}: affected outputs must be NaN"
        assert not out.isnan()[~want].any(), f"{name}: NaN leaked into queries that do not see it"
        # Only the NaN itself changed (set to 0 in `clean`): unaffected queries that never saw it match.
        unaffected = ~want.flatten(2).any(-1)
        torch.testing.assert_close(out[unaffected], clean[unaffected], atol=0, rtol=0, msg=name)


def test_nan_in_nan_out_reference(gen):
    """The documented NaN contract, on the reference (issue 16)."""
    check_nan_in_nan_out(gen, "reference")


@pytest.mark.parametrize("threads", (1, 3))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16), ids=str)
def test_nonfinite_inputs_nan_where_reference_nan(gen, dtype, threads):
    """NaN or +-inf in q, k or v slots some query sees: every backend returns NaN for exactly
    the (row, node, head) outputs where the reference does, inf where it does, and matches it
    elsewhere. (A NaN or +inf score turns its query's softmax into NaN, inf - inf; an inf
    value gives inf, or NaN where its probability is 0.) Row 0's long prefix makes the CPU
    kernel split keys over threads when 3 are used, so the merge must keep NaN too."""
    num_nodes, heads, kv_heads = 9, 4, 2
    prefix = torch.tensor([int(randint(gen, 600, 900))] + [int(randint(gen, 0, 30)) for _ in range(6)])
    q, k, v, parents, prefix = make_case(gen, batch=7, num_nodes=num_nodes, q_heads=heads, kv_heads=kv_heads,
                                         head_dim=32, kind="bushy", dtype=dtype, prefix=prefix)
    mask = tree_mask(parents)
    nan, inf = float("nan"), float("inf")

    def node(b):  # a random non-root node of row b
        return int(randint(gen, 1, num_nodes))

    def key(b):  # a random prefix key of row b (the root's key when the prefix is empty)
        return int(randint(gen, 0, int(prefix[b]))) if int(prefix[b]) > 0 else int(prefix[b])

    q[0, node(0), 1, 5] = nan  # one query head
    k[0, key(0), 0, 3] = nan  # a prefix key: every query of KV head 0's group
    k[1, int(prefix[1]) + node(1), 1, 7] = inf  # a tree key: +inf or -inf scores, by q's sign
    q[2, node(2), 2, 0] = -inf  # +inf scores against keys with k[..., 0] < 0
    q[3, 0, 3, :] = 0.0
    k[3, int(prefix[3]), 1, 4] = inf  # 0 * inf at the root's query head 3
    v[4, key(4), 1, 2] = inf  # a visible value: inf outputs
    v[5, int(prefix[5]) + node(5), 0, 9] = nan  # a tree value: NaN also where its probability is 0
    k[6, : int(prefix[6]) + num_nodes, 0, 1] = -inf  # every score of some queries -inf
    ref = tree_attention(q, k, v, mask, prefix, backend="reference")
    assert ref.isnan().any() and (~ref.isnan()).any()  # the cases mean something
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for backend in BACKENDS:
            out = tree_attention(q, k, v, mask, prefix, backend=backend)
            where = f"backend={backend}"
            # Non-finite exactly where the reference is. NaN vs +-inf may differ only for an inf
            # value a query sees (the reference counts it as NaN, the CPU kernel gives IEEE's inf).
            # Known CPU-kernel limitation (documented in tree_attention): a NaN tree value also
            # reaches the queries of its row and KV head that do not see it (0 * NaN in the tree
            # tile), so row 5 must be non-finite at least where the reference is.
            got, want = ~out.isfinite(), ~ref.isfinite()
            leak = torch.zeros_like(want)
            leak[5] = True
            # Row 4 (an inf value): where a query's weight on it underflows to 0, 0 * inf is NaN in
            # one backend and skipped in another, so only its finite outputs are compared.
            leak[4] = True
            assert torch.equal(got & ~leak, want & ~leak), f"{where}: non-finite differs at {(got != want).nonzero()[:8].tolist()}"
            assert not (want[5] & ~got[5]).any(), f"{where}: finite where the reference is not"
            inf_value_rows = torch.zeros_like(want)
            inf_value_rows[4] = inf_value_rows[5] = True
            nan_got, nan_want = out.isnan() & ~inf_value_rows, ref.isnan() & ~inf_value_rows
            assert torch.equal(nan_got, nan_want), f"{where}: NaN differs at {(nan_got != nan_want).nonzero()[:8].tolist()}"
            finite = ref.isfinite() & out.isfinite()
            torch.testing.assert_close(out[finite], ref[finite], **TOL_BACKEND[dtype], msg=lambda m: f"{where}: {m}")
            assert torch.equal(out[ref.isinf()], ref[ref.isinf()]), where
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("threads", (1, 3))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16), ids=str)
def test_long_prefix_many_nodes(gen, dtype, threads):
    """Prefixes over a thousand keys and up to 128 nodes (packed masks of two words), HF
    views. With 3 threads and 2 (row, KV head) units, the CPU kernel splits each row's keys
    into ranges on different threads and merges them by log-sum-exp; the short row leaves
    its last ranges empty."""
    prefix = torch.tensor([int(randint(gen, 1100, 1600)), int(randint(gen, 0, 40))])
    q, k, v, parents, prefix = make_case(
        gen, batch=2, num_nodes=int(randint(gen, 65, 129)), q_heads=3, kv_heads=1, head_dim=32, dtype=dtype,
        prefix=prefix, hf_layout=True,
    )
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        check_all(q, k, v, pack_tree_mask(tree_mask(parents)), parents, prefix, gen=gen)
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("threads", (1, 2, 3, 4))
@pytest.mark.parametrize("batch, num_nodes", [(1, 1), (1, 6), (2, 6), (3, 1), (8, 3), (1, 70)])
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_decode_shapes_every_split(gen, dtype, batch, num_nodes, threads):
    """The default model's attention shapes (9 query heads, 3 KV heads, D 64) at decode and
    verify sizes over prefixes up to ~800: the CPU kernel's tasks then take every KV head of a
    row together (one contiguous read per tile) or, for 70 nodes or a short single row, one
    (row, KV head) each, with each row's keys cut into ranges where the rows alone leave threads
    idle; every combination must give the same attention."""
    prefix = randint(gen, 0, 800, (batch,))
    prefix[0] = int(randint(gen, 300, 800))  # long enough to be split into ranges
    if batch > 1:
        prefix[-1] = int(randint(gen, 0, 5))  # a short row: its later ranges are empty
    q, k, v, parents, prefix = make_case(gen, batch=batch, num_nodes=num_nodes, q_heads=9, kv_heads=3, head_dim=64,
                                         dtype=dtype, prefix=prefix, hf_layout=batch % 2 == 0)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        check_all(q, k, v, pack_tree_mask(tree_mask(parents)), parents, prefix, gen=gen, branch=False)
    finally:
        torch.set_num_threads(old)


def chain_case(gen, *, batch, num_nodes, max_prefix, q_heads=9, kv_heads=3, head_dim=64, dtype=torch.float32):
    """make_case's inputs for rows that are all causal chains of num_nodes nodes (a prefill
    chunk), one row's prefix empty."""
    prefix = randint(gen, 0, max_prefix + 1, (batch,))
    prefix[0] = 0
    q, k, v, _, prefix = make_case(gen, batch=batch, num_nodes=num_nodes, q_heads=q_heads, kv_heads=kv_heads,
                                   head_dim=head_dim, dtype=dtype, prefix=prefix)
    parents = torch.arange(-1, num_nodes - 1).expand(batch, num_nodes).contiguous()
    return q, k, v, parents, prefix


def chain_masks(batch, num_nodes):
    """{form: the causal chain's mask}: bool and packed, shared by the rows or one per row, and
    packed with junk in the bits past T of its last word (not part of the mask)."""
    chain = torch.ones(num_nodes, num_nodes, dtype=torch.bool).tril()
    packed = pack_tree_mask(chain)
    junk = packed.clone()
    spare = packed.shape[-1] * 64 - num_nodes
    if spare:
        junk[:, -1] |= -(1 << (64 - spare))  # every bit past T set (a negative int64)
    return {"bool": chain, "bool_rows": chain.expand(batch, -1, -1).contiguous(), "packed": packed,
            "packed_rows": packed.expand(batch, -1, -1).contiguous(), "packed_junk_bits": junk}


@pytest.mark.parametrize("threads", (1, 2, 3))
@pytest.mark.parametrize("num_nodes, max_prefix", [(1, 30), (17, 40), (64, 0), (65, 200), (150, 0), (320, 330)])
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_causal_chains(gen, dtype, num_nodes, max_prefix, threads):
    """Masks that are causal chains (the prefill's chunks, chain drafts): the CPU kernel
    recognises them, skips the queries before each tile's first tree key (lane offsets of 16
    inside groups of 3 query heads) and splits a row's keys over threads by work rather than
    by count. Every form of the chain's mask, rows with and without a prefix, against the
    brute force and the reference."""
    q, k, v, parents, prefix = chain_case(gen, batch=2, num_nodes=num_nodes, max_prefix=max_prefix, dtype=dtype)
    expected = brute_attention(q, k, v, parents, prefix)
    ref = tree_attention(q, k, v, tree_mask(parents), prefix, backend="reference")
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for form, mask in chain_masks(2, num_nodes).items():
            for backend in BACKENDS:
                out = tree_attention(q, k, v, mask, prefix, backend=backend)
                where = f"backend={backend}, {form}"
                torch.testing.assert_close(out.double(), expected, **TOL[dtype], msg=lambda m: f"{where}: {m}")
                torch.testing.assert_close(out, ref, **TOL_BACKEND[dtype], msg=lambda m: f"{where} vs reference: {m}")
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("window, softcap", [(3, None), (40, 20.0), (None, 5.0)])
@pytest.mark.parametrize("threads", (1, 2))
def test_causal_chains_window_softcap(gen, window, softcap, threads):
    """Causal chains with a sliding window (inside the chain and reaching into the prefix) and
    soft-capping, against the brute force."""
    q, k, v, parents, prefix = chain_case(gen, batch=3, num_nodes=100, max_prefix=150, q_heads=6, kv_heads=2,
                                          head_dim=32)
    expected = brute_attention(q, k, v, parents, prefix, window=window, softcap=softcap)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for form, mask in chain_masks(3, 100).items():
            for backend in BACKENDS + ["reference"]:
                out = tree_attention(q, k, v, mask, prefix, window=window, softcap=softcap, backend=backend)
                torch.testing.assert_close(out.double(), expected, **TOL[torch.float32],
                                           msg=lambda m: f"backend={backend}, {form}: {m}")
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("change", ("hide_ancestor", "show_later_node", "one_row_not_a_chain"))
def test_masks_one_bit_from_a_chain(gen, change):
    """A mask one bit away from a causal chain is not one: it runs the general path, and every
    backend matches the reference on it (the reference reads any mask)."""
    num_nodes = 130
    q, k, v, _, prefix = chain_case(gen, batch=2, num_nodes=num_nodes, max_prefix=100)
    mask = torch.ones(num_nodes, num_nodes, dtype=torch.bool).tril().expand(2, -1, -1).clone()
    if change == "hide_ancestor":
        mask[:, 100, 70] = False
    elif change == "show_later_node":
        mask[:, 3, 90] = True
    else:
        mask[1, 120, 64] = False
    ref = tree_attention(q, k, v, mask, prefix, backend="reference")
    for backend in BACKENDS:
        for m in (mask, pack_tree_mask(mask)):
            out = tree_attention(q, k, v, m, prefix, backend=backend)
            torch.testing.assert_close(out, ref, **TOL_BACKEND[torch.float32], msg=lambda e: f"backend={backend}: {e}")


# ----------------------------------------------------------------------------- bad input


def good_inputs(batch=2, num_nodes=4, q_heads=4, kv_heads=2, head_dim=8, cache_len=12):
    return dict(
        q=torch.randn(batch, num_nodes, q_heads, head_dim),
        k_cache=torch.randn(batch, cache_len, kv_heads, head_dim),
        v_cache=torch.randn(batch, cache_len, kv_heads, head_dim),
        tree_mask=tree_mask(torch.tensor([-1, 0, 0, 1]).expand(batch, -1)),
        cache_seqlens=torch.tensor([3, 8], dtype=torch.int32)[:batch],
    )


def _noncontig_last(x):
    """Same shape, last-dim stride 2."""
    wide = torch.zeros(*x.shape[:-1], 2 * x.shape[-1], dtype=x.dtype)
    return wide[..., ::2]


BAD_INPUTS = [
    ("q", "not_tensor", lambda a: a.update(q=a["q"].tolist())),
    ("q", "3d", lambda a: a.update(q=a["q"][0])),
    ("q", "int", lambda a: a.update(q=a["q"].to(torch.int32))),
    ("q", "float64", lambda a: a.update(q=a["q"].double())),
    ("q", "last_dim_stride", lambda a: a.update(q=_noncontig_last(a["q"]))),
    ("q", "empty_batch", lambda a: a.update(q=a["q"][:0], k_cache=a["k_cache"][:0], v_cache=a["v_cache"][:0],
                                            tree_mask=a["tree_mask"][:0], cache_seqlens=a["cache_seqlens"][:0])),
    ("k_cache", "3d", lambda a: a.update(k_cache=a["k_cache"][0])),
    ("k_cache", "dtype", lambda a: a.update(k_cache=a["k_cache"].half())),
    ("k_cache", "batch", lambda a: a.update(k_cache=a["k_cache"][:1])),
    ("k_cache", "head_dim", lambda a: a.update(k_cache=a["k_cache"][..., :4])),
    ("k_cache", "gqa_ratio", lambda a: a.update(k_cache=torch.randn(2, 12, 3, 8), v_cache=torch.randn(2, 12, 3, 8))),
    ("k_cache", "zero_heads", lambda a: a.update(k_cache=torch.randn(2, 12, 0, 8), v_cache=torch.randn(2, 12, 0, 8))),
    ("k_cache", "last_dim_stride", lambda a: a.update(k_cache=_noncontig_last(a["k_cache"]))),
    ("k_cache", "device", lambda a: a.update(k_cache=a["k_cache"].to("meta"))),
    ("v_cache", "3d", lambda a: a.update(v_cache=a["v_cache"][0])),
    ("v_cache", "dtype", lambda a: a.update(v_cache=a["v_cache"].bfloat16())),
    ("v_cache", "shape_s", lambda a: a.update(v_cache=a["v_cache"][:, :11])),
    ("v_cache", "shape_h", lambda a: a.update(v_cache=torch.randn(2, 12, 4, 8))),
    ("v_cache", "last_dim_stride", lambda a: a.update(v_cache=_noncontig_last(a["v_cache"]))),
    ("v_cache", "device", lambda a: a.update(v_cache=a["v_cache"].to("meta"))),
    ("tree_mask", "dtype_int32", lambda a: a.update(tree_mask=a["tree_mask"].to(torch.int32))),
    ("tree_mask", "dtype_float", lambda a: a.update(tree_mask=a["tree_mask"].float())),
    ("tree_mask", "4d", lambda a: a.update(tree_mask=a["tree_mask"][None])),
    ("tree_mask", "1d", lambda a: a.update(tree_mask=a["tree_mask"][0, 0])),
    ("tree_mask", "cols", lambda a: a.update(tree_mask=torch.ones(2, 4, 5, dtype=torch.bool))),
    ("tree_mask", "rows", lambda a: a.update(tree_mask=torch.ones(2, 3, 4, dtype=torch.bool))),
    ("tree_mask", "batch", lambda a: a.update(tree_mask=torch.ones(3, 4, 4, dtype=torch.bool))),
    ("tree_mask", "shared_shape", lambda a: a.update(tree_mask=torch.ones(5, 5, dtype=torch.bool))),
    ("tree_mask", "packed_words", lambda a: a.update(tree_mask=torch.ones(2, 4, 2, dtype=torch.int64))),
    ("tree_mask", "packed_bool_words", lambda a: a.update(tree_mask=torch.ones(2, 4, 1, dtype=torch.bool))),
    ("tree_mask", "device", lambda a: a.update(tree_mask=a["tree_mask"].to("meta"))),
    ("cache_seqlens", "int16", lambda a: a.update(cache_seqlens=a["cache_seqlens"].to(torch.int16))),
    ("cache_seqlens", "float", lambda a: a.update(cache_seqlens=a["cache_seqlens"].float())),
    ("cache_seqlens", "2d", lambda a: a.update(cache_seqlens=a["cache_seqlens"][None])),
    ("cache_seqlens", "shape", lambda a: a.update(cache_seqlens=torch.tensor([1, 2, 3], dtype=torch.int32))),
    ("cache_seqlens", "overflow", lambda a: a.update(cache_seqlens=torch.tensor([3, 9], dtype=torch.int32))),
    ("cache_seqlens", "negative", lambda a: a.update(cache_seqlens=torch.tensor([-1, 2], dtype=torch.int32))),
    ("cache_seqlens", "device", lambda a: a.update(cache_seqlens=a["cache_seqlens"].to("meta"))),
]


@pytest.mark.parametrize("name, case, mutate", BAD_INPUTS, ids=[f"{n}-{c}" for n, c, _ in BAD_INPUTS])
def test_bad_input(name, case, mutate):
    args = good_inputs()
    tree_attention(**args)  # the unmodified inputs are fine
    mutate(args)
    with pytest.raises(ValueError, match=f"^{name}:"):
        tree_attention(**args)


@pytest.mark.parametrize("backend", BACKENDS + ["reference"])
def test_int64_cache_seqlens(gen, backend):
    """int64 cache_seqlens (what compact_kv_cache_ returns for int64 input) work like int32 (issue 16)."""
    args = good_inputs()
    want = tree_attention(**args, backend=backend)
    args["cache_seqlens"] = args["cache_seqlens"].long()
    got = tree_attention(**args, backend=backend)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_hf_layout_cache_gets_a_transpose_hint():
    """A Hugging Face [B, H, S, D] cache passed without .transpose(1, 2) (issue 16): the error
    says so, whether the head counts clash or happen to fit and the "sequence" is too short."""
    batch, num_nodes, head_dim = 1, 3, 16
    mask, prefix = tree_mask(torch.tensor([-1, 0, 1])), torch.tensor([20], dtype=torch.int32)
    for q_heads, kv_heads in ((4, 2), (32, 8), (8, 8)):
        q = torch.randn(batch, num_nodes, q_heads, head_dim)
        k = torch.randn(batch, kv_heads, 32, head_dim)  # [B, H, S, D]
        # 32 query heads over 8: "32 KV heads" fit, and the 8-long "sequence" is what fails.
        name = "cache_seqlens" if q_heads % 32 == 0 else "k_cache"
        with pytest.raises(ValueError, match=rf"^{name}:.*k_cache.transpose\(1, 2\)"):
            tree_attention(q, k, k, mask, prefix)
        # As a view it works (the documented way).
        assert tree_attention(q, k.transpose(1, 2), k.transpose(1, 2), mask, prefix).shape == q.shape
    q = torch.randn(batch, 4, num_nodes, head_dim)  # q in HF layout too: [B, Hq, T, D]
    k = torch.randn(batch, 32, 1, head_dim)  # a proper [B, S, Hkv, D] cache
    with pytest.raises(ValueError, match=r"^tree_mask:.*q.transpose\(1, 2\)"):
        tree_attention(q, k, k, mask, prefix)


def test_no_transpose_hint_for_other_head_mismatches():
    args = good_inputs()  # q heads 4
    args["k_cache"] = args["v_cache"] = torch.randn(2, 12, 3, 8)  # 3 KV heads, S = 12: not a layout mix-up
    with pytest.raises(ValueError, match="^k_cache:") as error:
        tree_attention(**args)
    assert "transpose" not in str(error.value)


def test_cache_exactly_full_is_fine():
    args = good_inputs()
    args["cache_seqlens"] = torch.tensor([8, 0], dtype=torch.int32)  # 8 + T=4 == S=12
    out = tree_attention(**args)
    assert out.shape == args["q"].shape and torch.isfinite(out).all()


def test_zero_nodes():
    args = good_inputs()
    args["q"] = args["q"][:, :0]
    args["tree_mask"] = args["tree_mask"][:, :0, :0]
    with pytest.raises(ValueError, match="^q:"):
        tree_attention(**args)


# ----------------------------------------------------------------------------- window, softcap, Dv


def with_value_dim(gen, v, value_dim, prefix, num_nodes):
    """v with its head dim replaced by value_dim (fresh values, garbage past the tree)."""
    shape = v.shape[:3] + (value_dim,)
    new = torch.randn(shape, generator=gen).to(v.dtype)
    for b in range(v.shape[0]):
        new[b, int(prefix[b]) + num_nodes:] = 1e3
    return new


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window, softcap, value_dim", [
    (1, None, None), (3, None, 24), (7, 0.5, None), (40, None, None), (10_000, 30.0, 24), (None, 0.5, None),
    (None, None, 24), (2, 30.0, 8),
])
def test_window_softcap_value_dim(gen, dtype, window, softcap, value_dim):
    """Every backend against the brute force with a sliding window (smaller than the tree's
    depth, than the prefix, or larger than everything), soft-capping (tight and loose) and a
    value head dim != the key head dim; ragged prefixes, GQA, deep and bushy trees, bf16 and fp32."""
    for kind, num_nodes, heads, head_dim in (("random", 12, (4, 2), 32), ("chain", 9, (6, 3), 16), ("bushy", 20, (2, 1), 40)):
        q, k, v, parents, prefix = make_case(gen, batch=3, num_nodes=num_nodes, q_heads=heads[0], kv_heads=heads[1],
                                             head_dim=head_dim, kind=kind, dtype=dtype, max_prefix=30)
        if value_dim is not None:
            v = with_value_dim(gen, v, value_dim, prefix, num_nodes)
        mask = tree_mask(parents)
        expected = brute_attention(q, k, v, parents, prefix, window=window, softcap=softcap)
        ref = tree_attention(q, k, v, mask, prefix, window=window, softcap=softcap, backend="reference")
        assert ref.shape == q.shape[:3] + (v.shape[3],) and ref.dtype == dtype
        torch.testing.assert_close(ref.double(), expected, **TOL[dtype])
        for backend in BACKENDS:
            for m in (mask, pack_tree_mask(mask)):
                out = tree_attention(q, k, v, m, prefix, window=window, softcap=softcap, backend=backend)
                assert out.shape == ref.shape and out.dtype == dtype, backend
                torch.testing.assert_close(out.double(), expected, **TOL[dtype], msg=lambda e: f"backend={backend}: {e}")
                torch.testing.assert_close(out, ref, **TOL_BACKEND[dtype], msg=lambda e: f"backend={backend} vs reference: {e}")


@pytest.mark.parametrize("threads", [1, 2])
def test_window_long_prefix_split_keys(gen, threads):
    """A long prefix split across threads (the CPU kernel's partial results): the window's first
    key moves the ranges; softcap and Dv ride along."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        q, k, v, parents, prefix = make_case(gen, batch=1, num_nodes=16, q_heads=2, kv_heads=1, head_dim=32,
                                             kind="random", prefix=torch.tensor([900]))
        v = with_value_dim(gen, v, 16, prefix, 16)
        for window in (5, 300, 2000):
            expected = brute_attention(q, k, v, parents, prefix, window=window, softcap=20.0)
            for backend in BACKENDS + ["reference"]:
                out = tree_attention(q, k, v, tree_mask(parents), prefix, window=window, softcap=20.0, backend=backend)
                torch.testing.assert_close(out.double(), expected, **TOL[torch.float32], msg=lambda e: f"{backend}: {e}")
    finally:
        torch.set_num_threads(old)


def test_window_keys_outside_are_never_read(gen):
    """NaN in prefix keys and values outside every query's window changes nothing."""
    q, k, v, parents, prefix = make_case(gen, batch=2, num_nodes=6, q_heads=2, kv_heads=2, head_dim=16,
                                         kind="chain", prefix=torch.tensor([30, 20]))
    mask = tree_mask(parents)
    for backend in BACKENDS + ["reference"]:
        clean = tree_attention(q, k, v, mask, prefix, window=4, backend=backend)
        k2, v2 = k.clone(), v.clone()
        for b in range(2):
            k2[b, : int(prefix[b]) - 3] = float("nan")
            v2[b, : int(prefix[b]) - 3] = float("nan")
        out = tree_attention(q, k2, v2, mask, prefix, window=4, backend=backend)
        torch.testing.assert_close(out, clean, atol=0, rtol=0, msg=lambda e: f"{backend}: {e}")


@pytest.mark.parametrize("name, kwargs", [
    ("window", dict(window=0)), ("window", dict(window=-3)), ("window", dict(window=2.5)), ("window", dict(window=True)),
    ("softcap", dict(softcap=0.0)), ("softcap", dict(softcap=-1.0)), ("softcap", dict(softcap=float("inf"))),
    ("v_cache", dict(v_heads=3)),
])
def test_bad_window_softcap_value_cache(gen, name, kwargs):
    q, k, v, parents, prefix = make_case(gen, batch=2, num_nodes=4, q_heads=2, kv_heads=1, head_dim=16)
    if "v_heads" in kwargs:
        v = torch.zeros(v.shape[0], v.shape[1], kwargs.pop("v_heads"), 8)
    with pytest.raises(ValueError, match=name):
        tree_attention(q, k, v, tree_mask(parents), prefix, **kwargs)


@pytest.mark.skipif(platform.machine() != "x86_64" or "cpu" not in sk.available_backends("tree_attention", "cpu"),
                    reason="the CPU kernel's block layouts are x86-64 code paths")
@pytest.mark.skipif(bool(os.environ.get("SPECDEC_TREE_ATTENTION_BLOCKS")), reason="inside a forced run already")
@pytest.mark.parametrize("blocks", ["narrow", "wide"])
def test_cpu_block_layouts(blocks):
    """The CPU kernel has two block layouts (`narrow_vectors` in include/specdec/tree_attention.h:
    8-float blocks where the CPU lacks AVX-512, 16-float blocks where it has it); a machine
    runs one, so the other is reached through SPECDEC_TREE_ATTENTION_BLOCKS: this file's
    shape, dtype, window and long-prefix cases and the paged kernel's, in a subprocess under each."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, SPECDEC_TREE_ATTENTION_BLOCKS=blocks)
    cases = ("tree_shapes or gqa_and_head_dims or dtypes_and_layouts or long_prefix_many_nodes or "
             "window_softcap_value_dim or mask_forms or attention_matches_dense or attention_window_softcap")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:warnings", "-p", "no:cacheprovider",
                          "python_tests/test_tree_attention.py", "python_tests/test_paged.py", "-k", cases],
                         cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout
