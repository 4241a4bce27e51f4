"""The target's sampling distribution as sequential sampling defines it: NaN/inf logits made
safe, greedy argmax, and softmax(logits / temperature) restricted to top-k then top-p.

Library code (drafters mirror the target's warping) and the reference `verify` both use it.
"""

import torch

FP32_MAX = torch.finfo(torch.float32).max


def sanitize_logits(logits: torch.Tensor) -> torch.Tensor:
    """fp32 logits with NaN -> -inf (probability 0) and +inf -> the largest finite float."""
    x = logits.float()
    x = torch.where(torch.isnan(x), float("-inf"), x)
    return x.clamp(max=FP32_MAX)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim, lowest index on ties; NaN never wins."""
    return torch.argmax(sanitize_logits(logits), dim=-1)


def target_probs(logits, temperature, top_k, top_p) -> torch.Tensor:
    """fp32 [N, V]: softmax(logits / temperature) restricted to top-k, then to top-p, renormalised.

    logits [N, V]; temperature fp32 [N] (0 is treated as 1 here; greedy rows do not sample);
    top_k int64 [N] (0 or >= V: off); top_p fp32 [N] (1: off).
    top-k keeps every token whose logit is >= the k-th largest (ties at the boundary kept).
    top-p keeps token v iff the probability mass of tokens strictly more likely than v is
    < top_p: the smallest most-likely set reaching top_p, boundary ties kept.
    """
    vocab = logits.shape[-1]
    temp = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    x = sanitize_logits(logits)
    # Subtract the row max before dividing: x / T overflows for tiny T (1e-39 would make
    # every finite logit +max and tie them), (x - max) / T only underflows towards -inf.
    row_max = x.amax(dim=-1, keepdim=True)
    x = (x - torch.where(torch.isfinite(row_max), row_max, 0.0)) / temp[:, None]

    use_top_k = (top_k > 0) & (top_k < vocab)
    if use_top_k.any():  # (the sorts are skipped when no row needs them: pure speed)
        sorted_x = torch.sort(x, dim=-1, descending=True).values
        kth_largest = sorted_x.gather(-1, (top_k.clamp(1, vocab) - 1)[:, None])
        x = torch.where(use_top_k[:, None] & (x < kth_largest), float("-inf"), x)

    # A node with nothing left (all -inf / NaN) emits token 0: give it all the mass.
    nothing_left = torch.isneginf(x).all(dim=-1, keepdim=True)
    is_token_0 = torch.arange(vocab, device=x.device) == 0
    x = torch.where(nothing_left & is_token_0, 0.0, x)
    probs = torch.softmax(x, dim=-1)

    if (top_p < 1.0).any():
        sorted_p = torch.sort(probs, dim=-1, descending=True).values
        mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        num_kept = (mass_before < top_p[:, None]).sum(-1, keepdim=True).clamp(min=1)
        smallest_kept = sorted_p.gather(-1, num_kept - 1)
        keep = (probs >= smallest_kept) | (top_p[:, None] >= 1.0)
        probs = torch.where(keep, probs, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs
