"""Merging token sequences into one trie per row: how several drafts become one token tree."""

import torch


def merge_sequences(root_tokens, sequences, max_nodes: int):
    """Merge each row's token sequences into one trie under its root; shared prefixes once.

    root_tokens: per row, the root token; sequences: per row, token sequences continuing the
    root, in priority order (earlier sequences get lower node numbers). Stops adding nodes
    at `max_nodes` drafted nodes. Returns (tokens, parents), int64 [B, 1 + max_nodes], -1 padded.
    """
    batch, size = len(root_tokens), 1 + max_nodes
    tokens = torch.full((batch, size), -1, dtype=torch.int64)
    parents = torch.full((batch, size), -1, dtype=torch.int64)
    for b in range(batch):
        tokens[b, 0] = int(root_tokens[b])
        children, used = {}, 1  # (parent node, token) -> node
        for seq in sequences[b]:
            node = 0
            for tok in seq:
                key = (node, int(tok))
                if key not in children:
                    if used == size:
                        break
                    children[key] = used
                    tokens[b, used], parents[b, used] = key[1], node
                    used += 1
                node = children[key]
    return tokens, parents


def merge_scored_trees(root_tokens, trees, scores, max_nodes: int):
    """Merge each row's token trees into one trie under its root, keeping node scores.

    trees: (tokens [B, T_i], parents [B, T_i]) pairs in priority order (node 0 the root,
    parents before children, -1 padding); scores: per tree, float [B, T_i] path scores. A
    node several trees propose appears once with the highest of its scores. Stops adding nodes
    at `max_nodes` drafted nodes (a dropped node's descendants are dropped too). Returns
    (tokens, parents) int64 [B, 1 + max_nodes], -1 padded, and scores float32 (root 1, padding 0).
    """
    batch, size = len(root_tokens), 1 + max_nodes
    tokens = [[-1] * size for _ in range(batch)]
    parents = [[-1] * size for _ in range(batch)]
    merged = [[0.0] * size for _ in range(batch)]
    lists = [(t.tolist(), p.tolist(), s.tolist()) for (t, p), s in zip(trees, scores)]
    for b in range(batch):
        tokens[b][0], merged[b][0] = int(root_tokens[b]), 1.0
        children, used = {}, 1  # (parent node, token) -> node
        for tree_tokens, tree_parents, tree_scores in lists:
            node_of = {0: 0}  # this tree's node -> merged node
            for i in range(1, len(tree_tokens[b])):
                parent = tree_parents[b][i]
                if parent < 0 or parent not in node_of:
                    continue  # padding, or under a node that did not fit
                key = (node_of[parent], tree_tokens[b][i])
                if key not in children:
                    if used == size:
                        continue
                    children[key] = used
                    tokens[b][used], parents[b][used] = key[1], key[0]
                    used += 1
                node = children[key]
                node_of[i] = node
                merged[b][node] = max(merged[b][node], tree_scores[b][i])
    return torch.tensor(tokens), torch.tensor(parents), torch.tensor(merged, dtype=torch.float32)
