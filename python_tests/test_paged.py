"""Paged KV caches: `tree_attention(..., block_table=)` and `compact_kv_cache_(..., block_table=)`.

Every paged backend is checked against the dense op on the same logical cache: random dense
caches are cut into pages, the pages shuffled into a larger pool (the spare pages and the
unused slots hold garbage, even NaN), rows share their common prefix pages, the block tables
carry padding columns of junk ids, and cache_seqlens are ragged. Compaction on pages must
leave every row's logical cache exactly as dense compaction does, and no other slot of the
pool touched. Bad block tables get a ValueError naming block_table.
"""

import importlib.util

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels import compact_kv_cache_, config, pack_tree_mask, tree_attention, tree_mask
from specdec_kernels.ops.reference.tree_attention import gather_pages

from conftest import (INTERPRETER_SKIP, import_interpreted_kernels, randint, random_parents, requires_c, requires_cuda,
                      triton_interpret_env)
from test_kv_cache import make_paths
from test_tree_attention import TOL_BACKEND

ATTENTION_BACKENDS = [None] + sk.available_backends("tree_attention_paged", "cpu")
COMPACT_BACKENDS = [None] + sk.available_backends("compact_kv_cache_paged_", "cpu")
PAGE_SIZES = (1, 3, 16, 32, 64)
HAS_TRITON = importlib.util.find_spec("triton") is not None


# ----------------------------------------------------------------------------- inputs


