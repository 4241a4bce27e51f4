"""The CUDA tree_attention kernels (csrc/include/specdec/tree_attention.cuh) against the reference
and the float64 oracles of test_tree_attention.py.

Covers both paths of the CUDA op: the tensor-core kernel (bf16 / fp16, head dims 64 / 128 /
256, 16-byte aligned rows; split-KV with a combine kernel when the cache is long) and the
fallback kernel (fp32, other head dims, unaligned views). Everything here needs a GPU and an
extension built with the CUDA kernels (torch with CUDA and nvcc at build time); it skips otherwise.
"""

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels import pack_tree_mask, tree_attention, tree_mask

from conftest import TREE_KINDS, cuda_kernel_marks, randint, tree_parents
from test_tree_attention import TOL, brute_attention, branch_oracle

pytestmark = cuda_kernel_marks("tree_attention", "tree_mask", "pack_tree_mask")

# Against the reference (fp32 math on the same rounded inputs, output rounded once): the
# tensor-core kernel also rounds P to the input dtype before P @ V, like flash attention.
TOL_VS_REFERENCE = {
    torch.float32: dict(atol=2e-5, rtol=1e-4),
    torch.float16: TOL[torch.float16],
    torch.bfloat16: TOL[torch.bfloat16],
}
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def gpu_case(gen, *, batch, num_nodes, q_heads, kv_heads, head_dim, dtype, max_prefix=None, prefix=None,
             kind="random", hf=False, garbage=float("nan"), ragged=True, shared_tree=False):
    """CUDA inputs (random on the GPU, seeded from `gen`); slots past each row's tree hold `garbage`."""
    parents = tree_parents(gen, batch, num_nodes, kind, ragged, shared_tree)
    if prefix is None:
        prefix = randint(gen, 0, max_prefix + 1, (batch,))
        prefix[0] = max_prefix  # one row at the limit, one empty or tiny, the others anywhere
        if batch > 1:
            prefix[1] = int(randint(gen, 0, 2))
    prefix = torch.as_tensor(prefix, dtype=torch.int32)
    cache_len = int(prefix.max()) + num_nodes + int(randint(gen, 0, 9))
    cuda_gen = torch.Generator(device="cuda").manual_seed(int(randint(gen, 0, 2**31)))

    def randn(*shape):
        return torch.randn(*shape, generator=cuda_gen, device="cuda").to(dtype)

    if hf:  # HF caches are [B, H, S, D]: the op takes [B, S, H, D] views of them
        k = randn(batch, kv_heads, cache_len, head_dim).transpose(1, 2)
        v = randn(batch, kv_heads, cache_len, head_dim).transpose(1, 2)
        q = randn(batch, q_heads, num_nodes, head_dim).transpose(1, 2)
    else:
        k = randn(batch, cache_len, kv_heads, head_dim)
        v = randn(batch, cache_len, kv_heads, head_dim)
        q = randn(batch, num_nodes, q_heads, head_dim)
    for b in range(batch):
        end = int(prefix[b]) + num_nodes
        k[b, end:] = garbage
        v[b, end:] = garbage
    return q, k, v, parents, prefix.cuda()


def check_vs_reference(q, k, v, mask, prefix, *, scale=None):
    out = tree_attention(q, k, v, mask, prefix, scale=scale, backend="cuda")
    ref = tree_attention(q, k, v, mask, prefix, scale=scale, backend="reference")
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous() and out.device == q.device
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, **TOL_VS_REFERENCE[q.dtype])
    return out


def check_vs_oracles(q, k, v, parents, prefix, out, *, scale=None, gen=None):
    """Against the float64 brute force and the per-branch oracle (every real node), on the CPU."""
    qc, kc, vc, pc = q.cpu(), k.cpu(), v.cpu(), prefix.cpu()
    expected = brute_attention(qc, kc, vc, parents, pc, scale)
    torch.testing.assert_close(out.cpu().double(), expected, **TOL[q.dtype])
    oracle = branch_oracle(qc, kc, vc, parents, pc, scale, nodes_per_row=10**9, gen=gen)
    for (b, node), want in oracle.items():
        torch.testing.assert_close(out[b, node].cpu().double(), want, **TOL[q.dtype])


# ----------------------------------------------------------------------------- tensor-core path


