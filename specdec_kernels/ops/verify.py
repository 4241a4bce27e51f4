"""Verification: accept drafted tokens so the output is exactly the target's (lossless).

The rules (greedy rows, deterministic drafts, SpecInfer multi-step speculative sampling with
draft probabilities, non-finite logits, randomness) are documented in
`specdec_kernels/reference/verify.py`, the ground truth every backend matches.
"""

from typing import NamedTuple, Optional, Union

import torch

from . import _checks, philox
from ._extension import dispatch

Scalar = Union[int, float]


class VerifyOutput(NamedTuple):
    """Result of `verify` / `verify_chain`.

    accepted_nodes: int32 [B, T], the accepted path from the root (node 0 first), -1 padded.
    num_accepted: int32 [B], accepted draft nodes (the root not counted).
    output_tokens: int64 [B, T], the num_accepted + 1 emitted tokens (accepted drafts, then
        the correction or bonus token), -1 padded.
    """

    accepted_nodes: torch.Tensor
    num_accepted: torch.Tensor
    output_tokens: torch.Tensor


def verify(
    target_logits: torch.Tensor,
    tree_tokens: torch.Tensor,
    parents: torch.Tensor,
    *,
    draft_probs: Optional[torch.Tensor] = None,
    temperature: Union[Scalar, torch.Tensor] = 1.0,
    top_k: Union[None, int, torch.Tensor] = None,
    top_p: Union[None, float, torch.Tensor] = None,
    seed: Union[None, int, torch.Tensor] = None,
    backend: Optional[str] = None,
) -> VerifyOutput:
    """Decide which drafted tree nodes the target accepts and which token comes next.

    Args:
        target_logits: [B, T, V] fp32/bf16/fp16; node i's logits predict the token after node i.
        tree_tokens: int [B, T]; node 0 is the root (the last emitted token). Every drafted
            node's token must be in [0, V), the root's in [0, V) or -1 (no token, as
            `ngram_propose_tree` returns for an empty history; the root is not read);
            ValueError otherwise, with value checks on. Padding nodes may hold anything.
        parents: int [B, T] or [T]; see `specdec_kernels.ops.tree`.
        draft_probs: [B, T, V] or None. Given: the children of node i were drawn
            independently from draft_probs[b, i] (siblings may repeat). None: the children
            are deterministic proposals and siblings must be distinct. The row of every
            node with children must be a probability distribution: no NaN, no negative
            entry, summing to 1 within 1e-2 (any dtype: 16-bit-rounded probabilities), else ValueError
            (value checks on). Rows of nodes without children (leaves, padding) are not
            used and may hold anything. With value checks off, a bad row is read as the
            reference reads it (NaN and negative entries as 0, the sum as given).
        temperature: float or [B]; rows with 0 are greedy.
        top_k: None, int or int [B] (0 = off), applied to the target like sequential sampling.
        top_p: None, float or [B] in (0, 1] (1 = off), applied after top-k.
        seed: None, int (each row its own stream) or int64 [B]. Same seed and inputs give
            the same result; a row's result depends only on its own seed and inputs.
        backend: force an implementation ("reference", "cpu", "cuda", "triton"); None picks the best.

    Returns:
        VerifyOutput(accepted_nodes, num_accepted, output_tokens). Sampled rows emit tokens
        distributed exactly as sequential sampling from the warped target; greedy rows emit
        the target's argmax chain (lowest id on ties).
    """
    args = _checks.verify(target_logits, tree_tokens, parents, draft_probs, temperature, top_k, top_p)
    seed = philox.row_seeds(seed, args[0].shape[0], target_logits.device)
    return VerifyOutput(*dispatch("verify", backend, target_logits, *args, seed))


