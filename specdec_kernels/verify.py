"""Verification: accept drafted tokens so the output is exactly the target's (lossless).

The rules (greedy rows, deterministic drafts, SpecInfer multi-step speculative sampling with
draft probabilities, non-finite logits, randomness) are documented in
`specdec_kernels/reference/verify.py`, the ground truth every backend matches.
"""

from typing import NamedTuple, Optional, Union

import torch

from . import _checks
from ._extension import dispatch
from .philox import row_seeds

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
        tree_tokens: int [B, T]; node 0 is the root (the last emitted token).
        parents: int [B, T] or [T]; see `specdec_kernels.tree`.
        draft_probs: [B, T, V] or None. Given: the children of node i were drawn
            independently from draft_probs[b, i] (siblings may repeat). None: the children
            are deterministic proposals and siblings must be distinct.
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
    _checks.tensor("target_logits", target_logits, dims=3, dtypes=_checks.FLOAT_DTYPES)
    _checks.nonempty_batch("target_logits", target_logits)
    batch, num_nodes, vocab = target_logits.shape
    if num_nodes == 0 or vocab == 0:
        _checks.fail("target_logits", f"expected T >= 1 nodes and V >= 1 tokens, got shape {tuple(target_logits.shape)}")
    device = target_logits.device
    _checks.tensor("tree_tokens", tree_tokens, dims=2, dtypes=_checks.INT_DTYPES)
    _checks.shape("tree_tokens", tree_tokens, (batch, num_nodes))
    _checks.tensor("parents", parents, dims=(1, 2), dtypes=_checks.INT_DTYPES)
    _checks.shape("parents", parents, (batch, num_nodes)[2 - parents.dim() :])
    if draft_probs is not None:
        _checks.tensor("draft_probs", draft_probs, dims=3, dtypes=_checks.FLOAT_DTYPES)
        _checks.shape("draft_probs", draft_probs, (batch, num_nodes, vocab))
    _checks.same_device("target_logits", target_logits, tree_tokens=tree_tokens, parents=parents, draft_probs=draft_probs)
    _checks.last_dim_contiguous("target_logits", target_logits)

    parents_2d = _checks.parents_2d(parents).expand(batch, -1)
    real = _checks.real_nodes(parents_2d)
    drafted = real.clone()
    drafted[:, 0] = False
    _checks.token_ids("tree_tokens", tree_tokens, drafted, vocab)

    temperature = _checks.per_row("temperature", temperature, batch, device, torch.float32, default=1.0)
    top_k = _checks.per_row("top_k", top_k, batch, device, torch.int64, default=0, integral=True)
    top_p = _checks.per_row("top_p", top_p, batch, device, torch.float32, default=1.0)
    seed = row_seeds(seed, batch, device)
    if _checks.checking_values():
        if not torch.isfinite(temperature).all() or (temperature < 0).any():
            _checks.fail("temperature", "expected finite values >= 0 (0 = greedy)")
        if (top_k < 0).any():
            _checks.fail("top_k", "expected values >= 0 (0 = off)")
        if not ((top_p > 0) & (top_p <= 1)).all():
            _checks.fail("top_p", "expected values in (0, 1] (1 = off)")
        if draft_probs is None:
            _check_distinct_siblings(tree_tokens, parents_2d, drafted)

    accepted_nodes, num_accepted, output_tokens = dispatch(
        "verify",
        backend,
        device,
        target_logits,
        tree_tokens.to(torch.int64),
        parents_2d,
        draft_probs,
        temperature,
        top_k,
        top_p,
        seed,
    )
    return VerifyOutput(accepted_nodes, num_accepted, output_tokens)


def _check_distinct_siblings(tree_tokens, parents_2d, drafted):
    """Deterministic drafts need distinct siblings: the target picks one token per node."""
    same_parent = parents_2d[:, :, None] == parents_2d[:, None, :]
    same_token = tree_tokens[:, :, None] == tree_tokens[:, None, :]
    both = drafted[:, :, None] & drafted[:, None, :]
    earlier = torch.ones_like(same_parent).triu(diagonal=1)
    repeated = same_parent & same_token & both & earlier
    if repeated.any():
        b, i, j = (int(v) for v in torch.nonzero(repeated)[0])
        _checks.fail(
            "tree_tokens",
            f"row {b}: sibling nodes {i} and {j} both hold token {int(tree_tokens[b, i])}; with "
            "draft_probs=None siblings must be distinct (pass draft_probs if they were sampled)",
        )


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
            from) or None.
        temperature, top_k, top_p, seed, backend: as in `verify`.

    Returns:
        VerifyOutput with T = K + 1, as `verify` on the chain tree.
    """
    _checks.tensor("target_logits", target_logits, dims=3, dtypes=_checks.FLOAT_DTYPES)
    _checks.tensor("draft_tokens", draft_tokens, dims=2, dtypes=_checks.INT_DTYPES)
    batch, num_nodes, vocab = target_logits.shape
    k = num_nodes - 1
    _checks.shape("draft_tokens", draft_tokens, (batch, k))
    _checks.same_device("target_logits", target_logits, draft_tokens=draft_tokens)
    _checks.token_ids("draft_tokens", draft_tokens, torch.ones_like(draft_tokens, dtype=torch.bool), vocab)
    # The chain as a tree: node i + 1 is draft i; the root token is not used by verify.
    tree_tokens = torch.cat([draft_tokens.new_zeros(batch, 1), draft_tokens], dim=1)
    parents = torch.arange(-1, k, device=draft_tokens.device)
    tree_draft_probs = None
    if draft_probs is not None:
        _checks.tensor("draft_probs", draft_probs, dims=3, dtypes=_checks.FLOAT_DTYPES)
        _checks.shape("draft_probs", draft_probs, (batch, k, vocab))
        # Node i's children (draft i) were drawn from draft_probs[:, i]; the last node has none.
        tree_draft_probs = torch.cat([draft_probs, draft_probs.new_zeros(batch, 1, vocab)], dim=1)
    return verify(
        target_logits,
        tree_tokens,
        parents,
        draft_probs=tree_draft_probs,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        backend=backend,
    )
