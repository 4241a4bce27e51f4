"""Token trees: `TokenTree`, `tree_mask` and `pack_tree_mask`.

A tree of T nodes per row is `parents [B, T]`: node 0 is the root (parent -1), every other
real node has 0 <= parent < its own index (topological order), trailing padding nodes have
parent -1. A chain of K drafts is parents = [-1, 0, 1, ..., K-1].
"""

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from . import _checks
from ._extension import dispatch
from .trie import merge_sequences


def tree_mask(parents: torch.Tensor, *, backend: Optional[str] = None) -> torch.Tensor:
    """Ancestor mask of a token tree.

    Args:
        parents: int [B, T] (or [T], one tree for every row); see the module docstring.
        backend: force an implementation ("reference", "cpu", "cuda"); None picks the best.

    Returns:
        bool [B, T, T] ([T, T] for a [T] input): [b, i, j] is true iff node j is node i or
        one of its ancestors. Padding nodes see only themselves.
    """
    args = _checks.tree_mask(parents)
    mask = dispatch("tree_mask", backend, parents, *args)
    return mask if parents.dim() == 2 else mask[0]


def pack_tree_mask(mask: torch.Tensor, *, backend: Optional[str] = None) -> torch.Tensor:
    """Pack a bool tree mask into 64-bit words.

    Args:
        mask: bool [B, T, T] or [T, T].

    Returns:
        int64 [B, T, ceil(T/64)] (or [T, ceil(T/64)]): bit j % 64 of word j // 64 is mask[..., j].
    """
    args = _checks.pack_tree_mask(mask)
    packed = dispatch("pack_tree_mask", backend, mask, *args)
    return packed if mask.dim() == 3 else packed[0]


