"""`compact_kv_cache_` against a brute force (copy the original, loop over rows and path
positions), for every backend available on the CPU and backend=None vs `reference`."""

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels import compact_kv_cache_

from conftest import TREE_KINDS, randint, random_parents

BACKENDS = [None] + sk.available_backends("compact_kv_cache_", "cpu")
INT_DTYPES = (torch.int32, torch.int64)


# ----------------------------------------------------------------------------- inputs


def random_path(gen, parents_row: list) -> list:
    """A root-to-node path of the tree, each step a random child, stopping at random."""
    path = [0]
    while True:
        children = [i for i, p in enumerate(parents_row) if i > 0 and p == path[-1]]
        if not children or float(torch.rand((), generator=gen)) < 0.25:
            return path
        path.append(children[int(randint(gen, 0, len(children)))])


def make_paths(gen, batch, num_nodes, kind):
    """accepted_nodes [B, T] (-1 padded, garbage-free) and num_accepted [B] from random trees."""
    parents = random_parents(gen, batch, num_nodes, kind, ragged=True)
    accepted = torch.full((batch, num_nodes), -1, dtype=torch.int64)
    num_accepted = torch.zeros(batch, dtype=torch.int64)
    for b in range(batch):
        path = random_path(gen, parents[b].tolist())
        accepted[b, : len(path)] = torch.tensor(path)
        num_accepted[b] = len(path) - 1
    return accepted, num_accepted


def make_cache(gen, batch, cache_len, heads, dim, dtype, layout):
    """A [B, S, H, D] cache (contiguous, an HF [B, H, S, D] transpose view, or a slice of a
    bigger buffer) filled with distinct random values."""
    if layout == "contiguous":
        return torch.randn(batch, cache_len, heads, dim, generator=gen).to(dtype)
    if layout == "hf":
        return torch.randn(batch, heads, cache_len, dim, generator=gen).to(dtype).transpose(1, 2)
    if layout == "slice":
        big = torch.randn(batch + 1, cache_len + 3, heads + 2, dim + 5, generator=gen).to(dtype)
        return big[1:, 2 : 2 + cache_len, 1 : 1 + heads, 3 : 3 + dim]
    raise ValueError(layout)


CACHE_SPECS = [  # (heads, dim, dtype, layout, extra S)
    (2, 16, torch.float32, "contiguous", 0),
    (4, 8, torch.bfloat16, "hf", 3),
    (1, 5, torch.float16, "slice", 1),
    (3, 64, torch.float32, "hf", 0),
]


def make_caches(gen, batch, min_len, specs=CACHE_SPECS):
    return [make_cache(gen, batch, min_len + extra, h, d, dt, layout) for h, d, dt, layout, extra in specs]


def brute_compact(cache, prefix, accepted, num_accepted):
    """Expected cache after compaction: copy of the original, then loops over rows and path positions."""
    original = cache.clone()
    expected = cache.clone()
    for b in range(cache.shape[0]):
        start = int(prefix[b])
        for j in range(int(num_accepted[b]) + 1):
            expected[b, start + j] = original[b, start + int(accepted[b, j])]
    return expected


def run_and_check(gen, caches, prefix, accepted, num_accepted, backends=None):
    """Run every backend on fresh copies and compare with the brute force and the reference."""
    expected = [brute_compact(c, prefix, accepted, num_accepted) for c in caches]
    expected_lens = [int(prefix[b]) + int(num_accepted[b]) + 1 for b in range(prefix.shape[0])]
    results = {}
    for backend in ["reference"] + (BACKENDS if backends is None else backends):
        copies = []
        for c in caches:  # same strides as the original (views stay views)
            buf = torch.empty_strided(c.shape, c.stride(), dtype=c.dtype)
            buf.copy_(c)
            copies.append(buf)
        before = [c.clone() for c in copies]
        new_lens = compact_kv_cache_(copies, prefix, accepted, num_accepted, backend=backend)
        assert new_lens.dtype == prefix.dtype, backend
        assert new_lens.tolist() == expected_lens, backend
        assert prefix.tolist() == [l - int(n) - 1 for l, n in zip(expected_lens, num_accepted)]  # input untouched
        for i, (got, want, old) in enumerate(zip(copies, expected, before)):
            assert torch.equal(got, want), f"backend={backend} cache {i}"
            changed = (got != old).flatten(2).any(-1)
            for b in range(prefix.shape[0]):  # only slots after the prefix, within the path, may change
                start, stop = int(prefix[b]), int(prefix[b]) + int(num_accepted[b]) + 1
                assert not changed[b, :start].any() and not changed[b, stop:].any()
        results[backend] = copies
    return results


