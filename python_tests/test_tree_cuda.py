"""The CUDA `tree_mask` and `pack_tree_mask` kernels (csrc/include/specdec/tree.cuh) against the
reference and the brute forces of test_tree.py.

The CUDA tree-attention tests build their masks with these kernels for both sides, so a wrong
mask would pass there: here the masks themselves are checked, bool and packed, at sizes around
the 64-bit word boundaries (T = 63, 64, 65, 128, 129: one, two and three words per row).
Everything here skips without a GPU or without the compiled CUDA kernels.
"""

import pytest
import torch

from specdec_kernels import pack_tree_mask, tree_mask

from conftest import TREE_KINDS, cuda_kernel_marks, randint, random_parents
from test_tree import brute_pack, brute_tree_mask

pytestmark = cuda_kernel_marks("tree_mask", "pack_tree_mask")

NODE_COUNTS = (1, 2, 17, 63, 64, 65, 127, 128, 129, 300)


def check_mask(parents_cpu: torch.Tensor, device_parents: torch.Tensor) -> torch.Tensor:
    """tree_mask on the GPU equals the reference and the brute force; returns the CUDA mask."""
    got = tree_mask(device_parents, backend="cuda")
    ref = tree_mask(device_parents, backend="reference")
    assert got.device == device_parents.device and got.dtype == torch.bool and got.is_contiguous()
    assert torch.equal(got, ref)
    rows = parents_cpu if parents_cpu.dim() == 2 else parents_cpu[None]
    brute = torch.tensor(brute_tree_mask(rows))
    assert torch.equal(got.cpu(), brute if parents_cpu.dim() == 2 else brute[0])
    return got


@pytest.mark.parametrize("num_nodes", NODE_COUNTS)
@pytest.mark.parametrize("kind", TREE_KINDS)
def test_tree_mask_matches_reference(gen, kind, num_nodes):
    parents = random_parents(gen, 3, num_nodes, kind, ragged=True)  # ragged: trailing padding nodes
    check_mask(parents, parents.cuda())


@pytest.mark.parametrize("dtype", (torch.int32, torch.int64), ids=str)
@pytest.mark.parametrize("num_nodes", (1, 65, 128))
def test_tree_mask_1d_int32_and_strided_parents(gen, num_nodes, dtype):
    parents = random_parents(gen, 2, num_nodes, "random", ragged=False)
    check_mask(parents[0], parents[0].to(dtype).cuda())  # one tree for every row: [T] -> [T, T]
    wide = torch.zeros(2, 2 * num_nodes, dtype=dtype, device="cuda")
    wide[:, ::2] = parents.to(dtype).cuda()
    check_mask(parents, wide[:, ::2])  # a strided view


def test_tree_mask_large_batch(gen):
    """Many rows: the grid-stride loop covers (row, node, word) items beyond one block."""
    parents = random_parents(gen, 257, 65, "bushy", ragged=True)
    got = tree_mask(parents.cuda(), backend="cuda")
    assert torch.equal(got, tree_mask(parents.cuda(), backend="reference"))


def check_pack(mask: torch.Tensor) -> torch.Tensor:
    got = pack_tree_mask(mask, backend="cuda")
    ref = pack_tree_mask(mask, backend="reference")
    words = (mask.shape[-1] + 63) // 64
    assert got.shape == (*mask.shape[:-1], words) and got.dtype == torch.int64 and got.device == mask.device
    assert torch.equal(got, ref)
    assert got.cpu().reshape(-1, words).tolist() == brute_pack(mask.cpu())
    return got


@pytest.mark.parametrize("num_nodes", NODE_COUNTS)
@pytest.mark.parametrize("kind", ("chain", "random", "deep"))
def test_pack_tree_masks(gen, kind, num_nodes):
    parents = random_parents(gen, 3, num_nodes, kind, ragged=True).cuda()
    check_pack(tree_mask(parents, backend="reference"))
    check_pack(tree_mask(parents[0], backend="reference"))  # [T, T] -> [T, W]


@pytest.mark.parametrize("num_nodes", (1, 63, 64, 65, 128, 129))
def test_pack_arbitrary_bits(gen, num_nodes):
    """Any bool mask, not only tree masks: random bits, all set (bit 63 = the sign bit), none set."""
    bits = torch.rand(4, num_nodes, num_nodes, generator=gen) < 0.5
    check_pack(bits.cuda())
    check_pack(torch.ones(2, num_nodes, num_nodes, dtype=torch.bool, device="cuda"))
    check_pack(torch.zeros(2, num_nodes, num_nodes, dtype=torch.bool, device="cuda"))


@pytest.mark.parametrize("num_nodes", (65, 128))
def test_pack_strided_and_expanded_views(gen, num_nodes):
    bits = (torch.rand(3, num_nodes, 2 * num_nodes, generator=gen) < 0.3).cuda()
    check_pack(bits[:, :, ::2])  # column stride 2
    check_pack(bits[:, :, :num_nodes].transpose(1, 2))  # transposed
    check_pack(bits[0, :, :num_nodes].expand(5, -1, -1))  # batch stride 0


@pytest.mark.parametrize("num_nodes", (17, 65, 128))
def test_cuda_mask_then_cuda_pack_round_trip(gen, num_nodes):
    """The path tree attention takes: both CUDA kernels in a row, against the reference pair."""
    parents = random_parents(gen, 5, num_nodes, "random", ragged=True).cuda()
    packed = pack_tree_mask(tree_mask(parents, backend="cuda"), backend="cuda")
    expected = pack_tree_mask(tree_mask(parents, backend="reference"), backend="reference")
    assert torch.equal(packed, expected)


def test_no_host_sync_inside_cuda_graph(gen):
    """Both kernels capture into a CUDA graph and replay on new parents (value checks are
    skipped during capture)."""
    num_nodes = int(randint(gen, 60, 130))
    parents = random_parents(gen, 4, num_nodes, "random", ragged=True).cuda()
    pack_tree_mask(tree_mask(parents, backend="cuda"), backend="cuda")  # warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        packed = pack_tree_mask(tree_mask(parents, backend="cuda"), backend="cuda")
    for _ in range(2):
        parents.copy_(random_parents(gen, 4, num_nodes, "random", ragged=True))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(packed, pack_tree_mask(tree_mask(parents, backend="reference"), backend="reference"))