def to_pages(gen, dense_caches, num_tokens, page_size, *, shared_tokens=0, spare_pages=3, pad_cols=2):
    """Cut dense [B, S, H, D] caches into one shuffled pool of pages per cache.

    Row b's first ceil(num_tokens[b] / page_size) pages hold its positions; the first
    shared_tokens // page_size pages are one set of pages used by every row (the caller
    made those positions equal in every row). Spare pages and the slots past each row's
    tokens hold NaN, so reading them would show. Returns (pools, block_table int32 [B, P]),
    P = pages of the longest row + pad_cols columns of junk ids (never read)."""
    batch = dense_caches[0].shape[0]
    pages_needed = [(int(n) + page_size - 1) // page_size for n in num_tokens]
    num_shared = shared_tokens // page_size
    private = sum(p - num_shared for p in pages_needed)
    num_pages = num_shared + private + spare_pages
    order = torch.randperm(num_pages, generator=gen)  # page ids in a shuffled pool
    num_cols = max(pages_needed) + pad_cols
    table = randint(gen, -5, 10 * num_pages, (batch, num_cols)).to(torch.int32)  # junk padding
    pools = []
    for dense in dense_caches:
        pool = torch.full((num_pages, page_size) + tuple(dense.shape[2:]), float("nan"), dtype=dense.dtype)
        pools.append(pool)
    next_page = num_shared
    for b in range(batch):
        for j in range(pages_needed[b]):
            if j < num_shared:
                page = int(order[j])
            else:
                page = int(order[next_page])
                next_page += 1
            table[b, j] = page
            lo, hi = j * page_size, min((j + 1) * page_size, int(num_tokens[b]))
            for pool, dense in zip(pools, dense_caches):
                pool[page, : hi - lo] = dense[b, lo:hi]
    return pools, table


def ragged_prefix(gen, batch, max_prefix, page_size, shared):
    """(prefix int64 [B], shared_tokens). shared: every row starts with a common prompt of
    shared_tokens (whole pages, shared in the pool; prefix positions only, never a tree
    slot) and adds its own tokens; else one row gets an empty or tiny prefix."""
    if shared:
        common = int(randint(gen, 0, max_prefix // 2 + 1))
        prefix = common + randint(gen, 0, max_prefix // 2 + 1, (batch,))
        return prefix, common // page_size * page_size
    prefix = randint(gen, 0, max_prefix + 1, (batch,))
    prefix[int(randint(gen, 0, batch))] = int(randint(gen, 0, 3))
    return prefix, 0


def attention_case(gen, *, batch, num_nodes, q_heads, kv_heads, head_dim, dtype, page_size, shared=True,
                   max_prefix=90, value_dim=None):
    """Dense inputs (q, k, v, parents, prefix) and their paged form (k_pool, v_pool, table);
    value_dim: the values' head dim (default head_dim)."""
    prefix, shared_tokens = ragged_prefix(gen, batch, max_prefix, page_size, shared)
    num_tokens = prefix + num_nodes
    cache_len = int(num_tokens.max()) + 2
    k = torch.randn(batch, cache_len, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(batch, cache_len, kv_heads, value_dim or head_dim, generator=gen).to(dtype)
    q = torch.randn(batch, num_nodes, q_heads, head_dim, generator=gen).to(dtype)
    k[:, :shared_tokens] = k[:1, :shared_tokens]
    v[:, :shared_tokens] = v[:1, :shared_tokens]
    (k_pool, v_pool), table = to_pages(gen, [k, v], num_tokens, page_size, shared_tokens=shared_tokens)
    parents = random_parents(gen, batch, num_nodes, "random")
    return q, k, v, parents, prefix.to(torch.int32), k_pool, v_pool, table


def check_attention(q, k, v, mask, prefix, k_pool, v_pool, table, backends, scale=None, **options):
    """Each paged backend against the dense reference and the dense op of the same backend
    (options: window, softcap)."""
    dense_ref = tree_attention(q, k, v, mask, prefix, scale=scale, backend="reference", **options)
    for backend in backends:
        out = tree_attention(q, k_pool, v_pool, mask, prefix, block_table=table, scale=scale, backend=backend, **options)
        assert out.shape == q.shape[:3] + v.shape[3:] and out.dtype == q.dtype and out.is_contiguous(), backend
        assert not out.isnan().any(), f"backend={backend}: NaN from a slot no query may read"
        tol = TOL_BACKEND[q.dtype]
        torch.testing.assert_close(out, dense_ref, **tol, msg=lambda m: f"paged backend={backend} vs dense reference: {m}")
        dense_same = tree_attention(q, k, v, mask, prefix, scale=scale, backend=backend, **options)
        torch.testing.assert_close(out, dense_same, **tol, msg=lambda m: f"paged vs dense, backend={backend}: {m}")


# ----------------------------------------------------------------------------- tree attention


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16))
def test_attention_matches_dense(gen, page_size, dtype):
    shapes = ((4, 2, 16, 7, True), (9, 3, 64, 11, False), (2, 2, 24, 1, True), (6, 3, 64, 33, True))
    for q_heads, kv_heads, head_dim, num_nodes, shared in shapes:
        batch = int(randint(gen, 1, 5))
        q, k, v, parents, prefix, k_pool, v_pool, table = attention_case(
            gen, batch=batch, num_nodes=num_nodes, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
            dtype=dtype, page_size=page_size, shared=shared)
        mask = tree_mask(parents)
        for form in (mask, pack_tree_mask(mask), mask[0]):  # bool, packed, one mask for every row
            check_attention(q, k, v, form, prefix, k_pool, v_pool, table, ATTENTION_BACKENDS)


@pytest.mark.parametrize("page_size", (16, 5, 1))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_attention_window_softcap_value_dim(gen, page_size, dtype):
    """Sliding windows (shorter and longer than the rows), soft-capping and Dv != D, paged
    against dense, on every paged backend."""
    for window, softcap, value_dim in ((3, None, 24), (50, 0.7, None), (None, 30.0, 16), (1000, None, 8)):
        q, k, v, parents, prefix, k_pool, v_pool, table = attention_case(
            gen, batch=3, num_nodes=9, q_heads=4, kv_heads=2, head_dim=32, dtype=dtype, page_size=page_size,
            value_dim=value_dim)
        mask = tree_mask(parents)
        for form in (mask, pack_tree_mask(mask)):
            check_attention(q, k, v, form, prefix, k_pool, v_pool, table, ATTENTION_BACKENDS, window=window,
                            softcap=softcap)


@pytest.mark.parametrize("page_size", (16, 5))
def test_attention_long_prefix_split_across_threads(gen, page_size):
    """Long rows: the CPU kernel cuts each row's keys into ranges for the threads (not at page
    ends for pages it copies); the result must not depend on that."""
    q, k, v, parents, prefix, k_pool, v_pool, table = attention_case(
        gen, batch=1, num_nodes=70, q_heads=2, kv_heads=1, head_dim=32, dtype=torch.float32,
        page_size=page_size, max_prefix=1500)
    mask = pack_tree_mask(tree_mask(parents))
    old = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            check_attention(q, k, v, mask, prefix, k_pool, v_pool, table, ATTENTION_BACKENDS)
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("page_size", (16, 5))
def test_attention_causal_chains(gen, page_size, dtype):
    """Rows that are causal chains (prefill chunks of 150 nodes after prefixes of up to 300): the
    CPU kernel's chain path (queries before a tile's tree keys skipped, keys split by work) on
    pages, on 1-3 threads, with and without a window."""
    q, k, v, _, prefix, k_pool, v_pool, table = attention_case(
        gen, batch=2, num_nodes=150, q_heads=9, kv_heads=3, head_dim=64, dtype=dtype, page_size=page_size,
        max_prefix=300, shared=False)
    mask = pack_tree_mask(torch.ones(150, 150, dtype=torch.bool).tril())
    old = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            for window in (None, 40):
                check_attention(q, k, v, mask, prefix, k_pool, v_pool, table, ATTENTION_BACKENDS, window=window)
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("batch, num_nodes", [(1, 1), (1, 6), (4, 3)])
def test_attention_decode_shapes_across_threads(gen, batch, num_nodes):
    """Decode and verify shapes (9 query heads, 3 KV heads): the CPU kernel's tasks take every
    KV head of a row together, on 1-4 threads, rows cut into key ranges or not."""
    q, k, v, parents, prefix, k_pool, v_pool, table = attention_case(
        gen, batch=batch, num_nodes=num_nodes, q_heads=9, kv_heads=3, head_dim=64, dtype=torch.float32,
        page_size=16, max_prefix=700)
    mask = pack_tree_mask(tree_mask(parents))
    old = torch.get_num_threads()
    try:
        for threads in (1, 2, 3, 4):
            torch.set_num_threads(threads)
            check_attention(q, k, v, mask, prefix, k_pool, v_pool, table, ATTENTION_BACKENDS)
    finally:
        torch.set_num_threads(old)


def test_attention_strided_pool_and_scale(gen):
    """Pools that are views (HF-style head-major pages, a slice of a bigger buffer) and a custom scale."""
    q, k, v, parents, prefix, k_pool, v_pool, table = attention_case(
        gen, batch=3, num_nodes=6, q_heads=4, kv_heads=2, head_dim=16, dtype=torch.float32, page_size=16)
    k_view = k_pool.transpose(1, 2).contiguous().transpose(1, 2)  # [pages, H, slots, D] memory
    big = torch.full((k_pool.shape[0] + 1,) + tuple(v_pool.shape[1:3]) + (v_pool.shape[3] + 4,), float("nan"))
    v_view = big[1:, :, :, 2 : 2 + v_pool.shape[3]]
    v_view.copy_(v_pool)
    check_attention(q, k, v, tree_mask(parents), prefix, k_view, v_view, table, ATTENTION_BACKENDS, scale=0.3)


@pytest.mark.parametrize("page_size", (1, 16))
def test_attention_hidden_tree_key_may_hold_nan(gen, page_size):
    """A tree key that no query sees (its mask column all False) is never weighted: NaN in its
    key and value rows leaves every output finite and equal to the dense op's (the CPU kernel
    points such a row at zeros instead of reading it)."""
    q, k, v, parents, prefix, k_pool, v_pool, table = attention_case(
        gen, batch=2, num_nodes=6, q_heads=4, kv_heads=2, head_dim=64, dtype=torch.float32, page_size=page_size)
    mask = tree_mask(parents).clone()
    mask[:, :, 4] = False  # node 4: seen by nobody, itself included
    for b in range(2):
        s = int(prefix[b]) + 4
        for pool, dense in ((k_pool, k), (v_pool, v)):
            pool[table[b, s // page_size], s % page_size] = float("nan")
            dense[b, s] = float("nan")
    check_attention(q, k, v, mask, prefix, k_pool, v_pool, table, ATTENTION_BACKENDS)


def test_attention_values_checks_off_same_result(gen):
    q, k, v, parents, prefix, k_pool, v_pool, table = attention_case(
        gen, batch=2, num_nodes=5, q_heads=2, kv_heads=1, head_dim=16, dtype=torch.float32, page_size=3)
    mask = tree_mask(parents)
    want = tree_attention(q, k_pool, v_pool, mask, prefix, block_table=table)
    with config.value_checks(False):
        got = tree_attention(q, k_pool, v_pool, mask, prefix, block_table=table)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_attention_same_page_twice_in_a_row(gen):
    """A table may name one page at several positions (reading only): every position reads it."""
    q = torch.randn(1, 2, 2, 8, generator=gen)
    pool_k = torch.randn(2, 4, 1, 8, generator=gen)
    pool_v = torch.randn(2, 4, 1, 8, generator=gen)
    table = torch.tensor([[1, 1, 0]], dtype=torch.int32)
    prefix = torch.tensor([8], dtype=torch.int32)
    k = torch.cat([pool_k[1], pool_k[1], pool_k[0]])[None]
    v = torch.cat([pool_v[1], pool_v[1], pool_v[0]])[None]
    check_attention(q, k, v, tree_mask(torch.tensor([-1, 0])), prefix, pool_k, pool_v, table, ATTENTION_BACKENDS)


# ----------------------------------------------------------------------------- Triton (interpreter)

TRITON_MODULE = "specdec_kernels.ops.triton.tree_attention_paged"
INTERPRETED = import_interpreted_kernels(TRITON_MODULE) if HAS_TRITON else None


@pytest.fixture(scope="module")
def interpreter():
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    if INTERPRETED is None:
        pytest.skip(INTERPRETER_SKIP)
    with triton_interpret_env():
        yield INTERPRETED


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_triton_interpreter_matches_dense(gen, interpreter, page_size):
    """The PAGED path of the Triton kernel (fp32 in the interpreter), one and several KV splits."""
    q, k, v, parents, prefix, k_pool, v_pool, table = attention_case(
        gen, batch=2, num_nodes=5, q_heads=4, kv_heads=2, head_dim=16, dtype=torch.float32,
        page_size=page_size, max_prefix=70)
    mask = tree_mask(parents)
    check_attention(q, k, v, mask, prefix, k_pool, v_pool, table, ["triton"])
    dense_ref = tree_attention(q, k, v, mask, prefix, backend="reference")
    packed = pack_tree_mask(mask)
    for splits in (1, 3):
        out = interpreter.tree_attention_paged(q, k_pool, v_pool, packed, prefix, table, 16**-0.5, num_splits=splits)
        torch.testing.assert_close(out, dense_ref, **TOL_BACKEND[torch.float32], msg=lambda m: f"splits={splits}: {m}")


# ----------------------------------------------------------------------------- compaction


def compaction_case(gen, *, batch, num_nodes, page_size, specs, shared=True, prefix=None):
    """Dense caches, the accepted paths, and the paged form of the caches."""
    if prefix is None:
        prefix, shared_tokens = ragged_prefix(gen, batch, 40, page_size, shared)
    else:
        shared_tokens = 0
    accepted, num_accepted = make_paths(gen, batch, num_nodes, "random")
    num_tokens = prefix + num_nodes
    cache_len = int(num_tokens.max()) + 1
    dense = [torch.randn(batch, cache_len, h, d, generator=gen).to(dt) for h, d, dt in specs]
    for c in dense:
        c[:, :shared_tokens] = c[:1, :shared_tokens]
    pools, table = to_pages(gen, dense, num_tokens, page_size, shared_tokens=shared_tokens)
    for pool in pools:  # compaction copies bytes: NaN compares unequal, so use finite garbage
        pool.nan_to_num_(nan=7.0)
    return dense, prefix, accepted, num_accepted, pools, table


def check_compaction(dense, prefix, accepted, num_accepted, pools, table, backends):
    want_lens = compact_kv_cache_([c.clone() for c in dense], prefix, accepted, num_accepted, backend="reference")
    want = [c.clone() for c in dense]
    compact_kv_cache_(want, prefix, accepted, num_accepted, backend="reference")
    num_tokens = prefix.to(torch.int64) + accepted.shape[1]
    for backend in backends:
        got = [p.clone() for p in pools]
        lens = compact_kv_cache_(got, prefix, accepted, num_accepted, block_table=table, backend=backend)
        assert lens.dtype == prefix.dtype and torch.equal(lens, want_lens), backend
        for i, (pool_after, pool_before, dense_after) in enumerate(zip(got, pools, want)):
            logical = gather_pages(pool_after, table, num_tokens)
            for b in range(prefix.shape[0]):
                n = int(num_tokens[b])
                assert torch.equal(logical[b, :n], dense_after[b, :n]), f"backend={backend} cache {i} row {b}"
            # Only slots of some row's tree may change.
            changed = (pool_after != pool_before).flatten(2).any(-1)  # [pages, slots]
            allowed = torch.zeros_like(changed)
            for b in range(prefix.shape[0]):
                for s in range(int(prefix[b]), int(num_tokens[b])):
                    allowed[int(table[b, s // pool_after.shape[1]]), s % pool_after.shape[1]] = True
            assert not (changed & ~allowed).any(), f"backend={backend} cache {i}: a slot outside the trees changed"


SPECS = ((2, 16, torch.float32), (3, 8, torch.bfloat16), (1, 5, torch.float16))


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_compaction_matches_dense(gen, page_size):
    for num_nodes in (1, 4, 13):
        dense, prefix, accepted, num_accepted, pools, table = compaction_case(
            gen, batch=int(randint(gen, 1, 5)), num_nodes=num_nodes, page_size=page_size, specs=SPECS)
        check_compaction(dense, prefix, accepted, num_accepted, pools, table, COMPACT_BACKENDS)


@pytest.mark.parametrize("page_size", (1, 2, 3))
def test_compaction_path_across_pages(gen, page_size):
    """Every node of the path in another page than where it lands, and a source that is also
    a destination (node 2 -> position 1 while node 4 -> position 2)."""
    num_nodes = 6
    dense, prefix, _, _, pools, table = compaction_case(gen, batch=2, num_nodes=num_nodes, page_size=page_size,
                                                        specs=SPECS)
    accepted = torch.tensor([[0, 2, 4, 5, -1, -1], [0, 3, -1, -1, -1, -1]])
    num_accepted = torch.tensor([3, 1])
    check_compaction(dense, prefix, accepted, num_accepted, pools, table, COMPACT_BACKENDS)


# ----------------------------------------------------------------------------- bad block tables


def bad_attention_inputs(gen):
    q, k, v, parents, prefix, k_pool, v_pool, table = attention_case(
        gen, batch=2, num_nodes=4, q_heads=2, kv_heads=1, head_dim=8, dtype=torch.float32, page_size=4, shared=False)
    return q, k_pool, v_pool, tree_mask(parents), prefix, table


def used_pages(prefix, num_nodes, page_size):
    return [(int(p) + num_nodes + page_size - 1) // page_size for p in prefix]


@pytest.mark.parametrize("backend", ATTENTION_BACKENDS)
@pytest.mark.parametrize("case", ("page_too_big", "page_negative", "too_few_columns", "int64", "wrong_batch", "1d"))
def test_bad_block_table_attention(gen, case, backend):
    q, k_pool, v_pool, mask, prefix, table = bad_attention_inputs(gen)
    num_pages = k_pool.shape[0]
    last = used_pages(prefix, q.shape[1], k_pool.shape[1])[1] - 1  # row 1's last used page
    if case == "page_too_big":
        table[1, last] = num_pages
    elif case == "page_negative":
        table[1, 0] = -1
    elif case == "too_few_columns":
        table = table[:, :last]
    elif case == "int64":
        table = table.long()
    elif case == "wrong_batch":
        table = table[:1]
    elif case == "1d":
        table = table[0]
    with pytest.raises(ValueError, match="block_table"):
        tree_attention(q, k_pool, v_pool, mask, prefix, block_table=table, backend=backend)


def test_bad_paged_pools(gen):
    q, k_pool, v_pool, mask, prefix, table = bad_attention_inputs(gen)
    with pytest.raises(ValueError, match="v_cache"):
        tree_attention(q, k_pool, v_pool[:, :2], mask, prefix, block_table=table)
    with pytest.raises(ValueError, match="k_cache"):
        tree_attention(q, k_pool[:, :0], v_pool[:, :0], mask, prefix, block_table=table)
    with pytest.raises(ValueError, match="cache_seqlens"):
        tree_attention(q, k_pool, v_pool, mask, prefix - 100, block_table=table)


@requires_c
def test_compiled_kernels_check_page_ids_themselves(gen):
    """torch.ops.specdec.* called directly (no Python checks): a clear error, not a bad read."""
    q, k_pool, v_pool, mask, prefix, table = bad_attention_inputs(gen)
    table[0, 0] = 10**6
    with pytest.raises(RuntimeError, match="block_table"):
        torch.ops.specdec.tree_attention_paged(q, k_pool, v_pool, mask, prefix, table, 0.5)
    caches = [k_pool.nan_to_num()]
    before = caches[0].clone()
    accepted = torch.tensor([[0, 2, 3, -1], [0, 1, -1, -1]], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="block_table"):
        torch.ops.specdec.compact_kv_cache_paged_(caches, prefix, accepted, torch.tensor([2, 1], dtype=torch.int32), table)
    assert torch.equal(caches[0], before)  # checked before anything moved


@requires_c
def test_compiled_paged_compaction_keeps_paths_inside_the_tree(gen):
    """torch.ops.specdec.compact_kv_cache_paged_ called directly (no Python checks): a path
    node past the tree (node >= T) is refused before anything moves. Its slot lies past
    cache_seqlens + T, where the page ids were not checked (the CUDA kernel skips such nodes)."""
    dense, prefix, accepted, num_accepted, pools, table = compaction_case(
        gen, batch=2, num_nodes=5, page_size=4, specs=SPECS[:1], prefix=torch.tensor([6, 9]))
    table = table.to(torch.int32)
    before = pools[0].clone()
    bad = torch.tensor([[0, 1, 7, -1, -1], [0, 2, -1, -1, -1]], dtype=torch.int32)  # node 7 >= T = 5
    with pytest.raises(RuntimeError, match="outside the tree"):
        torch.ops.specdec.compact_kv_cache_paged_(pools, prefix.to(torch.int32), bad,
                                                  torch.tensor([2, 1], dtype=torch.int32), table)
    assert torch.equal(pools[0], before)


@pytest.mark.parametrize("backend", COMPACT_BACKENDS)
@pytest.mark.parametrize("case", ("page_too_big", "too_few_columns", "tree_slot_shared", "page_sizes_differ", "int64",
                                  "path_not_from_root", "path_not_rising"))
def test_bad_block_table_compaction(gen, case, backend):
    prefix = torch.tensor([6, 9])
    dense, prefix, accepted, num_accepted, pools, table = compaction_case(
        gen, batch=2, num_nodes=5, page_size=4, specs=SPECS[:2], prefix=prefix)
    num_pages = pools[0].shape[0]
    needed = used_pages(prefix, 5, 4)
    table = table[:, : max(needed)].contiguous()
    match = "block_table"
    if case == "page_too_big":
        table[0, needed[0] - 1] = num_pages
    elif case == "too_few_columns":
        table = table[:, : needed[1] - 1]
    elif case == "tree_slot_shared":
        table[1, needed[1] - 1] = table[0, needed[0] - 1]  # both rows' trees write one page
    elif case == "page_sizes_differ":
        pools[1] = pools[1][:, :3]
        match = r"caches\[1\]"
    elif case == "int64":
        table = table.long()
    elif case in ("path_not_from_root", "path_not_rising"):
        # The kernels move a path in chunks up the path: exact only from node 0, strictly
        # rising (the CUDA one would silently differ from the reference), as for dense caches.
        accepted, num_accepted = torch.tensor([[0, 3, 2, 4, 1], [1, 2, 3, 4, 0]]), torch.tensor([3, 2])
        if case == "path_not_from_root":
            accepted[0] = torch.tensor([0, 1, 2, 3, 4])
        else:
            accepted[1] = torch.tensor([0, 1, 2, 3, 4])
        match = "accepted_nodes"
    before = [p.clone() for p in pools]
    with pytest.raises(ValueError, match=match):
        compact_kv_cache_(pools, prefix, accepted, num_accepted, block_table=table, backend=backend)
    for p, old in zip(pools, before):  # nothing moved
        assert torch.equal(p, old)


# ----------------------------------------------------------------------------- registration


def paged_attention_samples(gen):
    """Normalised arguments of torch.ops.specdec.tree_attention_paged (for opcheck)."""
    for dtype, page_size, packed in ((torch.float32, 4, False), (torch.bfloat16, 16, True), (torch.float16, 1, False)):
        q, k, v, parents, prefix, k_pool, v_pool, table = attention_case(
            gen, batch=2, num_nodes=5, q_heads=4, kv_heads=2, head_dim=16, dtype=dtype, page_size=page_size,
            max_prefix=30)
        mask = tree_mask(parents)
        yield q, k_pool.nan_to_num(), v_pool.nan_to_num(), pack_tree_mask(mask) if packed else mask, prefix, table, 0.25
    # window, softcap and a value head dim of its own (MLA)
    q, k, v, parents, prefix, k_pool, v_pool, table = attention_case(
        gen, batch=2, num_nodes=5, q_heads=4, kv_heads=2, head_dim=16, dtype=torch.float32, page_size=4,
        max_prefix=30, value_dim=8)
    yield q, k_pool.nan_to_num(), v_pool.nan_to_num(), tree_mask(parents), prefix, table, 0.25, 4, 10.0


def paged_compact_samples(gen):
    """Normalised arguments of torch.ops.specdec.compact_kv_cache_paged_ (for opcheck)."""
    dense, prefix, accepted, num_accepted, pools, table = compaction_case(
        gen, batch=2, num_nodes=5, page_size=3, specs=SPECS[:2])
    yield pools, prefix.to(torch.int32), accepted.to(torch.int32), num_accepted.to(torch.int32), table


@requires_c
def test_opcheck(gen):
    for args in paged_attention_samples(gen):
        torch.library.opcheck(torch.ops.specdec.tree_attention_paged.default, args)
    for pools, *rest in paged_compact_samples(gen):
        torch.library.opcheck(torch.ops.specdec.compact_kv_cache_paged_.default, ([p.clone() for p in pools], *rest))


@requires_c
def test_registered_on_cpu():
    for op in ("tree_attention_paged", "compact_kv_cache_paged_"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"specdec::{op}", "CPU"), op
        assert "cpu" in sk.available_backends(op, "cpu")


def test_torch_compile_fullgraph(gen):
    q, k, v, parents, prefix, k_pool, v_pool, table = attention_case(
        gen, batch=2, num_nodes=5, q_heads=4, kv_heads=2, head_dim=16, dtype=torch.float32, page_size=16)
    mask = tree_mask(parents)

    def step(q, k_pool, v_pool, mask, prefix, table, caches, accepted, num_accepted):
        out = tree_attention(q, k_pool, v_pool, mask, prefix, block_table=table)
        new_lens = compact_kv_cache_(caches, prefix, accepted, num_accepted, block_table=table)
        return out, new_lens

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    accepted, num_accepted = make_paths(gen, 2, 5, "random")
    k_eager, k_compiled = k_pool.nan_to_num(), k_pool.nan_to_num()
    want = step(q, k_pool, v_pool, mask, prefix, table, [k_eager], accepted, num_accepted)
    got = compiled(q, k_pool, v_pool, mask, prefix, table, [k_compiled], accepted, num_accepted)
    torch.testing.assert_close(got[0], want[0])
    assert torch.equal(got[1], want[1])
    assert torch.equal(k_compiled, k_eager)


# ----------------------------------------------------------------------------- GPU


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16))
def test_gpu_backends_match_dense(gen, page_size, dtype):
    """Every CUDA backend (compiled kernel, Triton, reference) on paged caches vs the dense reference.
    Every page size with the Llama-like shape; the other head dims (each a Triton specialisation,
    compiled again in every test worker) at page size 16: the full product took 400 s of the first
    GPU window's 900."""
    backends = [None] + sk.available_backends("tree_attention_paged", "cuda")
    shapes = ((32, 8, 128, 16), (9, 3, 64, 11), (4, 4, 256, 64), (4, 2, 48, 3))
    for q_heads, kv_heads, head_dim, num_nodes in shapes if page_size == 16 else shapes[:1]:
        case = attention_case(gen, batch=3, num_nodes=num_nodes, q_heads=q_heads, kv_heads=kv_heads,
                              head_dim=head_dim, dtype=dtype, page_size=page_size, max_prefix=600)
        q, k, v, parents, prefix, k_pool, v_pool, table = (x.cuda() for x in case)
        mask = tree_mask(parents)
        for form in (mask, pack_tree_mask(mask)):
            check_attention(q, k, v, form, prefix, k_pool, v_pool, table, backends)


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_gpu_compaction_matches_dense(gen, page_size):
    backends = [None] + sk.available_backends("compact_kv_cache_paged_", "cuda")
    dense, prefix, accepted, num_accepted, pools, table = compaction_case(
        gen, batch=4, num_nodes=13, page_size=page_size, specs=SPECS)
    to = lambda xs: [x.cuda() for x in xs]  # noqa: E731
    check_compaction(to(dense), prefix.cuda(), accepted.cuda(), num_accepted.cuda(), to(pools), table.cuda(), backends)