def random_tree_case(gen, kind: str, num_nodes: int, max_batch: int):
    """(caches, prefix, accepted, num_accepted), indices int32: a batch of 1..max_batch-1 rows
    with random accepted paths of a `kind` tree and random prefixes (row 0 starts at slot 0)."""
    batch = int(randint(gen, 1, max_batch))
    accepted, num_accepted = make_paths(gen, batch, num_nodes, kind)
    prefix = randint(gen, 0, 40, (batch,))
    prefix[0] = 0
    caches = make_caches(gen, batch, int(prefix.max()) + num_nodes)
    return caches, prefix.to(torch.int32), accepted.to(torch.int32), num_accepted.to(torch.int32)


def overlapping_moves_case(gen, path):
    """(caches, prefix, accepted, num_accepted), int32 indices: 3 rows that all accept `path`
    (a tree of 9 nodes) after prefixes 0, 5 and 13. Each slot holds its own index, so a wrong
    copy order shows as a wrong value."""
    batch, num_nodes = 3, 9
    accepted = torch.full((batch, num_nodes), -1, dtype=torch.int32)
    accepted[:, : len(path)] = torch.tensor(path, dtype=torch.int32)
    num_accepted = torch.full((batch,), len(path) - 1, dtype=torch.int32)
    prefix = torch.tensor([0, 5, 13], dtype=torch.int32)
    caches = make_caches(gen, batch, 13 + num_nodes)
    for c in caches:
        c.copy_(torch.arange(c.shape[1], dtype=torch.float32)[None, :, None, None].expand_as(c).to(c.dtype))
    return caches, prefix, accepted, num_accepted


# ----------------------------------------------------------------------------- correctness


@pytest.mark.parametrize("num_nodes", (1, 2, 7, 26, 65))
@pytest.mark.parametrize("kind", TREE_KINDS)
def test_random_trees(gen, kind, num_nodes):
    run_and_check(gen, *random_tree_case(gen, kind, num_nodes, max_batch=5))


@pytest.mark.parametrize("lens_dtype", INT_DTYPES, ids=str)
@pytest.mark.parametrize("nodes_dtype", INT_DTYPES, ids=str)
@pytest.mark.parametrize("num_dtype", INT_DTYPES, ids=str)
def test_index_dtypes(gen, lens_dtype, nodes_dtype, num_dtype):
    batch, num_nodes = 3, 9
    accepted, num_accepted = make_paths(gen, batch, num_nodes, "random")
    prefix = randint(gen, 0, 20, (batch,))
    caches = make_caches(gen, batch, int(prefix.max()) + num_nodes, CACHE_SPECS[:2])
    run_and_check(gen, caches, prefix.to(lens_dtype), accepted.to(nodes_dtype), num_accepted.to(num_dtype))


@pytest.mark.parametrize(
    "path",
    [
        [0, 2, 3],  # source 3 is destination 2, source 2 is destination 1
        [0, 1, 3, 4, 6],  # in place, then a chain of overlapping moves
        [0, 2, 4, 6, 8],  # every source but the last is a later destination
        [0, 5, 6, 7],  # a block shifted by 4
        [0, 1, 2, 3],  # nothing moves
        [0],  # only the root
    ],
)
def test_overlapping_moves(gen, path):
    caches, prefix, accepted, num_accepted = overlapping_moves_case(gen, path)
    results = run_and_check(gen, caches, prefix, accepted, num_accepted)
    for copies in results.values():
        for b in range(prefix.shape[0]):
            got = copies[0][b, int(prefix[b]) : int(prefix[b]) + len(path), 0, 0].tolist()
            assert got == [float(int(prefix[b]) + p) for p in path]