@pytest.mark.parametrize("num_nodes", (1, 2, 17, 64, 65, 128))
@pytest.mark.parametrize("kind", TREE_KINDS)
def test_tree_kinds_and_sizes(gen, kind, num_nodes):
    q, k, v, parents, prefix = gpu_case(gen, batch=3, num_nodes=num_nodes, q_heads=8, kv_heads=2, head_dim=128,
                                        dtype=torch.bfloat16, max_prefix=300, kind=kind)
    out = check_vs_reference(q, k, v, tree_mask(parents.cuda()), prefix)
    if num_nodes <= 17:
        check_vs_oracles(q, k, v, parents, prefix, out, gen=gen)


@pytest.mark.parametrize("hf", (False, True), ids=("bshd", "hf_views"))
@pytest.mark.parametrize("q_heads, kv_heads", [(8, 8), (16, 4), (32, 4)], ids=("mha", "gqa4", "gqa8"))
@pytest.mark.parametrize("head_dim", (64, 128, 256))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dtypes_head_dims_gqa(gen, dtype, head_dim, q_heads, kv_heads, hf):
    q, k, v, parents, prefix = gpu_case(gen, batch=3, num_nodes=int(randint(gen, 1, 41)), q_heads=q_heads,
                                        kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, max_prefix=700, hf=hf)
    if hf:  # a one-node tree's [B, H, 1, D] query is contiguous either way: only k is a strided view then
        assert (q.shape[1] == 1 or not q.is_contiguous()) and not k.is_contiguous() and k.stride(-1) == 1
    check_vs_reference(q, k, v, pack_tree_mask(tree_mask(parents.cuda())), prefix)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_small_cases_against_oracles(gen, dtype):
    for head_dim, kind in ((64, "chain"), (128, "star"), (256, "random")):
        q, k, v, parents, prefix = gpu_case(gen, batch=2, num_nodes=int(randint(gen, 1, 20)), q_heads=4, kv_heads=2,
                                            head_dim=head_dim, dtype=dtype, max_prefix=90, kind=kind)
        out = check_vs_reference(q, k, v, tree_mask(parents.cuda()), prefix)
        check_vs_oracles(q, k, v, parents, prefix, out, gen=gen)


@pytest.mark.parametrize(
    "batch, num_nodes, q_heads, kv_heads, head_dim, max_prefix",
    [
        (4, 64, 32, 8, 128, 16384),  # the target shape with a 16k row: several KV splits
        (2, 1, 32, 8, 128, 16384),  # plain decode (T = 1): many splits, 4 rows per CTA
        (3, 16, 16, 2, 256, 8000),  # D = 256
        (2, 128, 64, 8, 64, 4000),  # 1024 rows per KV head: 8 row tiles
        (3, 5, 8, 8, 128, 0),  # every prefix empty: only the tree
        (2, 33, 28, 4, 128, 1000),  # GQA 7: row tiles cut through a node's heads
    ],
)
@pytest.mark.parametrize("packed", (False, True), ids=("bool", "packed"))
def test_long_and_ragged_prefixes(gen, packed, batch, num_nodes, q_heads, kv_heads, head_dim, max_prefix):
    for dtype in (torch.bfloat16, torch.float16):
        q, k, v, parents, prefix = gpu_case(gen, batch=batch, num_nodes=num_nodes, q_heads=q_heads, kv_heads=kv_heads,
                                            head_dim=head_dim, dtype=dtype, max_prefix=max_prefix)
        mask = tree_mask(parents.cuda())
        check_vs_reference(q, k, v, pack_tree_mask(mask) if packed else mask, prefix)


@pytest.mark.parametrize("num_nodes", (3, 64, 65, 128))
def test_mask_forms_give_identical_results(gen, num_nodes):
    q, k, v, parents, prefix = gpu_case(gen, batch=3, num_nodes=num_nodes, q_heads=8, kv_heads=2, head_dim=64,
                                        dtype=torch.bfloat16, max_prefix=200, shared_tree=True)
    dense = tree_mask(parents.cuda())
    shared = tree_mask(parents[0].cuda())  # [T, T]
    forms = {
        "bool": dense,
        "bool_shared": shared,
        "bool_expanded": shared.expand(3, -1, -1),
        "packed": pack_tree_mask(dense),
        "packed_shared": pack_tree_mask(shared),
        "packed_expanded": pack_tree_mask(shared).expand(3, -1, -1),
        "bool_strided": torch.zeros(3, num_nodes, 2 * num_nodes, dtype=torch.bool, device="cuda")[:, :, ::2].copy_(dense),
    }
    base = check_vs_reference(q, k, v, dense, prefix)
    for name, mask in forms.items():
        out = tree_attention(q, k, v, mask, prefix, backend="cuda")
        torch.testing.assert_close(out, base, atol=0, rtol=0, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nan_garbage_outside_visible_region(gen, dtype):
    """Slots past L + T (and a cache longer than needed) never reach the output, NaN included."""
    case = dict(batch=3, num_nodes=37, q_heads=16, kv_heads=4, head_dim=128, dtype=dtype, max_prefix=3000)
    seed = int(randint(gen, 0, 2**31))
    outs = []
    for garbage in (0.0, float("nan"), float("inf")):
        q, k, v, parents, prefix = gpu_case(torch.Generator().manual_seed(seed), garbage=garbage, **case)
        outs.append(check_vs_reference(q, k, v, tree_mask(parents.cuda()), prefix))
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], atol=0, rtol=0)


