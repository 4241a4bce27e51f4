"""Reference verification: lossless acceptance of a token tree (or chain) against the target.

The tree is walked from the root, one depth per step, all rows at once. At the current node
the target's distribution p (temperature, then top-k, then top-p) decides among its children:

* greedy rows (temperature 0): the child whose token is argmax(logits) (lowest id on ties;
  the first such child if siblings repeat); otherwise that argmax token is emitted.
* deterministic drafts (draft_probs None, distinct siblings): sample y ~ p; move to the child
  whose token is y, or emit y. This is sequential sampling itself, so it is exact.
* drafts with probabilities (SpecInfer multi-step speculative sampling; the children of node
  i were drawn i.i.d. from q = draft_probs[b, i]): children in index order, child x is
  accepted iff u * q(x) < r(x) (u uniform in (0, 1), r the current residual, r = p at first);
  on rejection r <- normalise(max(r - q, 0)). When every child is rejected, a token is
  sampled from r. A drafted token with q(x) = 0 is accepted iff r(x) > 0 (its ratio is +inf).
  If max(r - q, 0) sums to zero (r == q up to rounding; probability zero in exact
  arithmetic), r is left unchanged.

Sampling uses the exponential race: argmax_v w_v / E_v with E_v = -log(u_v) picks v with
probability w_v / sum(w); it needs no normalisation and no prefix sum, and it reads the
uniforms of (seed, node, PURPOSE_SAMPLE, v). Non-finite logits have a defined result: NaN
is probability 0, +inf tokens share all the probability, and a node whose logits are all
-inf or NaN emits token 0. Emitted ids are always in [0, V).
"""

import torch

from ..philox import PURPOSE_ACCEPT, PURPOSE_SAMPLE, uniform
from ..sampling import greedy_tokens, target_probs

def sample_race(weights: torch.Tensor, seed: torch.Tensor, node: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """One token per row, v with probability weights[v] / sum(weights) (weights >= 0, not all 0).

    Rows where `active` is False (greedy or finished) get an unspecified token; when no row
    is active the random numbers are not even drawn.
    """
    vocab = weights.shape[-1]
    if not active.any():
        return torch.zeros(weights.shape[0], dtype=torch.int64, device=weights.device)
    ids = torch.arange(vocab, device=weights.device)
    u = uniform(seed[:, None], node[:, None], PURPOSE_SAMPLE, ids[None, :])
    exponential = -torch.log(u)
    return torch.argmax(weights / exponential, dim=-1)


def verify(target_logits, tree_tokens, parents, draft_probs, temperature, top_k, top_p, seed):
    """Walk the tree from the root; see the module docstring for the rules.

    target_logits [B, T, V]; tree_tokens int64 [B, T]; parents int64 [B, T]; draft_probs
    [B, T, V] or None; temperature fp32 [B]; top_k int64 [B]; top_p fp32 [B]; seed int64 [B].
    Returns (accepted_nodes int32 [B, T], num_accepted int32 [B], output_tokens int64 [B, T]).
    """
    batch, num_nodes, _ = target_logits.shape
    device = target_logits.device
    rows = torch.arange(batch, device=device)
    node_ids = torch.arange(num_nodes, device=device)
    greedy = temperature == 0

    accepted_nodes = torch.full((batch, num_nodes), -1, dtype=torch.int64, device=device)
    accepted_nodes[:, 0] = 0
    output_tokens = torch.full((batch, num_nodes), -1, dtype=torch.int64, device=device)
    num_accepted = torch.zeros(batch, dtype=torch.int64, device=device)
    cur = torch.zeros(batch, dtype=torch.int64, device=device)
    finished = torch.zeros(batch, dtype=torch.bool, device=device)

    while not finished.all():
        logits = target_logits[rows, cur]
        argmax = greedy_tokens(logits)
        # With only greedy rows, nothing is sampled and draft probabilities do not matter.
        probs = None if greedy.all() else target_probs(logits, temperature, top_k, top_p)
        next_node = torch.full((batch,), -1, dtype=torch.int64, device=device)

        if draft_probs is None or probs is None:
            y = argmax if probs is None else torch.where(greedy, argmax, sample_race(probs, seed, cur, ~greedy & ~finished))
            is_match = (parents == cur[:, None]) & (tree_tokens == y[:, None]) & (node_ids > 0)
            next_node = torch.where(is_match.any(-1), is_match.int().argmax(-1), next_node)
            emitted = y
        else:
            q = draft_probs[rows, cur].float().nan_to_num(nan=0.0).clamp(min=0.0)
            residual = probs
            decided = finished.clone()
            for j in range(1, num_nodes):
                is_child = (parents[:, j] == cur) & ~decided
                x = tree_tokens[:, j].clamp(0, q.shape[-1] - 1)
                u = uniform(seed, j, PURPOSE_ACCEPT, 0)
                q_x, r_x = q[rows, x], residual[rows, x]
                accept = torch.where(greedy, x == argmax, u * q_x < r_x) & is_child
                reject = is_child & ~accept & ~greedy
                next_node = torch.where(accept, j, next_node)
                decided |= accept
                updated = (residual - q).clamp(min=0.0)
                total = updated.sum(-1, keepdim=True)
                updated = torch.where(total > 0, updated / total, residual)
                residual = torch.where(reject[:, None], updated, residual)
            emitted = torch.where(greedy, argmax, sample_race(residual, seed, cur, ~greedy & ~finished))

        moves = ~finished & (next_node >= 0)
        stops = ~finished & (next_node < 0)
        output_tokens[rows[moves], num_accepted[moves]] = tree_tokens[rows[moves], next_node[moves]]
        accepted_nodes[rows[moves], num_accepted[moves] + 1] = next_node[moves]
        output_tokens[rows[stops], num_accepted[stops]] = emitted[stops]
        num_accepted += moves.long()
        cur = torch.where(moves, next_node, cur)
        finished |= stops

    return accepted_nodes.int(), num_accepted.int(), output_tokens