def test_num_accepted_zero(gen):
    batch, num_nodes = 4, 6
    accepted = torch.full((batch, num_nodes), -1, dtype=torch.int32)
    accepted[:, 0] = 0
    num_accepted = torch.zeros(batch, dtype=torch.int32)
    prefix = torch.tensor([0, 1, 7, 3], dtype=torch.int32)
    caches = make_caches(gen, batch, 7 + num_nodes)
    results = run_and_check(gen, caches, prefix, accepted, num_accepted)
    for copies in results.values():  # nothing moved at all
        for got, orig in zip(copies, caches):
            assert torch.equal(got, orig)


def test_mixed_rows_and_garbage_past_path(gen):
    """Ragged num_accepted; entries past each row's path hold garbage that must be ignored."""
    batch, num_nodes = 4, 8
    accepted = torch.tensor(
        [
            [0, 1, 2, 3, 4, 5, 6, 7],
            [0, 3, 5, 99, -7, 1000, 2, 2],
            [0, -1, -1, -1, -1, -1, -1, -1],
            [0, 2, 3, 7, -1, -1, -1, -1],
        ],
        dtype=torch.int64,
    )
    num_accepted = torch.tensor([7, 2, 0, 3])
    prefix = torch.tensor([2, 0, 11, 4])
    caches = make_caches(gen, batch, 11 + num_nodes)
    run_and_check(gen, caches, prefix, accepted, num_accepted)


def test_single_cache_and_tuple_input(gen):
    batch, num_nodes = 2, 5
    accepted, num_accepted = make_paths(gen, batch, num_nodes, "chain")
    prefix = torch.tensor([3, 0], dtype=torch.int32)
    cache = make_cache(gen, batch, 3 + num_nodes, 2, 4, torch.float32, "contiguous")
    expected = brute_compact(cache, prefix, accepted, num_accepted)
    for backend in BACKENDS + ["reference"]:
        c = cache.clone()
        compact_kv_cache_((c,), prefix, accepted, num_accepted, backend=backend)
        assert torch.equal(c, expected)


def test_degenerate_cache_shapes(gen):
    """Caches with no heads or an empty head dim are legal (nothing to move) next to real ones."""
    accepted = torch.tensor([[0, 2, 3, -1], [0, 1, -1, -1]])
    num_accepted = torch.tensor([2, 1])
    prefix = torch.tensor([1, 2], dtype=torch.int32)
    caches = [torch.randn(2, 6, 0, 4, generator=gen), torch.randn(2, 7, 2, 0, generator=gen), torch.randn(2, 6, 2, 3, generator=gen)]
    run_and_check(gen, caches, prefix, accepted, num_accepted)


def test_many_caches_one_call(gen):
    """A model's worth of layers (keys and values), shared by one call."""
    batch, num_nodes = 3, 12
    accepted, num_accepted = make_paths(gen, batch, num_nodes, "bushy")
    prefix = randint(gen, 0, 30, (batch,)).to(torch.int32)
    specs = [(2, 8, torch.bfloat16, "hf", 0)] * 24 + [(1, 3, torch.float32, "slice", 2)]
    caches = make_caches(gen, batch, int(prefix.max()) + num_nodes, specs)
    run_and_check(gen, caches, prefix, accepted, num_accepted)


