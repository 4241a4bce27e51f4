"""N-gram (prompt lookup) drafting: propose what followed the latest n tokens earlier on.

These ops rescan each history (the compiled CPU kernel: one SIMD pass per row, rows over
threads). A serving loop that appends a few tokens per step can use
`specdec_kernels.ops.ngram_index.NgramIndex` instead: the same drafts without the rescan.
"""

from typing import Optional

import torch

from . import _checks
from ._extension import dispatch
from .tree import TokenTree

POLICIES = _checks.NGRAM_POLICIES


def ngram_propose(
    tokens: torch.Tensor,
    lengths: torch.Tensor,
    *,
    min_n: int = 1,
    max_n: int = 4,
    num_tokens: int = 5,
    policy: str = "earliest",
    backend: Optional[str] = None,
):
    """Propose a draft chain per row by finding the history's last n tokens earlier in it.

    For row b with history s = tokens[b, :N], N = lengths[b]: for n from max_n down to
    min_n, find the positions j <= N - n - 1 with s[j:j+n] == s[N-n:N]; at the first n that
    has any, take the smallest j ("earliest") or the largest ("latest") and propose
    s[j+n : min(j+n+num_tokens, N)].

    Args:
        tokens: int32/int64 [B, L] histories: token ids >= 0 (ValueError with value checks
            on; -1 is the padding value, never a token). Entries past lengths[b] are ignored.
        lengths: int [B], 0 <= lengths[b] <= L.
        backend: force an implementation ("reference", "cpu", "cuda"); None picks the best.

    Returns:
        (draft_tokens [B, num_tokens] in tokens' dtype, -1 padded; draft_lens int32 [B], 0 = no match).
    """
    args = _checks.ngram_propose(tokens, lengths, min_n, max_n, num_tokens, policy)
    return dispatch("ngram_propose", backend, tokens, *args)


def ngram_propose_tree(
    tokens: torch.Tensor,
    lengths: torch.Tensor,
    *,
    min_n: int = 1,
    max_n: int = 4,
    num_tokens: int = 5,
    tree_width: int = 4,
    max_nodes: Optional[int] = None,
    policy: str = "earliest",
    backend: Optional[str] = None,
) -> TokenTree:
    """Propose a token tree per row: several distinct continuations of the longest match.

    For the longest n (as in `ngram_propose`), every match position j gives the continuation
    s[j+n : j+n+num_tokens]. Distinct continuations are ranked by how many positions give
    them (ties: the earliest, or with policy="latest" the latest occurrence first); the best
    `tree_width` are merged into one trie under the root (the last token), shared prefixes
    once, nodes numbered in rank order, at most `max_nodes` drafted nodes. Siblings are
    distinct, so the tree verifies with draft_probs=None.

    Args:
        tokens, lengths, min_n, max_n, num_tokens, policy, backend: as in `ngram_propose`.
        tree_width: how many continuations to merge (>= 1).
        max_nodes: drafted-node budget (default tree_width * num_tokens, i.e. no truncation).

    Returns:
        TokenTree with T = 1 + max_nodes: tokens in tokens' dtype (-1 padded; -1 root for an
        empty history) and parents int64 (-1 for root and padding).
    """
    args = _checks.ngram_propose_tree(tokens, lengths, min_n, max_n, num_tokens, tree_width, max_nodes, policy)
    return TokenTree._from_op(*dispatch("ngram_propose_tree", backend, tokens, *args))