def test_mask_without_some_columns_zeroes_unseen_tree_values(gen):
    """A tree value nobody may see is NaN: it must not leak (the kernel zeroes such rows)."""
    q, k, v, parents, prefix = gpu_case(gen, batch=2, num_nodes=9, q_heads=8, kv_heads=2, head_dim=128,
                                        dtype=torch.bfloat16, max_prefix=100)
    mask = tree_mask(parents.cuda()).clone()
    mask[:, :, 4] = False  # node 4's key is visible to no query (not even itself)
    mask[:, 4, 0] = True  # node 4 still sees the root
    for b in range(2):
        v[b, int(prefix[b]) + 4] = float("nan")
    check_vs_reference(q, k, v, mask, prefix)


@pytest.mark.parametrize("head_dim", (128, 80), ids=("tensor-core", "fallback"))
@pytest.mark.parametrize("num_nodes", (1, 9))
def test_nan_in_nan_out_with_a_split_prefix(gen, num_nodes, head_dim):
    """NaN in a query, NaN in a prefix key, and a query whose every score is -inf give NaN
    exactly where the reference does, also when a 16k prefix is split over several CTAs and
    merged (a split whose sum is NaN must not be dropped by the merge, and a row with no
    weight anywhere is NaN, not 0); the other outputs match the reference."""
    nan, inf = float("nan"), float("inf")
    q, k, v, parents, prefix = gpu_case(gen, batch=3, num_nodes=num_nodes, q_heads=32, kv_heads=8, head_dim=head_dim,
                                        dtype=torch.bfloat16, prefix=[16385, 700, 0])
    mask = tree_mask(parents.cuda())
    q[0, 0, 5, 3] = nan  # one query head of row 0 (its 16k prefix is split)
    k[1, 100, 2, 7] = nan  # a prefix key: every query of KV head 2 in row 1
    k[2, :num_nodes, 1, 0] = -inf  # row 2 has no prefix: KV head 1's queries see only -inf scores ...
    q[2, :, 4:8, 0] = 1.0  # ... as their q[..., 0] > 0 (heads 4..7 share KV head 1)
    out = tree_attention(q, k, v, mask, prefix, backend="cuda")
    ref = tree_attention(q, k, v, mask, prefix, backend="reference")
    want = ref.isnan()
    assert want[0, 0, 5].all() and want[1, :, 8:12].all() and want[2, :, 4:8].all()  # the cases mean something
    assert torch.equal(out.isnan(), want), f"NaN differs at {(out.isnan() != want).nonzero()[:8].tolist()}"
    torch.testing.assert_close(out[~want], ref[~want], **TOL_VS_REFERENCE[torch.bfloat16])


@pytest.mark.parametrize("scale", (0.05, 1.0, -0.3))
def test_custom_scale(gen, scale):
    q, k, v, parents, prefix = gpu_case(gen, batch=2, num_nodes=11, q_heads=8, kv_heads=4, head_dim=64,
                                        dtype=torch.float16, max_prefix=500)
    check_vs_reference(q, k, v, tree_mask(parents.cuda()), prefix, scale=scale)


def test_rows_are_independent(gen):
    q, k, v, parents, prefix = gpu_case(gen, batch=3, num_nodes=13, q_heads=8, kv_heads=2, head_dim=128,
                                        dtype=torch.bfloat16, max_prefix=2000)
    mask = tree_mask(parents.cuda())
    full = tree_attention(q, k, v, mask, prefix, backend="cuda")
    for b in range(3):
        alone = tree_attention(q[b : b + 1], k[b : b + 1], v[b : b + 1], mask[b : b + 1], prefix[b : b + 1],
                               backend="cuda")
        # Fewer rows may mean more KV splits (a different summation order), hence not bitwise.
        torch.testing.assert_close(full[b : b + 1], alone, **TOL_VS_REFERENCE[torch.bfloat16])


# ----------------------------------------------------------------------------- fallback path