def test_check_values_off_same_result(gen):
    batch, num_nodes = 3, 10
    accepted, num_accepted = make_paths(gen, batch, num_nodes, "random")
    prefix = randint(gen, 0, 30, (batch,)).to(torch.int32)
    caches = make_caches(gen, batch, int(prefix.max()) + num_nodes)
    expected = [brute_compact(c, prefix, accepted, num_accepted) for c in caches]
    old = sk.config.check_values
    sk.config.check_values = False
    try:
        lens = compact_kv_cache_(caches, prefix, accepted, num_accepted)
    finally:
        sk.config.check_values = old
    assert lens.tolist() == (prefix + num_accepted + 1).tolist()
    assert all(torch.equal(c, e) for c, e in zip(caches, expected))


# ----------------------------------------------------------------------------- bad input


def good_args():
    batch, num_nodes, cache_len = 2, 4, 10
    return dict(
        caches=[torch.zeros(batch, cache_len, 2, 8), torch.zeros(batch, cache_len + 2, 1, 4, dtype=torch.float16)],
        cache_seqlens=torch.tensor([3, 6], dtype=torch.int32),
        accepted_nodes=torch.tensor([[0, 1, 3, -1], [0, 2, -1, -1]], dtype=torch.int32),
        num_accepted=torch.tensor([2, 1], dtype=torch.int32),
    )


def _set(key, fn):
    return lambda a: a.update({key: fn(a)})


def _set_cache(i, fn):
    def mutate(a):
        a["caches"][i] = fn(a["caches"][i])
    return mutate


BAD = [
    ("caches", "empty_list", _set("caches", lambda a: [])),
    (r"caches\[0\]", "3d", _set_cache(0, lambda c: c[0])),
    (r"caches\[1\]", "int_dtype", _set_cache(1, lambda c: c.to(torch.int32))),
    (r"caches\[0\]", "float64", _set_cache(0, lambda c: c.double())),
    (r"caches\[1\]", "batch", _set_cache(1, lambda c: c[:1])),
    (r"caches\[0\]", "last_dim_stride", _set_cache(0, lambda c: torch.zeros(2, 10, 2, 16)[..., ::2])),
    (r"caches\[1\]", "device", _set_cache(1, lambda c: c.to("meta"))),
    (r"caches\[0\]", "not_tensor", _set_cache(0, lambda c: c.tolist())),
    ("cache_seqlens", "float", _set("cache_seqlens", lambda a: a["cache_seqlens"].float())),
    ("cache_seqlens", "2d", _set("cache_seqlens", lambda a: a["cache_seqlens"][None])),
    ("cache_seqlens", "shape", _set("cache_seqlens", lambda a: torch.tensor([3, 6, 1], dtype=torch.int32))),
    ("cache_seqlens", "prefix_fills_S", _set("cache_seqlens", lambda a: torch.tensor([3, 10], dtype=torch.int32))),
    ("accepted_nodes", "last_node_past_S", _set("cache_seqlens", lambda a: torch.tensor([3, 8], dtype=torch.int32))),
    ("cache_seqlens", "negative", _set("cache_seqlens", lambda a: torch.tensor([-1, 6], dtype=torch.int32))),
    ("cache_seqlens", "empty_batch", lambda a: a.update(
        caches=[c[:0] for c in a["caches"]], cache_seqlens=a["cache_seqlens"][:0],
        accepted_nodes=a["accepted_nodes"][:0], num_accepted=a["num_accepted"][:0])),
    ("accepted_nodes", "1d", _set("accepted_nodes", lambda a: a["accepted_nodes"][0])),
    ("accepted_nodes", "float", _set("accepted_nodes", lambda a: a["accepted_nodes"].float())),
    ("accepted_nodes", "node_too_big", _set("accepted_nodes", lambda a: torch.tensor([[0, 1, 7, -1], [0, 2, -1, -1]]))),
    ("accepted_nodes", "not_from_root", _set("accepted_nodes", lambda a: torch.tensor([[1, 2, 3, -1], [0, 2, -1, -1]]))),
    ("accepted_nodes", "decreasing", _set("accepted_nodes", lambda a: torch.tensor([[0, 3, 1, -1], [0, 2, -1, -1]]))),
    ("accepted_nodes", "repeated_node", _set("accepted_nodes", lambda a: torch.tensor([[0, 1, 1, -1], [0, 2, -1, -1]]))),
    ("accepted_nodes", "node_negative_on_path", _set("accepted_nodes", lambda a: torch.tensor([[0, 1, -1, -1], [0, 2, -1, -1]]))),
    ("accepted_nodes", "device", _set("accepted_nodes", lambda a: a["accepted_nodes"].to("meta"))),
    ("num_accepted", "float", _set("num_accepted", lambda a: a["num_accepted"].float())),
    ("num_accepted", "shape", _set("num_accepted", lambda a: a["num_accepted"][:1])),
    ("num_accepted", "equals_T", _set("num_accepted", lambda a: torch.tensor([4, 1]))),
    ("num_accepted", "negative", _set("num_accepted", lambda a: torch.tensor([2, -1]))),
    ("num_accepted", "device", _set("num_accepted", lambda a: a["num_accepted"].to("meta"))),
]


