"""Reference n-gram (prompt lookup) drafting: find the history's suffix earlier in the history."""

import torch

from ..trie import merge_sequences


def _matches(s: torch.Tensor, min_n: int, max_n: int):
    """(n, positions) for the longest n in [min_n, max_n] whose suffix s[N-n:] occurs at some
    j <= N - n - 1 (so at least one token follows the match), or (0, empty)."""
    num = s.shape[0]
    for n in range(max_n, min_n - 1, -1):
        if num < n + 1:
            continue
        windows = s.unfold(0, n, 1)[: num - n]  # windows[j] = s[j : j + n], j <= N - n - 1
        positions = torch.nonzero((windows == s[num - n :]).all(dim=1)).flatten()
        if positions.numel() > 0:
            return n, positions
    return 0, s.new_empty(0, dtype=torch.int64)


def ngram_propose(tokens, lengths, min_n: int, max_n: int, num_tokens: int, policy: str):
    """draft_tokens [B, num_tokens] (tokens' dtype, -1 padded), draft_lens int32 [B]."""
    batch = tokens.shape[0]
    drafts = torch.full((batch, num_tokens), -1, dtype=tokens.dtype, device=tokens.device)
    draft_lens = torch.zeros(batch, dtype=torch.int32, device=tokens.device)
    for b in range(batch):
        s = tokens[b, : int(lengths[b])]
        n, positions = _matches(s, min_n, max_n)
        if n == 0:
            continue
        j = int(positions[0] if policy == "earliest" else positions[-1])
        proposal = s[j + n : j + n + num_tokens]
        drafts[b, : proposal.numel()] = proposal
        draft_lens[b] = proposal.numel()
    return drafts, draft_lens


def ngram_propose_tree(tokens, lengths, min_n, max_n, num_tokens, tree_width, max_nodes, policy):
    """Up to `tree_width` distinct continuations of the longest match, merged into a trie.

    For the longest n with a match, every match position j gives the continuation
    s[j + n : j + n + num_tokens] (shorter where the history ends). Distinct continuations
    are ranked by how many positions give them (ties: first occurrence for "earliest", last
    occurrence for "latest"); the best `tree_width` are inserted into a trie under the root
    (node 0 = the last token), shared prefixes once, nodes numbered in insertion order,
    stopping when `max_nodes` drafted nodes are used.
    Returns tree_tokens [B, 1 + max_nodes] (tokens' dtype, -1 padded) and parents int64
    [B, 1 + max_nodes] (-1 for the root and padding).
    """
    roots, continuations = [], []
    for b in range(tokens.shape[0]):
        s = tokens[b, : int(lengths[b])].tolist()
        roots.append(s[-1] if s else -1)
        n, positions = _matches(torch.tensor(s, dtype=torch.int64), min_n, max_n)
        stats = {}  # continuation -> (count, first position, last position)
        for j in positions.tolist():
            cont = tuple(s[j + n : j + n + num_tokens])
            count, first, _ = stats.get(cont, (0, j, j))
            stats[cont] = (count + 1, first, j)
        if policy == "earliest":
            ranked = sorted(stats, key=lambda c: (-stats[c][0], stats[c][1]))
        else:
            ranked = sorted(stats, key=lambda c: (-stats[c][0], -stats[c][2]))
        continuations.append(ranked[:tree_width])
    tree_tokens, parents = merge_sequences(roots, continuations, max_nodes)
    return tree_tokens.to(device=tokens.device, dtype=tokens.dtype), parents.to(tokens.device)
