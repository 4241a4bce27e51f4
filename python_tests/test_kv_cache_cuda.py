"""The CUDA `compact_kv_cache_` kernel (csrc/include/specdec/kv_cache.cuh) against the reference
and the brute force of test_kv_cache.py, on GPU copies of the same inputs.

Covers what the kernel branches on: vector width (16-byte rows down to 2-byte slices), HF
[B, H, S, D] views and odd slices, paths longer than the per-thread chunk of 8 (T = 65, 128),
moves whose source is a later destination, garbage past each path, many caches per call (more
than one launch holds), int32/int64 indices, and CUDA-graph capture with new paths on replay.
Everything here skips without a GPU or without the compiled CUDA kernel.
"""

import pytest
import torch

from specdec_kernels import compact_kv_cache_

from conftest import TREE_KINDS, cuda_kernel_marks, randint
from test_kv_cache import CACHE_SPECS, brute_compact, make_caches, make_paths, overlapping_moves_case, random_tree_case

pytestmark = cuda_kernel_marks("compact_kv_cache_")


def to_cuda(x: torch.Tensor) -> torch.Tensor:
    """A CUDA copy with x's strides (an HF view stays a transposed view, a slice stays strided)."""
    out = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="cuda")
    out.copy_(x)
    return out


def check_cuda(caches, prefix, accepted, num_accepted):
    """compact_kv_cache_ with backend="cuda" on GPU copies equals the brute force (on the CPU) and
    backend="reference" (on other GPU copies); slots outside each row's path are untouched."""
    expected = [brute_compact(c, prefix, accepted, num_accepted) for c in caches]
    args = [to_cuda(t) for t in (prefix, accepted, num_accepted)]
    got = [to_cuda(c) for c in caches]
    ref = [to_cuda(c) for c in caches]
    assert all(g.stride() == c.stride() for g, c in zip(got, caches))
    new_lens = compact_kv_cache_(got, *args, backend="cuda")
    ref_lens = compact_kv_cache_(ref, *args, backend="reference")
    assert new_lens.device.type == "cuda" and new_lens.dtype == prefix.dtype
    assert torch.equal(new_lens, ref_lens)
    assert new_lens.cpu().tolist() == (prefix.long() + num_accepted.long() + 1).tolist()
    assert torch.equal(args[0].cpu(), prefix)  # the input lengths are not modified
    for i, (g, r, e) in enumerate(zip(got, ref, expected)):
        assert torch.equal(g, r), f"cache {i}: CUDA differs from the reference"
        assert torch.equal(g.cpu(), e), f"cache {i}: CUDA differs from the brute force"
    return got


@pytest.mark.parametrize("num_nodes", (1, 2, 7, 9, 26, 65, 128))
@pytest.mark.parametrize("kind", TREE_KINDS)
def test_random_trees(gen, kind, num_nodes):
    check_cuda(*random_tree_case(gen, kind, num_nodes, max_batch=6))


@pytest.mark.parametrize("num_nodes", (65, 128))
def test_full_length_chains_at_the_cache_end(gen, num_nodes):
    """Every node accepted (path longer than a thread's 8-row chunk), last row ending at S."""
    batch = 3
    accepted = torch.arange(num_nodes, dtype=torch.int32).expand(batch, -1).clone()
    num_accepted = torch.full((batch,), num_nodes - 1, dtype=torch.int32)
    num_accepted[2] = num_nodes // 2
    prefix = torch.tensor([0, 17, 50], dtype=torch.int32)
    caches = make_caches(gen, batch, 50 + num_nodes, [(2, 64, torch.bfloat16, "hf", 0), (1, 5, torch.float16, "slice", 0)])
    check_cuda(caches, prefix, accepted, num_accepted)


@pytest.mark.parametrize("path", [[0, 2, 3], [0, 2, 4, 6, 8], [0, 5, 6, 7], [0, 1, 2, 3], [0]])
def test_overlapping_moves(gen, path):
    """Each slot holds its own index, so a wrong copy order shows as a wrong value."""
    caches, prefix, accepted, num_accepted = overlapping_moves_case(gen, path)
    got = check_cuda(caches, prefix, accepted, num_accepted)
    for b in range(prefix.shape[0]):
        start = int(prefix[b])
        assert got[0][b, start : start + len(path), 0, 0].tolist() == [float(start + p) for p in path]


