"""Reference token-tree ops: ancestor masks and their packed form."""

import torch


def tree_mask(parents: torch.Tensor) -> torch.Tensor:
    """bool [B, T, T]: [b, i, j] is true iff node j is node i or one of its ancestors.

    parents: int64 [B, T] in topological order, so a node's ancestors are known before it.
    Padding nodes (parent -1) see only themselves.
    """
    batch, num_nodes = parents.shape
    mask = torch.zeros(batch, num_nodes, num_nodes, dtype=torch.bool, device=parents.device)
    rows = torch.arange(batch, device=parents.device)
    for i in range(num_nodes):
        parent = parents[:, i]
        inherited = mask[rows, parent.clamp(min=0)] & (parent >= 0)[:, None]
        mask[:, i] = inherited
        mask[:, i, i] = True
    return mask


def pack_tree_mask(mask: torch.Tensor) -> torch.Tensor:
    """int64 [..., T, ceil(T/64)]: bit j % 64 of word j // 64 is mask[..., j]."""
    num_keys = mask.shape[-1]
    num_words = (num_keys + 63) // 64
    padded = torch.zeros(*mask.shape[:-1], num_words * 64, dtype=torch.int64, device=mask.device)
    padded[..., :num_keys] = mask.to(torch.int64)
    bits = padded.view(*mask.shape[:-1], num_words, 64)
    # Bits are disjoint, so the sum equals the bitwise OR (bit 63 wraps to the sign bit).
    weights = torch.ones(64, dtype=torch.int64, device=mask.device) << torch.arange(64, device=mask.device)
    return (bits * weights).sum(-1)


def unpack_tree_mask(packed: torch.Tensor, num_keys: int) -> torch.Tensor:
    """Inverse of `pack_tree_mask`: bool [..., num_keys]."""
    j = torch.arange(num_keys, device=packed.device)
    words = packed[..., j // 64]
    return ((words >> (j % 64)) & 1).bool()
