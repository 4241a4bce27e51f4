"""Token trees: `tree_mask`, `pack_tree_mask` and `TokenTree`.

Every op is checked against a brute force written in plain Python (parent-link walks, bit
arithmetic on Python ints), and every backend available on the CPU against `reference`.
"""

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels import TokenTree, pack_tree_mask, tree_mask

from conftest import TREE_KINDS, ancestors, distinct_sibling_tokens, randint, random_parents

TREE_MASK_BACKENDS = [None] + sk.available_backends("tree_mask", "cpu")
PACK_BACKENDS = [None] + sk.available_backends("pack_tree_mask", "cpu")

# Sizes around the 64-bit word boundaries of the packed mask.
NODE_COUNTS = (1, 2, 3, 7, 31, 63, 64, 65, 100, 127, 128, 129, 130)


# ----------------------------------------------------------------------------- brute force


def brute_tree_mask(parents: torch.Tensor) -> list:
    """[B][T][T] Python bools: j is i or an ancestor of i (padding nodes see only themselves)."""
    out = []
    for row in parents.tolist():
        num = len(row)
        rows = []
        for i in range(num):
            seen = set(ancestors(row, i))
            rows.append([j in seen for j in range(num)])
        out.append(rows)
    return out


def to_signed64(word: int) -> int:
    return word - (1 << 64) if word >= (1 << 63) else word


def brute_pack(mask: torch.Tensor) -> list:
    """Pack the last dim of a bool [..., K] mask: bit j % 64 of word j // 64, as signed int64."""
    flat = mask.reshape(-1, mask.shape[-1]).tolist()
    num_words = (mask.shape[-1] + 63) // 64
    words = []
    for bits in flat:
        row = []
        for w in range(num_words):
            word = 0
            for j in range(64 * w, min(64 * w + 64, len(bits))):
                if bits[j]:
                    word |= 1 << (j - 64 * w)
            row.append(to_signed64(word))
        words.append(row)
    return words


