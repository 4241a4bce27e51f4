"""The compiled CPU kernel of compact_kv_cache_ called directly (torch.ops.specdec, no Python
checks): node ids on the accepted path are bounded by the cache (cache_seqlens[b] + node < S),
not by the width T of accepted_nodes, so a path may come in a narrower tensor than its tree;
a path starts at node 0 and strictly increases; anything else is refused before any slot moves."""

import pytest
import torch

from specdec_kernels.ops import _extension

from conftest import randint

pytestmark = pytest.mark.skipif("CPU" not in _extension.COMPILED.get("compact_kv_cache_", ()),
                                reason="no compiled CPU kernel for compact_kv_cache_")


def op(*args):
    return torch.ops.specdec.compact_kv_cache_.default(*args)


def brute(cache, prefix, paths):
    """A copy of `cache` with row b's path moved to prefix[b] + j (all sources read first)."""
    out = cache.clone()
    for b, path in enumerate(paths):
        for j, node in enumerate(path):
            out[b, int(prefix[b]) + j] = cache[b, int(prefix[b]) + node]
    return out


def test_narrow_accepted_nodes_with_large_node_ids(gen):
    """Paths from a tree of 40 nodes, passed as [B, 3] (-1 padded): node ids up to 39 >= T = 3."""
    paths = [[0, 17, 39], [0, 5], [0], [0, 1, 2]]
    batch, width = len(paths), 3
    prefix = randint(gen, 0, 20, (batch,)).to(torch.int32)
    prefix[0] = 60 - 40  # row 0's last node is the cache's last slot: prefix + 39 = S - 1
    accepted = torch.full((batch, width), -1, dtype=torch.int32)
    for b, path in enumerate(paths):
        accepted[b, : len(path)] = torch.tensor(path, dtype=torch.int32)
    num_accepted = torch.tensor([len(p) - 1 for p in paths], dtype=torch.int32)
    caches = [torch.randn(batch, 60, 2, 8, generator=gen), torch.randn(batch, 4, 61, 3, generator=gen).transpose(1, 2)]
    expected = [brute(c, prefix, paths) for c in caches]
    lens = op(caches, prefix, accepted, num_accepted)
    assert lens.tolist() == (prefix + num_accepted + 1).tolist()
    for got, want in zip(caches, expected):
        assert torch.equal(got, want)


def test_prefix_plus_width_past_the_cache_is_fine(gen):
    """cache_seqlens + T > S is allowed when the path itself stays inside the cache."""
    cache = torch.randn(1, 10, 1, 4, generator=gen)
    expected = brute(cache, [8], [[0, 1]])
    lens = op([cache], torch.tensor([8], dtype=torch.int32), torch.tensor([[0, 1, -1, -1]], dtype=torch.int32),
              torch.tensor([1], dtype=torch.int32))
    assert lens.tolist() == [10]
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("path, num_accepted, prefix, what", [
    ([1, 2, -1], 1, 0, "start at node 0"),
    ([0, 3, 3], 2, 0, "strictly increase"),
    ([0, 4, 2], 2, 0, "strictly increase"),
    ([0, 1, 10], 2, 0, "past the cache"),
    ([0, 1, 2], 2, 8, "past the cache"),
    ([0, -1, -1], 1, 0, "strictly increase"),
    ([0, 1, 2], 3, 0, "num_accepted"),
    ([0, 1, 2], -1, 0, "num_accepted"),
    ([0, 1, 2], 0, -1, "cache_seqlens is negative"),
])
def test_bad_paths_are_refused_before_anything_moves(gen, path, num_accepted, prefix, what):
    caches = [torch.randn(2, 10, 2, 4, generator=gen) for _ in range(2)]
    before = [c.clone() for c in caches]
    accepted = torch.tensor([[0, 1, -1], path], dtype=torch.int32)  # row 0 is fine, row 1 is not
    with pytest.raises(RuntimeError, match=rf"compact_kv_cache_: batch row 1: .*{what}"):
        op(caches, torch.tensor([0, prefix], dtype=torch.int32), accepted, torch.tensor([1, num_accepted], dtype=torch.int32))
    assert all(torch.equal(c, b) for c, b in zip(caches, before))