@pytest.mark.parametrize("head_dim", (16, 80, 96, 200))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_other_head_dims_use_the_fallback(gen, dtype, head_dim):
    q, k, v, parents, prefix = gpu_case(gen, batch=2, num_nodes=int(randint(gen, 1, 30)), q_heads=6, kv_heads=3,
                                        head_dim=head_dim, dtype=dtype, max_prefix=400)
    check_vs_reference(q, k, v, tree_mask(parents.cuda()), prefix)


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
def test_unaligned_views_use_the_fallback(gen, dtype):
    """Rows that are not 16-byte aligned (a slice 4 elements into each head) cannot take cp.async."""
    q, k, v, parents, prefix = gpu_case(gen, batch=2, num_nodes=7, q_heads=4, kv_heads=2, head_dim=132,
                                        dtype=dtype, max_prefix=300)
    q, k, v = q[..., 4:], k[..., 4:], v[..., 4:]  # D = 128, rows start 8 bytes off
    assert q.stride(-1) == 1 and q.data_ptr() % 16 != 0
    check_vs_reference(q, k, v, tree_mask(parents.cuda()), prefix)


def test_head_dim_above_256_is_refused(gen):
    q, k, v, parents, prefix = gpu_case(gen, batch=1, num_nodes=2, q_heads=2, kv_heads=1, head_dim=320,
                                        dtype=torch.bfloat16, max_prefix=4)
    with pytest.raises(RuntimeError, match="head dims"):
        tree_attention(q, k, v, tree_mask(parents.cuda()), prefix, backend="cuda")


# ----------------------------------------------------------------------------- CUDA graphs


@pytest.mark.parametrize("num_nodes, max_prefix", [(1, 8192), (24, 3000)])
def test_cuda_graph_capture_and_replay(gen, num_nodes, max_prefix):
    """Captures with split-KV (workspace from the caching allocator), replays on new lengths and queries."""
    q, k, v, parents, prefix = gpu_case(gen, batch=2, num_nodes=num_nodes, q_heads=32, kv_heads=8, head_dim=128,
                                        dtype=torch.bfloat16, max_prefix=max_prefix, garbage=0.0)
    mask = pack_tree_mask(tree_mask(parents.cuda()))
    tree_attention(q, k, v, mask, prefix, backend="cuda")  # warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    old = sk.config.check_values
    sk.config.check_values = False  # the value checks sync with the host
    try:
        with torch.cuda.graph(graph):
            captured = tree_attention(q, k, v, mask, prefix, backend="cuda")
    finally:
        sk.config.check_values = old
    graph.replay()
    torch.testing.assert_close(captured, tree_attention(q, k, v, mask, prefix, backend="reference"),
                               **TOL_VS_REFERENCE[torch.bfloat16])
    prefix.copy_(torch.tensor([max_prefix // 3, 0], dtype=torch.int32))
    q.copy_(torch.randn(q.shape, device="cuda").to(q.dtype))
    graph.replay()
    torch.testing.assert_close(captured, tree_attention(q, k, v, mask, prefix, backend="reference"),
                               **TOL_VS_REFERENCE[torch.bfloat16])


@pytest.mark.parametrize("window, softcap, value_dim", [(3, None, None), (100, None, None), (None, 30.0, None),
                                                        (7, 0.5, None), (None, None, 128), (5, 20.0, 96)])
@pytest.mark.parametrize("head_dim", (128, 192, 80), ids=("tensor-core", "mla", "fallback"))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_window_softcap_value_dim(gen, dtype, head_dim, window, softcap, value_dim):
    """Sliding window (shorter than the prefix and the tree's depth, or longer), soft-capping
    and a value head dim of its own (the fallback kernel) against the reference, long ragged
    prefixes (split KV on the tensor-core path). Written without a GPU: never run yet."""
    q, k, v, parents, prefix = gpu_case(gen, batch=3, num_nodes=33, q_heads=8, kv_heads=2, head_dim=head_dim,
                                        dtype=dtype, max_prefix=700, garbage=0.0)
    if value_dim is not None:
        v = torch.randn(v.shape[:3] + (value_dim,), device="cuda").to(dtype)
    mask = tree_mask(parents.cuda())
    ref = tree_attention(q, k, v, mask, prefix, window=window, softcap=softcap, backend="reference")
    for form in (mask, pack_tree_mask(mask)):
        out = tree_attention(q, k, v, form, prefix, window=window, softcap=softcap, backend="cuda")
        assert out.shape == ref.shape
        torch.testing.assert_close(out, ref, **TOL_VS_REFERENCE[dtype])