def brute_unpack(packed: torch.Tensor, num_keys: int) -> list:
    out = []
    for words in packed.reshape(-1, packed.shape[-1]).tolist():
        out.append([bool((words[j // 64] >> (j % 64)) & 1) for j in range(num_keys)])
    return out


def brute_depth(row: list, i: int) -> int:
    if i > 0 and row[i] < 0:
        return -1
    return len(ancestors(row, i)) - 1


def brute_trie(root_tokens, sequences, max_nodes):
    """Plain-Python trie merge: (tokens, parents) as [B][1 + max_nodes] lists, -1 padded."""
    all_tokens, all_parents = [], []
    for root, seqs in zip(root_tokens, sequences):
        nodes = [(int(root), -1)]  # (token, parent)
        for seq in seqs:
            cur = 0
            for tok in seq:
                child = None
                for idx in range(1, len(nodes)):
                    if nodes[idx] == (int(tok), cur):
                        child = idx
                        break
                if child is None:
                    if len(nodes) - 1 >= max_nodes:
                        break
                    nodes.append((int(tok), cur))
                    child = len(nodes) - 1
                cur = child
        pad = 1 + max_nodes - len(nodes)
        all_tokens.append([t for t, _ in nodes] + [-1] * pad)
        all_parents.append([p for _, p in nodes] + [-1] * pad)
    return all_tokens, all_parents


# ----------------------------------------------------------------------------- tree_mask


@pytest.mark.parametrize("num_nodes", NODE_COUNTS)
@pytest.mark.parametrize("kind", TREE_KINDS)
def test_tree_mask_matches_bruteforce(gen, kind, num_nodes):
    batch = int(randint(gen, 1, 4))
    parents = random_parents(gen, batch, num_nodes, kind, ragged=True)
    expected = torch.tensor(brute_tree_mask(parents), dtype=torch.bool)
    ref = tree_mask(parents, backend="reference")
    assert ref.dtype == torch.bool and ref.shape == (batch, num_nodes, num_nodes)
    assert torch.equal(ref, expected)
    for backend in TREE_MASK_BACKENDS:
        out = tree_mask(parents, backend=backend)
        assert out.dtype == torch.bool and out.shape == (batch, num_nodes, num_nodes), backend
        assert torch.equal(out, ref), f"backend={backend}"


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("kind", TREE_KINDS)
def test_tree_mask_int_dtypes_and_unragged(gen, kind, dtype):
    num_nodes = int(randint(gen, 1, 131))
    parents = random_parents(gen, 3, num_nodes, kind, ragged=False).to(dtype)
    expected = torch.tensor(brute_tree_mask(parents), dtype=torch.bool)
    for backend in TREE_MASK_BACKENDS + ["reference"]:
        assert torch.equal(tree_mask(parents, backend=backend), expected), f"backend={backend}"


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("num_nodes", (1, 5, 64, 65, 129))
def test_tree_mask_1d_input(gen, num_nodes, dtype):
    parents = random_parents(gen, 1, num_nodes, "random", ragged=True)[0].to(dtype)
    expected = torch.tensor(brute_tree_mask(parents[None]), dtype=torch.bool)[0]
    for backend in TREE_MASK_BACKENDS + ["reference"]:
        out = tree_mask(parents, backend=backend)
        assert out.shape == (num_nodes, num_nodes)
        assert torch.equal(out, expected), f"backend={backend}"


def test_tree_mask_known_values():
    # root, two children, a grandchild under node 2, then padding.
    parents = torch.tensor([-1, 0, 0, 2, -1, -1])
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 0, 1, 0, 0, 0],
            [1, 0, 1, 1, 0, 0],
            [0, 0, 0, 0, 1, 0],
            [0, 0, 0, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    for backend in TREE_MASK_BACKENDS + ["reference"]:
        assert torch.equal(tree_mask(parents, backend=backend), expected)


def test_tree_mask_noncontiguous_parents(gen):
    parents = random_parents(gen, 4, 70, "random", ragged=True)
    wide = torch.full((4, 140), 7, dtype=torch.int64)
    wide[:, ::2] = parents
    view = wide[:, ::2]
    assert not view.is_contiguous()
    expected = torch.tensor(brute_tree_mask(parents), dtype=torch.bool)
    for backend in TREE_MASK_BACKENDS + ["reference"]:
        assert torch.equal(tree_mask(view, backend=backend), expected)


@pytest.mark.parametrize(
    "parents, why",
    [
        (torch.tensor([0, 0, 1]), "root"),
        (torch.tensor([-1, 1, 1]), "topological"),
        (torch.tensor([-1, 0, 3, 1]), "topological"),
        (torch.tensor([-1, 0, -2]), "topological"),
        (torch.tensor([[-1, 0, 1], [-1, -1, 0]]), "trailing"),
        (torch.tensor([-1.0, 0.0]), "dtype"),
        (torch.zeros(1, 2, 3, dtype=torch.int64), "D"),
        (torch.zeros(0, 3, dtype=torch.int64), "empty"),
        (torch.zeros(2, 0, dtype=torch.int64), "T = 0"),
        ([-1, 0, 1], "torch.Tensor"),
    ],
)
def test_tree_mask_bad_parents(parents, why):
    with pytest.raises(ValueError, match=r"^parents:.*" + why):
        tree_mask(parents)


# ----------------------------------------------------------------------------- pack_tree_mask


@pytest.mark.parametrize("num_nodes", NODE_COUNTS)
def test_pack_tree_mask_bits(gen, num_nodes):
    batch = int(randint(gen, 1, 4))
    mask = torch.rand(batch, num_nodes, num_nodes, generator=gen) < 0.5
    # Force interesting words: an all-ones row (word -1), and bit 63 set (a negative word).
    mask[0, 0] = True
    if num_nodes >= 64:
        mask[:, :, 63] = True
        mask[-1, -1] = False
        mask[-1, -1, 63] = True  # exactly the sign bit: word == -2**63
    expected = torch.tensor(brute_pack(mask), dtype=torch.int64).reshape(batch, num_nodes, -1)
    num_words = (num_nodes + 63) // 64
    ref = pack_tree_mask(mask, backend="reference")
    assert ref.dtype == torch.int64 and ref.shape == (batch, num_nodes, num_words)
    assert torch.equal(ref, expected)
    if num_nodes >= 64:
        assert (ref[..., 0] < 0).all()
        assert int(ref[-1, -1, 0]) == -(2**63)
    for backend in PACK_BACKENDS:
        out = pack_tree_mask(mask, backend=backend)
        assert out.dtype == torch.int64 and out.shape == (batch, num_nodes, num_words)
        assert torch.equal(out, ref), f"backend={backend}"


@pytest.mark.parametrize("num_nodes", NODE_COUNTS)
@pytest.mark.parametrize("kind", ("chain", "random", "deep"))
def test_pack_tree_mask_round_trip(gen, kind, num_nodes):
    parents = random_parents(gen, 2, num_nodes, kind, ragged=True)
    mask = tree_mask(parents)
    for backend in PACK_BACKENDS + ["reference"]:
        packed = pack_tree_mask(mask, backend=backend)
        assert torch.equal(torch.tensor(brute_unpack(packed, num_nodes)).reshape(mask.shape), mask)
        assert torch.equal(sk.reference.unpack_tree_mask(packed, num_nodes), mask)
        assert packed.tolist() == torch.tensor(brute_pack(mask)).reshape(packed.shape).tolist()


def test_pack_tree_mask_2d_and_noncontiguous(gen):
    num_nodes = 97
    mask = torch.rand(num_nodes, num_nodes, generator=gen) < 0.3
    expected = torch.tensor(brute_pack(mask), dtype=torch.int64)
    transposed = mask.t().contiguous().t()  # same values, column-major strides
    assert not transposed.is_contiguous()
    for backend in PACK_BACKENDS + ["reference"]:
        assert torch.equal(pack_tree_mask(mask, backend=backend), expected)
        assert torch.equal(pack_tree_mask(transposed, backend=backend), expected)


@pytest.mark.parametrize(
    "mask, why",
    [
        (torch.zeros(3, 3, dtype=torch.int64), "dtype"),
        (torch.zeros(3, dtype=torch.bool), "D"),
        (torch.zeros(1, 1, 3, 3, dtype=torch.bool), "D"),
    ],
)
def test_pack_tree_mask_bad_input(mask, why):
    with pytest.raises(ValueError, match=r"^mask:.*" + why):
        pack_tree_mask(mask)


# ----------------------------------------------------------------------------- TokenTree


def random_tree(gen, batch, num_nodes, kind, dtype=torch.int64):
    parents = random_parents(gen, batch, num_nodes, kind, ragged=True)
    tokens = distinct_sibling_tokens(gen, parents, vocab=200).to(dtype)
    return TokenTree(tokens, parents), parents


@pytest.mark.parametrize("kind", TREE_KINDS)
@pytest.mark.parametrize("num_nodes", (1, 2, 9, 66))
def test_token_tree_structure(gen, kind, num_nodes):
    batch = 3
    tree, parents = random_tree(gen, batch, num_nodes, kind)
    rows = parents.tolist()
    tokens = tree.tokens.tolist()
    assert tree.batch_size == batch
    assert tree.parents.dtype == torch.int64 and tree.parents.tolist() == rows
    # num_nodes: root + nodes with a parent.
    assert tree.num_nodes.tolist() == [1 + sum(p >= 0 for p in row[1:]) for row in rows]
    # depths: number of ancestors; padding -1.
    assert tree.depths.tolist() == [[brute_depth(row, i) for i in range(num_nodes)] for row in rows]
    # paths from the root.
    for b in range(batch):
        for i in range(num_nodes):
            if i > 0 and rows[b][i] < 0:
                continue  # padding: no path
            expected = ancestors(rows[b], i)[::-1]
            assert tree.path(b, i) == expected
            assert tree.path_tokens(b, i) == [tokens[b][j] for j in expected]
    # position ids: prefix + depth (padding: the prefix).
    prefix = randint(gen, 0, 1000, (batch,)).to(torch.int32)
    pos = tree.position_ids(prefix)
    assert pos.dtype == torch.int64
    expected = [[int(prefix[b]) + max(brute_depth(rows[b], i), 0) for i in range(num_nodes)] for b in range(batch)]
    assert pos.tolist() == expected
    # masks
    assert torch.equal(tree.mask(), torch.tensor(brute_tree_mask(parents)))
    assert torch.equal(tree.mask(packed=True), pack_tree_mask(tree.mask()))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_token_tree_shared_parents(gen, dtype):
    parents = random_parents(gen, 1, 12, "bushy", ragged=False)[0].to(dtype)
    tokens = randint(gen, 0, 100, (4, 12))
    tree = TokenTree(tokens, parents)
    assert tree.parents.shape == (4, 12)
    assert tree.parents.dtype == torch.int64
    assert all(row == parents.tolist() for row in tree.parents.tolist())
    assert tree.num_nodes.tolist() == [12] * 4
    assert tree.mask().shape == (4, 12, 12)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("k", (1, 4, 70))
def test_token_tree_chain(gen, k, dtype):
    batch = 4
    roots = randint(gen, 0, 1000, (batch,)).to(dtype)
    drafts = randint(gen, 0, 1000, (batch, k)).to(dtype)
    full = TokenTree.chain(roots, drafts)
    assert full.tokens.dtype == dtype
    assert full.tokens.tolist() == [[int(roots[b])] + drafts[b].tolist() for b in range(batch)]
    assert full.parents.tolist() == [list(range(-1, k))] * batch
    assert full.depths.tolist() == [list(range(k + 1))] * batch

    lens = randint(gen, 0, k + 1, (batch,))
    lens[0], lens[-1] = 0, k
    for lens_dtype in (torch.int32, torch.int64):
        tree = TokenTree.chain(roots, drafts, lens.to(lens_dtype))
        for b in range(batch):
            n = int(lens[b])
            assert tree.tokens[b].tolist() == [int(roots[b])] + drafts[b, :n].tolist() + [-1] * (k - n)
            assert tree.parents[b].tolist() == list(range(-1, n)) + [-1] * (k - n)
            assert tree.path_tokens(b, n) == [int(roots[b])] + drafts[b, :n].tolist()
        assert tree.num_nodes.tolist() == (lens + 1).tolist()
        assert torch.equal(tree.mask(), torch.tensor(brute_tree_mask(tree.parents)))


def random_sequences(gen, num_seqs, vocab, max_len):
    """Draft sequences with many shared prefixes (small vocab, copied prefixes, duplicates)."""
    seqs = []
    for _ in range(num_seqs):
        length = int(randint(gen, 0, max_len + 1))
        if seqs and float(torch.rand((), generator=gen)) < 0.5:
            base = seqs[int(randint(gen, 0, len(seqs)))]
            keep = int(randint(gen, 0, len(base) + 1))
            seq = base[:keep] + randint(gen, 0, vocab, (max(length - keep, 0),)).tolist()
        else:
            seq = randint(gen, 0, vocab, (length,)).tolist()
        seqs.append(seq)
    return seqs


def check_tree_invariants(tokens: list, parents: list):
    """Topological order, trailing padding, distinct siblings."""
    assert parents[0] == -1
    real = [0]
    padding = False
    for i in range(1, len(parents)):
        if parents[i] == -1:
            padding = True
            assert tokens[i] == -1
            continue
        assert not padding, "real node after padding"
        assert 0 <= parents[i] < i
        real.append(i)
    pairs = [(parents[i], tokens[i]) for i in real[1:]]
    assert len(pairs) == len(set(pairs)), "siblings must be distinct"


@pytest.mark.parametrize("vocab, num_seqs, max_len", [(2, 6, 6), (3, 10, 4), (5, 4, 9), (1000, 5, 5)])
def test_token_tree_from_sequences(gen, vocab, num_seqs, max_len):
    batch = 4
    roots = randint(gen, 0, vocab, (batch,)).tolist()
    sequences = [random_sequences(gen, int(randint(gen, 0, num_seqs + 1)), vocab, max_len) for _ in range(batch)]
    sequences[0] = []  # a row with nothing drafted
    full_budget = num_seqs * max_len
    for max_nodes in (0, 1, 3, int(randint(gen, 0, full_budget + 1)), full_budget):
        tree = TokenTree.from_sequences(roots, sequences, max_nodes)
        exp_tokens, exp_parents = brute_trie(roots, sequences, max_nodes)
        assert tree.tokens.shape == (batch, 1 + max_nodes)
        assert tree.tokens.tolist() == exp_tokens
        assert tree.parents.tolist() == exp_parents
        for b in range(batch):
            check_tree_invariants(exp_tokens[b], exp_parents[b])
            # Distinct prefixes of the sequences, in first-seen order: the untruncated node set.
            prefixes = []
            for seq in sequences[b]:
                for n in range(1, len(seq) + 1):
                    if tuple(seq[:n]) not in prefixes:
                        prefixes.append(tuple(seq[:n]))
            assert int(tree.num_nodes[b]) == 1 + min(len(prefixes), max_nodes)
            if max_nodes >= len(prefixes):
                # Every sequence is a root-to-node path, shared prefixes once.
                for seq in sequences[b]:
                    node = 0
                    for tok in seq:
                        children = [i for i in range(1, max_nodes + 1) if exp_parents[b][i] == node and exp_tokens[b][i] == tok]
                        assert len(children) == 1
                        node = children[0]
                    assert tree.path_tokens(b, node) == [roots[b]] + list(seq)


def test_token_tree_from_sequences_known():
    tree = TokenTree.from_sequences([7], [[[1, 2, 3], [1, 2, 4], [5], [1, 2, 3], [1, 6]]], max_nodes=5)
    assert tree.tokens.tolist() == [[7, 1, 2, 3, 4, 5]]
    assert tree.parents.tolist() == [[-1, 0, 1, 2, 2, 0]]
    # Budget: [1, 6] does not fit; [5] fits before it.
    tree = TokenTree.from_sequences([7], [[[1, 2, 3], [1, 2, 4], [5], [1, 6]]], max_nodes=4)
    assert tree.tokens.tolist() == [[7, 1, 2, 3, 4]]
    assert tree.parents.tolist() == [[-1, 0, 1, 2, 2]]


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(tokens=torch.zeros(2, 3), parents=torch.tensor([-1, 0, 1])), "tokens"),
        (dict(tokens=torch.zeros(3, dtype=torch.int64), parents=torch.tensor([-1, 0, 1])), "tokens"),
        (dict(tokens=torch.zeros(2, 3, dtype=torch.int64), parents=torch.tensor([-1, 0, 1, 2])), "parents"),
        (dict(tokens=torch.zeros(2, 3, dtype=torch.int64), parents=torch.tensor([-1, 2, 1])), "parents"),
        (dict(tokens=torch.zeros(2, 3, dtype=torch.int64), parents=torch.tensor([-1.0, 0.0, 1.0])), "parents"),
    ],
)
def test_token_tree_bad_input(kwargs, name):
    with pytest.raises(ValueError, match=f"^{name}:"):
        TokenTree(**kwargs)


def test_token_tree_parents_batch_mismatch():
    with pytest.raises(ValueError, match="^parents:"):
        TokenTree(torch.zeros(2, 3, dtype=torch.int64), torch.tensor([[-1, 0, 1]] * 3))


def test_depths_are_kept_until_the_parents_change():
    """`TokenTree.depths` is computed once per parents tensor and values: asked again it is the
    same tensor; after an in-place change or a new parents tensor it is computed again."""
    tree = TokenTree(torch.tensor([[5, 1, 2, 3]]), torch.tensor([[-1, 0, 1, 1]]))
    first = tree.depths
    assert first.tolist() == [[0, 1, 2, 2]] and tree.depths is first
    tree.parents[0, 3] = 0  # in place
    assert tree.depths.tolist() == [[0, 1, 2, 1]]
    tree.parents = torch.tensor([[-1, 0, 1, 2]])  # replaced
    assert tree.depths.tolist() == [[0, 1, 2, 3]]
    with torch.inference_mode():  # inference tensors (no version counter) too
        inner = TokenTree(torch.tensor([[5, 1, 2]]), torch.tensor([[-1, 0, 1]]))
        assert inner.depths.tolist() == [[0, 1, 2]]
        inner.parents[0, 2] = 0
        assert inner.depths.tolist() == [[0, 1, 1]]