@dataclass
class TokenTree:
    """A batch of token trees: `tokens [B, T]` (node 0 = root token) and `parents [B, T]`.

    Padding nodes have parent -1 (and usually token -1). Build one with `TokenTree.chain`,
    `TokenTree.from_sequences`, or directly from tensors.
    """

    tokens: torch.Tensor
    parents: torch.Tensor

    def __post_init__(self):
        self.tokens, self.parents = _checks.token_tree(self.tokens, self.parents)

    @classmethod
    def _from_op(cls, tokens: torch.Tensor, parents: torch.Tensor) -> "TokenTree":
        """A tree valid by construction ([B, T] tokens and int64 parents, as an op, a trie
        merge or a cut of a valid tree returns them): not checked again, which would cost
        more than drafting on short histories."""
        tree = object.__new__(cls)
        tree.tokens, tree.parents = tokens, parents
        return tree

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def num_nodes(self) -> torch.Tensor:
        """int64 [B]: real nodes per row, root included."""
        return _checks.real_nodes(self.parents).sum(-1)

    @property
    def depths(self) -> torch.Tensor:
        """int64 [B, T]: root 0, a child one more than its parent, padding -1 (computed once per
        `parents`: the tensor returned is shared, not to be changed in place)."""
        # Kept while `parents` is the same tensor with the same values (one comparison; inference
        # tensors have no version counter): a decode step asks for a tree's depths several times
        # (the loop, the planner, the merge), and each computation is ~15 small ops.
        # A root-only tree (a plain decoding step) has depth 0 whatever its values: no
        # comparison, which on a GPU would be a host sync in every plain step.
        parents = self.parents
        cached = self.__dict__.get("_depths")
        if cached is not None and cached[0] is parents and (parents.shape[1] == 1 or torch.equal(cached[1], parents)):
            return cached[2]
        depths = self._compute_depths()
        self._keep_depths(depths)
        return depths

    def _keep_depths(self, depths: torch.Tensor) -> None:
        """Remember `depths` as this tree's (a constructor that knows them saves computing them)."""
        self.__dict__["_depths"] = (self.parents, self.parents.clone(), depths)

    def _compute_depths(self) -> torch.Tensor:
        # Pointer doubling: after round k, `up` is each node's 2**k-th ancestor (the root
        # stops there) and `depth` counts the edges to it; log2(T) rounds instead of T.
        has_parent = self.parents >= 0
        node = torch.arange(self.parents.shape[1], device=self.parents.device).expand_as(self.parents)
        up = torch.where(has_parent, self.parents, node)
        depth = has_parent.long()
        for _ in range(max(self.parents.shape[1] - 1, 0).bit_length()):
            depth = depth + depth.gather(1, up)
            up = up.gather(1, up)
        padding = ~has_parent
        padding[:, 0] = False
        return depth.masked_fill(padding, -1)

    def position_ids(self, prefix_lens: torch.Tensor) -> torch.Tensor:
        """int64 [B, T]: position of each node in its sequence, prefix_len + depth (padding: prefix_len)."""
        return prefix_lens.to(torch.int64)[:, None] + self.depths.clamp(min=0)

    def mask(self, packed: bool = False) -> torch.Tensor:
        """The ancestor mask (`tree_mask`), packed with `pack_tree_mask` if asked."""
        mask = tree_mask(self.parents)
        return pack_tree_mask(mask) if packed else mask

    def path(self, row: int, node: int) -> list:
        """Node indices from the root to `node` (both included) in `row`."""
        if node > 0 and int(self.parents[row, node]) < 0:
            _checks.fail("node", f"node {node} of row {row} is a padding node; it has no path")
        path = [node]
        while path[-1] > 0:
            path.append(int(self.parents[row, path[-1]]))
        return path[::-1]

    def path_tokens(self, row: int, node: int) -> list:
        """Token ids along `path(row, node)`, root token first."""
        return [int(self.tokens[row, i]) for i in self.path(row, node)]

    def to(self, device) -> "TokenTree":
        return TokenTree(self.tokens.to(device), self.parents.to(device))

    @classmethod
    def chain(cls, root_tokens: torch.Tensor, draft_tokens: torch.Tensor, draft_lens=None) -> "TokenTree":
        """A chain per row: root, then draft_tokens[b, :draft_lens[b]] (all K if None)."""
        batch, k = draft_tokens.shape
        device = draft_tokens.device
        tokens = torch.cat([root_tokens.reshape(batch, 1).to(draft_tokens.dtype), draft_tokens], dim=1)
        parents = torch.arange(-1, k, device=device).expand(batch, -1).clone()
        # A chain's depths are its node indices (padding -1): known here, and a plain decoding
        # step (a root-only chain) would otherwise spend ~10 small ops computing them.
        depths = torch.arange(k + 1, device=device).expand(batch, -1).contiguous()
        if draft_lens is not None:
            is_pad = torch.arange(k + 1, device=device)[None, :] > draft_lens.to(device)[:, None]
            parents = parents.masked_fill(is_pad, -1)  # (not parents[is_pad]: a host sync on a GPU)
            tokens = tokens.masked_fill(is_pad, -1)
            depths = depths.masked_fill(is_pad, -1)
        tree = cls(tokens, parents)
        tree._keep_depths(depths)
        return tree

    @classmethod
    def from_sequences(
        cls, root_tokens: Sequence[int], sequences: Sequence[Sequence[Sequence[int]]], max_nodes: int
    ) -> "TokenTree":
        """Merge each row's draft sequences into one trie (shared prefixes appear once).

        Args:
            root_tokens: the root token of each row.
            sequences: per row, a list of token sequences continuing the root, in priority
                order; earlier sequences get lower node numbers.
            max_nodes: drafted-node budget per row; nodes past it are dropped.

        Returns:
            A TokenTree with T = 1 + max_nodes (tokens and parents -1 padded). Siblings are
            distinct, as deterministic verification requires.
        """
        tokens, parents = merge_sequences(root_tokens, sequences, max_nodes)
        return cls(tokens, parents)
