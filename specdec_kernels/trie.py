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
