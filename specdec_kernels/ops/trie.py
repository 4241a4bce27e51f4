"""Merging token sequences into one trie per row: how several drafts become one token tree."""

import torch


class _RowTrie:
    """One row's trie under its root (node 0): nodes numbered in insertion order, at most
    `size` nodes; tokens and parents as lists, -1 padded."""

    def __init__(self, root_token: int, size: int):
        self.tokens, self.parents = [-1] * size, [-1] * size
        self.tokens[0] = int(root_token)
        self.children, self.used = {}, 1  # (parent node, token) -> node

    def child(self, node: int, token: int):
        """The node holding `token` under `node`, added if new; None when the trie is full."""
        key = (node, int(token))
        if key not in self.children:
            if self.used == len(self.tokens):
                return None
            self.children[key] = self.used
            self.tokens[self.used], self.parents[self.used] = key[1], node
            self.used += 1
        return self.children[key]


def merge_sequences(root_tokens, sequences, max_nodes: int):
    """Merge each row's token sequences into one trie under its root; shared prefixes once.

    root_tokens: per row, the root token; sequences: per row, token sequences continuing the
    root, in priority order (earlier sequences get lower node numbers). Stops adding nodes
    at `max_nodes` drafted nodes. Returns (tokens, parents), int64 [B, 1 + max_nodes], -1 padded.
    """
    tries = [_RowTrie(root, 1 + max_nodes) for root in root_tokens]
    for trie, row in zip(tries, sequences):
        for seq in row:
            node = 0
            for tok in seq:
                node = trie.child(node, tok)
                if node is None:
                    break
    return (torch.tensor([t.tokens for t in tries], dtype=torch.int64).view(len(tries), 1 + max_nodes),
            torch.tensor([t.parents for t in tries], dtype=torch.int64).view(len(tries), 1 + max_nodes))


def merge_scored_trees(root_tokens, trees, scores, max_nodes: int):
    """Merge each row's token trees into one trie under its root, keeping node scores.

    trees: (tokens [B, T_i], parents [B, T_i]) pairs in priority order (node 0 the root,
    parents before children, -1 padding); scores: per tree, float [B, T_i] path scores. A
    node several trees propose appears once with the highest of its scores. Stops adding nodes
    at `max_nodes` drafted nodes (a dropped node's descendants are dropped too). Returns
    (tokens, parents) int64 [B, 1 + max_nodes], -1 padded, and scores float32 (root 1, padding 0).
    """
    size = 1 + max_nodes
    tries = [_RowTrie(root, size) for root in root_tokens]
    merged = [[1.0] + [0.0] * max_nodes for _ in tries]
    lists = [(t.tolist(), p.tolist(), s.tolist()) for (t, p), s in zip(trees, scores)]
    for b, trie in enumerate(tries):
        for tree_tokens, tree_parents, tree_scores in lists:
            node_of = {0: 0}  # this tree's node -> merged node
            for i in range(1, len(tree_tokens[b])):
                parent = tree_parents[b][i]
                if parent < 0 or parent not in node_of:
                    continue  # padding, or under a node that did not fit
                node = trie.child(node_of[parent], tree_tokens[b][i])
                if node is None:
                    continue
                node_of[i] = node
                merged[b][node] = max(merged[b][node], tree_scores[b][i])
    return (torch.tensor([t.tokens for t in tries], dtype=torch.int64).view(len(tries), size),
            torch.tensor([t.parents for t in tries], dtype=torch.int64).view(len(tries), size),
            torch.tensor(merged, dtype=torch.float32).view(len(tries), size))