def test_garbage_past_each_path(gen):
    accepted = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7], [0, 3, 5, 99, -7, 1000, 2, 2],
                             [0, -1, -1, -1, -1, -1, -1, -1], [0, 2, 3, 7, -1, -1, -1, -1]])
    num_accepted = torch.tensor([7, 2, 0, 3])
    prefix = torch.tensor([2, 0, 11, 4])
    check_cuda(make_caches(gen, 4, 11 + 8), prefix, accepted, num_accepted)


@pytest.mark.parametrize("lens_dtype", (torch.int32, torch.int64), ids=str)
@pytest.mark.parametrize("nodes_dtype", (torch.int32, torch.int64), ids=str)
def test_index_dtypes(gen, lens_dtype, nodes_dtype):
    accepted, num_accepted = make_paths(gen, 3, 9, "random")
    prefix = randint(gen, 0, 20, (3,))
    caches = make_caches(gen, 3, int(prefix.max()) + 9, CACHE_SPECS[:2])
    check_cuda(caches, prefix.to(lens_dtype), accepted.to(nodes_dtype), num_accepted.to(nodes_dtype))


@pytest.mark.parametrize("num_caches", (1, 64, 256, 257, 600))
def test_many_caches_one_call(gen, num_caches):
    """Up to 256 caches per launch: 257 and 600 take several launches, the lengths written once."""
    batch, num_nodes = 3, 12
    accepted, num_accepted = make_paths(gen, batch, num_nodes, "bushy")
    prefix = randint(gen, 0, 30, (batch,)).to(torch.int32)
    specs = [(2, 8, torch.bfloat16, "hf", 0), (1, 3, torch.float32, "slice", 2), (4, 128, torch.float16, "contiguous", 1)]
    caches = make_caches(gen, batch, int(prefix.max()) + num_nodes, [specs[i % 3] for i in range(num_caches)])
    check_cuda(caches, prefix, accepted, num_accepted)


def test_wide_rows_and_large_batch(gen):
    """Rows wider than one block's vectors (several slices per row) and a batch of 200."""
    batch, num_nodes = 200, 16
    accepted, num_accepted = make_paths(gen, batch, num_nodes, "random")
    prefix = randint(gen, 0, 50, (batch,)).to(torch.int32)
    specs = [(32, 128, torch.bfloat16, "contiguous", 0), (8, 256, torch.float32, "hf", 3)]
    check_cuda(make_caches(gen, batch, int(prefix.max()) + num_nodes, specs), prefix, accepted, num_accepted)


def test_degenerate_cache_shapes(gen):
    accepted = torch.tensor([[0, 2, 3, -1], [0, 1, -1, -1]])
    num_accepted = torch.tensor([2, 1])
    prefix = torch.tensor([1, 2], dtype=torch.int32)
    caches = [torch.randn(2, 6, 0, 4, generator=gen), torch.randn(2, 7, 2, 0, generator=gen),
              torch.randn(2, 6, 2, 3, generator=gen)]
    check_cuda(caches, prefix, accepted, num_accepted)


def test_cuda_graph_capture_and_replay(gen):
    """Captured once, replayed with new paths and lengths written into the same tensors."""
    batch, num_nodes = 4, 33
    caches_cpu = make_caches(gen, batch, 40 + num_nodes, CACHE_SPECS[:2])
    caches = [to_cuda(c) for c in caches_cpu]
    accepted, num_accepted = make_paths(gen, batch, num_nodes, "random")
    prefix = randint(gen, 0, 41, (batch,)).to(torch.int32)
    static = [to_cuda(t.to(torch.int32)) for t in (prefix, accepted, num_accepted)]
    compact_kv_cache_(caches, *static, backend="cuda")  # warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        new_lens = compact_kv_cache_(caches, *static, backend="cuda")
    for _ in range(2):
        accepted, num_accepted = make_paths(gen, batch, num_nodes, "random")
        prefix = randint(gen, 0, 41, (batch,)).to(torch.int32)
        for dst, src in zip(static, (prefix, accepted.to(torch.int32), num_accepted.to(torch.int32))):
            dst.copy_(src)
        for c, original in zip(caches, caches_cpu):
            c.copy_(original)
        graph.replay()
        torch.cuda.synchronize()
        assert new_lens.cpu().tolist() == (prefix + num_accepted + 1).tolist()
        for c, original in zip(caches, caches_cpu):
            assert torch.equal(c.cpu(), brute_compact(original, prefix, accepted, num_accepted))