@pytest.mark.parametrize("name, case, mutate", BAD, ids=[f"{n.replace(chr(92), '')}-{c}" for n, c, _ in BAD])
def test_bad_input(name, case, mutate):
    args = good_args()
    compact_kv_cache_(**good_args())  # the unmodified inputs are fine
    mutate(args)
    snapshot = [c.clone() for c in args["caches"] if isinstance(c, torch.Tensor) and c.device.type == "cpu"]
    with pytest.raises(ValueError, match=f"^{name}:"):
        compact_kv_cache_(**args)
    after = [c for c in args["caches"] if isinstance(c, torch.Tensor) and c.device.type == "cpu"]
    assert all(torch.equal(x, y) for x, y in zip(snapshot, after))  # rejected before writing anything


@pytest.mark.parametrize("backend", BACKENDS + ["reference"])
def test_node_ids_bounded_by_the_cache_not_the_width(gen, backend):
    """A path of a wide tree passed in a narrower accepted_nodes (node ids >= its width) is
    fine as long as it fits in the cache (issue 16); the result is the brute force's."""
    batch = 3
    accepted = torch.tensor([[0, 4, 9], [0, 1, 2], [0, 7, -1]], dtype=torch.int32)  # width 3, nodes up to 9
    num_accepted = torch.tensor([2, 1, 1], dtype=torch.int32)
    prefix = torch.tensor([5, 0, 30], dtype=torch.int32)
    caches = make_caches(gen, batch, 40)  # 30 + 7 < 40; row 0: 5 + 9 < 40
    expected = [brute_compact(c, prefix, accepted, num_accepted) for c in caches]
    lens = compact_kv_cache_(caches, prefix, accepted, num_accepted, backend=backend)
    assert lens.tolist() == (prefix + num_accepted + 1).tolist()
    assert all(torch.equal(c, e) for c, e in zip(caches, expected))


def test_wide_accepted_nodes_near_the_end_of_the_cache(gen):
    """accepted_nodes wider than the room left after the prefix: the path fits, the padding
    past it does not, and nothing outside the path moves."""
    caches = make_caches(gen, 1, 8, specs=[(2, 4, torch.float32, "contiguous", 0)])
    accepted = torch.tensor([[0, 1, 3, -1, -1, -1, -1, -1, -1, -1]], dtype=torch.int32)  # width 10 > S - prefix
    prefix, num_accepted = torch.tensor([4], dtype=torch.int32), torch.tensor([2], dtype=torch.int32)
    expected = brute_compact(caches[0], prefix, accepted, num_accepted)
    assert compact_kv_cache_(caches, prefix, accepted, num_accepted, backend="reference").tolist() == [7]
    assert torch.equal(caches[0], expected)


@pytest.mark.parametrize("backend", ("nope", "cuda"))
def test_bad_backend(backend):
    with pytest.raises(ValueError, match="backend"):
        compact_kv_cache_(**good_args(), backend=backend)