def verify_greedy(target_tokens: torch.Tensor, tree_tokens: torch.Tensor, parents: torch.Tensor) -> VerifyOutput:
    """`verify(target_logits, tree_tokens, parents, temperature=0)` from each node's greedy
    token alone: target_tokens int [B, T] = `sampling.greedy_tokens(target_logits)` (what the
    greedy rule reads of the logits; `small_linear_argmax` computes it without them). The same
    result: from the root, move to the first child holding the node's token, emit the tokens
    of the accepted children and then the last node's own. Host code over the tensors' values
    (one read of each): trees of a few nodes a row, as a CPU step verifies."""
    if tree_tokens.dim() != 2 or target_tokens.shape != tree_tokens.shape or parents.shape != tree_tokens.shape:
        raise ValueError(f"verify_greedy: target_tokens, tree_tokens and parents must all be [B, T], got "
                         f"{tuple(target_tokens.shape)}, {tuple(tree_tokens.shape)}, {tuple(parents.shape)}")
    if any(t.dtype.is_floating_point or t.dtype == torch.bool for t in (target_tokens, tree_tokens, parents)):
        raise ValueError("verify_greedy: target_tokens, tree_tokens and parents must be integer tensors")
    batch, nodes = tree_tokens.shape
    if nodes == 0:
        raise ValueError("verify_greedy: a tree has at least its root (T >= 1)")
    targets, tokens, links = target_tokens.tolist(), tree_tokens.tolist(), parents.tolist()
    accepted = [[-1] * nodes for _ in range(batch)]
    emitted = [[-1] * nodes for _ in range(batch)]
    counts = []
    for b in range(batch):
        row_tokens, row_links, path, out = tokens[b], links[b], accepted[b], emitted[b]
        path[0], cur, count = 0, 0, 0
        while True:  # emit the node's token; move to its first child holding it, if any
            token = out[count] = targets[b][cur]
            child = next((j for j in range(cur + 1, nodes) if row_links[j] == cur and row_tokens[j] == token), -1)
            if child < 0:
                break
            count += 1
            path[count] = cur = child
        counts.append(count)
    device = tree_tokens.device
    return VerifyOutput(torch.tensor(accepted, dtype=torch.int32, device=device),
                        torch.tensor(counts, dtype=torch.int32, device=device),
                        torch.tensor(emitted, dtype=torch.int64, device=device))


def verify_chain(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    *,
    draft_probs: Optional[torch.Tensor] = None,
    temperature: Union[Scalar, torch.Tensor] = 1.0,
    top_k: Union[None, int, torch.Tensor] = None,
    top_p: Union[None, float, torch.Tensor] = None,
    seed: Union[None, int, torch.Tensor] = None,
    backend: Optional[str] = None,
) -> VerifyOutput:
    """`verify` for a chain of K drafts per row, in the usual layout.

    Args:
        target_logits: [B, K+1, V]; target_logits[:, i] follows the root and the first i drafts.
        draft_tokens: int [B, K].
        draft_probs: [B, K, V] (draft_probs[:, i]: the distribution draft token i was sampled
            from) or None; every row a distribution, as in `verify`.
        temperature, top_k, top_p, seed, backend: as in `verify`.

    Returns:
        VerifyOutput with T = K + 1, as `verify` on the chain tree.
    """
    batch, k, vocab = _checks.verify_chain(target_logits, draft_tokens, draft_probs)
    sampling = _checks.sampling(target_logits, temperature, top_k, top_p, batch)
    seed = philox.row_seeds(seed, batch, target_logits.device)
    # The chain as a tree: node i + 1 is draft i; the root token is not read by verify.
    tree_tokens = torch.cat([draft_tokens.new_zeros(batch, 1), draft_tokens], dim=1).to(torch.int64)
    parents = torch.arange(-1, k, device=draft_tokens.device).expand(batch, -1)
    tree_draft_probs = None
    if draft_probs is not None:
        # Node i's children (draft i) were drawn from draft_probs[:, i]; the last node has none.
        tree_draft_probs = torch.cat([draft_probs, draft_probs.new_zeros(batch, 1, vocab)], dim=1)
    args = (target_logits, tree_tokens, parents, tree_draft_probs) + sampling + (seed,)
    return VerifyOutput(*dispatch("verify", backend, target_logits, *args))
