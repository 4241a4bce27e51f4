"""N-gram drafting: `ngram_propose` and `ngram_propose_tree` against brute forces on plain
Python lists (explicit searches), for every backend available on the CPU and backend=None."""

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels import ngram_propose, ngram_propose_tree

from conftest import HAS_CUDA, randint, requires_cuda

BACKENDS = [None] + sk.available_backends("ngram_propose", "cpu")
TREE_BACKENDS = [None] + sk.available_backends("ngram_propose_tree", "cpu")
POLICIES = ("earliest", "latest")
N_RANGES = [(1, 1), (1, 4), (2, 3), (3, 3), (1, 6), (4, 4)]


# ----------------------------------------------------------------------------- brute force


def brute_matches(s: list, min_n: int, max_n: int):
    """(n, [j...]) for the longest n whose suffix occurs at some j <= N - n - 1, else (0, [])."""
    num = len(s)
    for n in range(max_n, min_n - 1, -1):
        if num < n + 1:
            continue
        suffix = s[num - n :]
        found = []
        for j in range(num - n):
            ok = True
            for t in range(n):
                if s[j + t] != suffix[t]:
                    ok = False
                    break
            if ok:
                found.append(j)
        if found:
            return n, found
    return 0, []


def brute_propose(s: list, min_n, max_n, num_tokens, policy) -> list:
    n, found = brute_matches(s, min_n, max_n)
    if not found:
        return []
    j = found[0] if policy == "earliest" else found[-1]
    out = []
    pos = j + n
    while pos < len(s) and len(out) < num_tokens:
        out.append(s[pos])
        pos += 1
    return out


def brute_ranked_continuations(s, min_n, max_n, num_tokens, policy):
    """Distinct continuations, best first: count desc, then first (earliest) / last (latest) occurrence."""
    n, found = brute_matches(s, min_n, max_n)
    conts, counts, first, last = [], [], [], []
    for j in found:
        cont = s[j + n : j + n + num_tokens]
        if cont in conts:
            k = conts.index(cont)
            counts[k] += 1
            last[k] = j
        else:
            conts.append(cont)
            counts.append(1)
            first.append(j)
            last.append(j)
    remaining = list(range(len(conts)))
    ranked = []
    while remaining:  # selection: repeatedly take the best
        best = remaining[0]
        for k in remaining[1:]:
            if counts[k] > counts[best]:
                best = k
            elif counts[k] == counts[best]:
                if policy == "earliest" and first[k] < first[best]:
                    best = k
                if policy == "latest" and last[k] > last[best]:
                    best = k
        ranked.append((conts[best], counts[best]))
        remaining.remove(best)
    return ranked


def brute_tree(s, min_n, max_n, num_tokens, tree_width, max_nodes, policy):
    """(tokens, parents) lists of length 1 + max_nodes."""
    ranked = brute_ranked_continuations(s, min_n, max_n, num_tokens, policy)[:tree_width]
    tokens = [s[-1] if s else -1]
    parents = [-1]
    for cont, _ in ranked:
        node = 0
        for tok in cont:
            child = next((i for i in range(1, len(tokens)) if parents[i] == node and tokens[i] == tok), None)
            if child is None:
                if len(tokens) - 1 == max_nodes:
                    break
                tokens.append(tok)
                parents.append(node)
                child = len(tokens) - 1
            node = child
    pad = 1 + max_nodes - len(tokens)
    return tokens + [-1] * pad, parents + [-1] * pad


# ----------------------------------------------------------------------------- inputs


def zipf_tokens(gen, length, vocab=50, a=1.2):
    weights = torch.arange(1, vocab + 1, dtype=torch.float64) ** -a
    return torch.multinomial(weights, length, replacement=True, generator=gen).tolist() if length else []


def planted(gen, length, vocab=1000):
    """Random tokens with an earlier segment copied to the end (a long match), sometimes twice."""
    s = randint(gen, 0, vocab, (length,)).tolist()
    if length >= 8:
        seg = int(randint(gen, 2, max(3, length // 4)))
        start = int(randint(gen, 0, length - seg))
        s[length - seg :] = s[start : start + seg]
        if length >= 4 * seg and float(torch.rand((), generator=gen)) < 0.5:
            start2 = int(randint(gen, 0, length - 2 * seg))
            s[start2 : start2 + seg] = s[length - seg :]
    return s


def make_histories(gen, kind, lengths):
    out = []
    for n in lengths:
        if kind == "small_vocab":
            out.append(randint(gen, 0, int(randint(gen, 2, 6)), (n,)).tolist())
        elif kind == "zipf":
            out.append(zipf_tokens(gen, n))
        elif kind == "planted":
            out.append(planted(gen, n))
        else:
            raise ValueError(kind)
    return out


def pack(gen, histories, dtype, extra=3, garbage_vocab=6):
    """tokens [B, L] with garbage (same small vocab, plus negatives) past each row's length."""
    width = max([len(h) for h in histories] + [0]) + extra
    tokens = randint(gen, -2, garbage_vocab, (len(histories), width))
    for b, h in enumerate(histories):
        tokens[b, : len(h)] = torch.tensor(h, dtype=torch.int64)
    return tokens.to(dtype), torch.tensor([len(h) for h in histories])


def ragged_lengths(gen, batch, max_len, max_n):
    """Row lengths incl. 0, 1, shorter than n, exactly n, and random up to max_len."""
    fixed = [0, 1, max(max_n - 1, 0), max_n, max_n + 1, max_len]
    return fixed + [int(randint(gen, 0, max_len + 1)) for _ in range(batch - len(fixed))]


# ----------------------------------------------------------------------------- ngram_propose


def check_propose(tokens, lengths, histories, *, min_n, max_n, num_tokens, policy):
    batch = len(histories)
    expected = [brute_propose(h, min_n, max_n, num_tokens, policy) for h in histories]
    exp_drafts = torch.tensor([e + [-1] * (num_tokens - len(e)) for e in expected], dtype=tokens.dtype).reshape(batch, num_tokens)
    exp_lens = [len(e) for e in expected]
    kwargs = dict(min_n=min_n, max_n=max_n, num_tokens=num_tokens, policy=policy)
    ref = ngram_propose(tokens, lengths, **kwargs, backend="reference")
    for backend in ["reference"] + BACKENDS:
        drafts, draft_lens = ngram_propose(tokens, lengths, **kwargs, backend=backend)
        assert drafts.dtype == tokens.dtype and drafts.shape == (batch, num_tokens), backend
        assert draft_lens.dtype == torch.int32 and draft_lens.shape == (batch,), backend
        assert draft_lens.tolist() == exp_lens, backend
        assert torch.equal(drafts, exp_drafts), backend
        assert torch.equal(drafts, ref[0]) and torch.equal(draft_lens, ref[1])
    return expected


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("min_n, max_n", N_RANGES)
@pytest.mark.parametrize("kind", ("small_vocab", "zipf", "planted"))
def test_propose_random(gen, kind, min_n, max_n, policy):
    num_tokens = int(randint(gen, 1, 12))
    histories = make_histories(gen, kind, ragged_lengths(gen, 10, 300, max_n))
    dtype = (torch.int32, torch.int64)[int(randint(gen, 0, 2))]
    tokens, lengths = pack(gen, histories, dtype)
    lengths = lengths.to((torch.int32, torch.int64)[int(randint(gen, 0, 2))])
    expected = check_propose(tokens, lengths, histories, min_n=min_n, max_n=max_n, num_tokens=num_tokens, policy=policy)
    if kind == "small_vocab" and min_n <= 2:
        assert any(expected), "small vocabularies should give matches"


@pytest.mark.parametrize("dtype", (torch.int32, torch.int64), ids=str)
@pytest.mark.parametrize("policy", POLICIES)
def test_propose_long_histories(gen, policy, dtype):
    lengths = [5000, int(randint(gen, 1000, 5000)), 0, 3, int(randint(gen, 0, 5000))]
    histories = make_histories(gen, "zipf", lengths[:2]) + make_histories(gen, "planted", lengths[2:])
    tokens, lens = pack(gen, histories, dtype, garbage_vocab=50)
    check_propose(tokens, lens, histories, min_n=1, max_n=5, num_tokens=8, policy=policy)


@pytest.mark.parametrize("num_tokens", (1, 3, 10, 64))
@pytest.mark.parametrize("policy", POLICIES)
def test_propose_truncated_by_history_end(gen, policy, num_tokens):
    # s[j+n:] runs into the suffix itself: the proposal stops at N.
    histories = [
        [5, 6, 7, 5, 6],  # n=2 at j=0 -> [7, 5, 6]
        [1, 1, 1, 1],  # n=3 at j=0 -> [1]
        [9, 8, 9, 8, 9, 8],  # n=4 at j=0 -> [9, 8]; latest: also j=0
        [3, 4, 3],  # n=1 at j=0 -> [4, 3]
        [2, 2],  # n=1 at j=0 -> [2]
        [7],  # too short
        [],  # empty
    ]
    tokens, lengths = pack(gen, histories, torch.int64)
    expected = check_propose(tokens, lengths, histories, min_n=1, max_n=4, num_tokens=num_tokens, policy=policy)
    full = [[7, 5, 6], [1], [9, 8], [4, 3], [2], [], []]
    assert expected == [f[:num_tokens] for f in full]


def test_propose_known_policies():
    s = [1, 2, 3, 9, 1, 2, 4, 1, 2]
    tokens = torch.tensor([s])
    lengths = torch.tensor([len(s)])
    drafts, lens = ngram_propose(tokens, lengths, min_n=1, max_n=3, num_tokens=3, policy="earliest")
    assert drafts.tolist() == [[3, 9, 1]] and lens.tolist() == [3]
    drafts, lens = ngram_propose(tokens, lengths, min_n=1, max_n=3, num_tokens=3, policy="latest")
    assert drafts.tolist() == [[4, 1, 2]] and lens.tolist() == [3]
    # min_n too large for any match
    drafts, lens = ngram_propose(tokens, lengths, min_n=3, max_n=3, num_tokens=3)
    assert drafts.tolist() == [[-1, -1, -1]] and lens.tolist() == [0]


def test_propose_ignores_tokens_past_length(gen):
    histories = make_histories(gen, "small_vocab", [0, 1, 5, 40, 77])
    tokens, lengths = pack(gen, histories, torch.int64, extra=50, garbage_vocab=3)
    a = ngram_propose(tokens, lengths)
    tokens2 = tokens.clone()
    for b, h in enumerate(histories):
        tokens2[b, len(h) :] = randint(gen, -5, 3, (tokens.shape[1] - len(h),))
    b_ = ngram_propose(tokens2, lengths)
    assert torch.equal(a[0], b_[0]) and torch.equal(a[1], b_[1])
    check_propose(tokens2, lengths, histories, min_n=1, max_n=4, num_tokens=5, policy="earliest")


def test_propose_noncontiguous_tokens(gen):
    histories = make_histories(gen, "small_vocab", [30, 0, 17])
    tokens, lengths = pack(gen, histories, torch.int64)
    wide = torch.zeros(tokens.shape[0], 2 * tokens.shape[1], dtype=torch.int64)
    wide[:, ::2] = tokens
    check_propose(wide[:, ::2], lengths, histories, min_n=1, max_n=3, num_tokens=4, policy="latest")


def test_propose_rows_independent(gen):
    histories = make_histories(gen, "zipf", [100, 3, 250, 0])
    tokens, lengths = pack(gen, histories, torch.int64)
    full = ngram_propose(tokens, lengths, num_tokens=6)
    for b in range(len(histories)):
        alone = ngram_propose(tokens[b : b + 1], lengths[b : b + 1], num_tokens=6)
        assert torch.equal(full[0][b : b + 1], alone[0]) and torch.equal(full[1][b : b + 1], alone[1])


# ----------------------------------------------------------------------------- ngram_propose_tree


def check_tree(tokens, lengths, histories, *, min_n, max_n, num_tokens, tree_width, max_nodes, policy):
    budget = tree_width * num_tokens if max_nodes is None else max_nodes
    expected = [brute_tree(h, min_n, max_n, num_tokens, tree_width, budget, policy) for h in histories]
    kwargs = dict(min_n=min_n, max_n=max_n, num_tokens=num_tokens, tree_width=tree_width, max_nodes=max_nodes, policy=policy)
    ref = ngram_propose_tree(tokens, lengths, **kwargs, backend="reference")
    for backend in ["reference"] + TREE_BACKENDS:
        tree = ngram_propose_tree(tokens, lengths, **kwargs, backend=backend)
        assert isinstance(tree, sk.TokenTree)
        assert tree.tokens.dtype == tokens.dtype and tree.parents.dtype == torch.int64, backend
        assert tree.tokens.shape == (len(histories), 1 + budget) == tree.parents.shape
        assert tree.tokens.tolist() == [e[0] for e in expected], backend
        assert tree.parents.tolist() == [e[1] for e in expected], backend
        assert torch.equal(tree.tokens, ref.tokens) and torch.equal(tree.parents, ref.parents)
    return ref


def check_siblings_distinct(tree):
    for toks, pars in zip(tree.tokens.tolist(), tree.parents.tolist()):
        pairs = [(p, t) for i, (p, t) in enumerate(zip(pars, toks)) if i > 0 and p >= 0]
        assert len(pairs) == len(set(pairs))
        real = [i for i in range(1, len(pars)) if pars[i] >= 0]
        assert real == list(range(1, len(real) + 1)), "padding must be trailing"
        assert all(pars[i] < i for i in real)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("min_n, max_n", [(1, 1), (1, 3), (2, 2), (1, 5)])
@pytest.mark.parametrize("kind", ("small_vocab", "zipf", "planted"))
def test_tree_random(gen, kind, min_n, max_n, policy):
    num_tokens = int(randint(gen, 1, 7))
    tree_width = int(randint(gen, 1, 6))
    histories = make_histories(gen, kind, ragged_lengths(gen, 9, 200, max_n))
    dtype = (torch.int32, torch.int64)[int(randint(gen, 0, 2))]
    tokens, lengths = pack(gen, histories, dtype)
    for max_nodes in (None, 0, 1, int(randint(gen, 0, tree_width * num_tokens + 3))):
        tree = check_tree(
            tokens, lengths, histories, min_n=min_n, max_n=max_n, num_tokens=num_tokens,
            tree_width=tree_width, max_nodes=max_nodes, policy=policy,
        )
        check_siblings_distinct(tree)


@pytest.mark.parametrize("policy", POLICIES)
def test_tree_long_histories(gen, policy):
    histories = make_histories(gen, "zipf", [5000, int(randint(gen, 0, 3000))]) + make_histories(gen, "planted", [2000, 1])
    tokens, lengths = pack(gen, histories, torch.int64, garbage_vocab=50)
    check_tree(tokens, lengths, histories, min_n=1, max_n=4, num_tokens=6, tree_width=4, max_nodes=None, policy=policy)


def test_tree_known_ranking():
    # suffix [1]; continuations of length 2 after each earlier 1: j=0 -> [2, 3], j=3 -> [5, 1],
    # j=5 -> [9, 1], j=7 -> [2, 3], j=11 -> [2, 4], j=15 -> [5, 1], j=17 -> [6, 1]
    s = [1, 2, 3, 1, 5, 1, 9, 1, 2, 3, 8, 1, 2, 4, 8, 1, 5, 1, 6, 1]
    tokens = torch.tensor([s])
    lengths = torch.tensor([len(s)])
    ranked = brute_ranked_continuations(s, 1, 1, 2, "earliest")
    assert ranked[:3] == [([2, 3], 2), ([5, 1], 2), ([9, 1], 1)]
    tree = ngram_propose_tree(tokens, lengths, min_n=1, max_n=1, num_tokens=2, tree_width=3, policy="earliest")
    # root 1; [2, 3] -> nodes 1, 2; [5, 1] -> nodes 3, 4; [9, 1] -> nodes 5, 6
    assert tree.tokens.tolist() == [[1, 2, 3, 5, 1, 9, 1]]
    assert tree.parents.tolist() == [[-1, 0, 1, 0, 3, 0, 5]]
    ranked = brute_ranked_continuations(s, 1, 1, 2, "latest")
    assert ranked[:3] == [([5, 1], 2), ([2, 3], 2), ([6, 1], 1)]
    tree = ngram_propose_tree(tokens, lengths, min_n=1, max_n=1, num_tokens=2, tree_width=3, max_nodes=5, policy="latest")
    assert tree.tokens.tolist() == [[1, 5, 1, 2, 3, 6]]
    assert tree.parents.tolist() == [[-1, 0, 1, 0, 3, 0]]


def test_tree_prefix_continuations_merge():
    # suffix [3] at j=0 -> [3, 5], j=1 -> [5, 3], j=3 -> [3] (runs into the end): [3] is a
    # prefix of [3, 5] and adds no node.
    s = [3, 3, 5, 3, 3]
    tree = ngram_propose_tree(torch.tensor([s]), torch.tensor([5]), min_n=1, max_n=1, num_tokens=2, tree_width=3)
    assert tree.tokens.tolist() == [[3, 3, 5, 5, 3, -1, -1]]
    assert tree.parents.tolist() == [[-1, 0, 1, 0, 3, -1, -1]]
    assert int(tree.num_nodes[0]) == 5


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("kind", ("small_vocab", "zipf", "planted"))
def test_tree_first_branch_vs_chain(gen, kind, policy):
    """The first branch is the most frequent continuation. It equals ngram_propose's chain exactly
    when the chain's continuation is among the most frequent (the tie-break then prefers the
    chain's own position: earliest first occurrence / latest last occurrence)."""
    num_tokens = int(randint(gen, 1, 6))
    histories = make_histories(gen, kind, ragged_lengths(gen, 12, 150, 3))
    tokens, lengths = pack(gen, histories, torch.int64)
    drafts, draft_lens = ngram_propose(tokens, lengths, min_n=1, max_n=3, num_tokens=num_tokens, policy=policy)
    tree = ngram_propose_tree(tokens, lengths, min_n=1, max_n=3, num_tokens=num_tokens, tree_width=3, policy=policy)
    tree1 = ngram_propose_tree(tokens, lengths, min_n=1, max_n=3, num_tokens=num_tokens, tree_width=1, policy=policy)
    same = differ = 0
    for b, h in enumerate(histories):
        chain = drafts[b, : int(draft_lens[b])].tolist()
        ranked = brute_ranked_continuations(h, 1, 3, num_tokens, policy)
        if not ranked:
            assert chain == [] and int(tree.num_nodes[b]) == 1
            continue
        best, best_count = ranked[0]
        first_branch = tree.tokens[b, 1 : 1 + len(best)].tolist()
        assert first_branch == best
        assert tree.parents[b, 1 : 1 + len(best)].tolist() == list(range(len(best)))
        # tree_width=1: a chain of the best continuation.
        assert tree1.tokens[b, 1 : 1 + len(best)].tolist() == best and int(tree1.num_nodes[b]) == 1 + len(best)
        chain_count = dict((tuple(c), n) for c, n in ranked)[tuple(chain)]
        if chain_count == best_count:
            assert first_branch == chain
            same += 1
        else:
            assert first_branch != chain
            differ += 1
    assert same + differ == sum(1 for h in histories if brute_matches(h, 1, 3)[0])


@pytest.mark.parametrize("policy", POLICIES)
def test_tree_is_verify_compatible(gen, policy):
    histories = make_histories(gen, "small_vocab", [int(randint(gen, 2, 120)) for _ in range(6)])
    vocab = 8
    tokens, lengths = pack(gen, histories, torch.int64)
    tree = ngram_propose_tree(tokens, lengths, min_n=1, max_n=3, num_tokens=4, tree_width=4, policy=policy)
    check_siblings_distinct(tree)
    logits = torch.randn(tree.tokens.shape[0], tree.tokens.shape[1], vocab, generator=gen)
    out = sk.verify(logits, tree.tokens, tree.parents, temperature=0.0, seed=0)
    for b in range(tree.batch_size):
        n = int(out.num_accepted[b])
        path = out.accepted_nodes[b, : n + 1].tolist()
        assert path == tree.path(b, path[-1])
    # Also usable as tree-attention mask / position ids.
    assert tree.mask().shape == (6, tree.tokens.shape[1], tree.tokens.shape[1])


def test_tree_empty_history_root():
    tokens = torch.tensor([[5, 5, 5], [1, 2, 3]], dtype=torch.int32)
    lengths = torch.tensor([0, 3])
    tree = ngram_propose_tree(tokens, lengths, num_tokens=2, tree_width=2)
    assert tree.tokens.dtype == torch.int32
    assert tree.tokens.tolist() == [[-1, -1, -1, -1, -1], [3, -1, -1, -1, -1]]
    assert tree.parents.tolist() == [[-1] * 5] * 2
    assert tree.num_nodes.tolist() == [1, 1]


# ----------------------------------------------------------------------------- CUDA ngram_propose_tree
# The CUDA kernel (built where torch has CUDA and nvcc is found) against the reference.

HAS_CUDA_TREE = HAS_CUDA and "cuda" in sk.available_backends("ngram_propose_tree", "cuda")
requires_cuda_tree = pytest.mark.skipif(
    not HAS_CUDA_TREE, reason="needs a CUDA GPU and a build with the CUDA ngram_propose_tree kernel"
)


def check_tree_cuda(tokens, lengths, what, *, strided=False, **kwargs):
    """CUDA (contiguous, and optionally a strided view) == reference, exactly."""
    want = ngram_propose_tree(tokens, lengths, **kwargs, backend="reference")
    inputs = [tokens.cuda()]
    if strided:
        wide = torch.zeros(tokens.shape[0], 2 * tokens.shape[1], dtype=tokens.dtype, device="cuda")
        wide[:, ::2] = tokens.cuda()
        inputs.append(wide[:, ::2])
    for t in inputs:
        got = ngram_propose_tree(t, lengths.cuda(), **kwargs, backend="cuda")
        assert got.tokens.device.type == "cuda" and got.tokens.dtype == tokens.dtype, what
        assert got.parents.dtype == torch.int64 and got.tokens.shape == want.tokens.shape, what
        assert torch.equal(got.tokens.cpu(), want.tokens), (what, kwargs, t.stride(), got.tokens.cpu(), want.tokens)
        assert torch.equal(got.parents.cpu(), want.parents), (what, kwargs, t.stride(), got.parents.cpu(), want.parents)
    return want


def many_continuations(gen, length, every=5, vocab=1000, repeats=40):
    """Token 0 every `every` positions, random tokens between (thousands of distinct
    continuations of the suffix [0]: more than the kernel's shared-memory table holds), a few
    of them repeated 2-4 times at random places so that the ranking spans table rounds."""
    if length == 0:
        return []
    s = randint(gen, 1, vocab, (length,)).tolist()
    for i in range(0, length, every):
        s[i] = 0
    if length > 4 * every:
        for _ in range(repeats):
            src_pos = int(randint(gen, 0, length // every - 2)) * every
            for _ in range(int(randint(gen, 1, 4))):
                dst = int(randint(gen, 0, length // every - 2)) * every
                s[dst : dst + every] = s[src_pos : src_pos + every]
    s[-1] = 0
    return s


@requires_cuda
@requires_cuda_tree
@pytest.mark.gpu
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("kind", ("small_vocab", "zipf", "planted"))
def test_cuda_tree_random(gen, kind, policy):
    histories = make_histories(gen, kind, ragged_lengths(gen, 14, 3000, 5))
    for dtype in (torch.int32, torch.int64):
        tokens, lengths = pack(gen, histories, dtype, garbage_vocab=50)
        for min_n, max_n in ((1, 1), (1, 4), (2, 3), (3, 5)):
            num_tokens = int(randint(gen, 1, 9))
            tree_width = int(randint(gen, 1, 9))
            for max_nodes in (None, 0, 1, int(randint(gen, 0, tree_width * num_tokens + 3))):
                kwargs = dict(min_n=min_n, max_n=max_n, num_tokens=num_tokens, tree_width=tree_width,
                              max_nodes=max_nodes, policy=policy)
                check_tree_cuda(tokens, lengths, (kind, dtype), strided=max_nodes is None, **kwargs)


@requires_cuda
@requires_cuda_tree
@pytest.mark.gpu
@pytest.mark.parametrize("policy", POLICIES)
def test_cuda_tree_long_rows(gen, policy):
    """Rows up to 128k tokens (several table rounds for the frequent tokens), ragged, both dtypes."""
    lengths = [131072, 0, 1, 2, 1023, 1024, 1025, int(randint(gen, 0, 20000))]
    histories = (
        make_histories(gen, "zipf", lengths[:1])
        + make_histories(gen, "small_vocab", lengths[1:4])
        + make_histories(gen, "planted", lengths[4:7])
        + [many_continuations(gen, lengths[7])]
    )
    for dtype in (torch.int32, torch.int64):
        tokens, lens = pack(gen, histories, dtype, garbage_vocab=50)
        for min_n, max_n, num_tokens, tree_width, max_nodes in ((1, 1, 4, 8, None), (1, 4, 5, 4, 9), (2, 3, 3, 1, None)):
            kwargs = dict(min_n=min_n, max_n=max_n, num_tokens=num_tokens, tree_width=tree_width,
                          max_nodes=max_nodes, policy=policy)
            check_tree_cuda(tokens, lens, dtype, **kwargs)


@requires_cuda
@requires_cuda_tree
@pytest.mark.gpu
@pytest.mark.parametrize("policy", POLICIES)
def test_cuda_tree_table_overflow(gen, policy):
    """Far more distinct continuations than the shared-memory table holds: the deferred rounds
    must still find the most frequent ones and break count ties by position exactly."""
    histories = [
        many_continuations(gen, 60000),  # ~12k candidates, mostly distinct, some repeated
        many_continuations(gen, 30000, every=3, repeats=0),  # all counts 1: ties decide everything
        many_continuations(gen, 20000, every=7, vocab=3),  # few distinct continuations, large counts
        [7] * 50000,  # one continuation (plus the prefixes that run into the end)
        [int(t) for t in randint(gen, 0, 2, (40000,))],  # two tokens: every n-gram repeats
    ]
    tokens, lens = pack(gen, histories, torch.int64)
    for num_tokens, tree_width, max_nodes in ((1, 8, None), (3, 8, None), (6, 3, 7), (4, 1, None), (2, 8, 100)):
        kwargs = dict(min_n=1, max_n=1, num_tokens=num_tokens, tree_width=tree_width, max_nodes=max_nodes, policy=policy)
        check_tree_cuda(tokens, lens, "overflow", **kwargs)
    kwargs = dict(min_n=1, max_n=6, num_tokens=5, tree_width=6, max_nodes=None, policy=policy)
    check_tree_cuda(tokens, lens, "overflow, longer n", **kwargs)


@requires_cuda
@requires_cuda_tree
@pytest.mark.gpu
@pytest.mark.parametrize("policy", POLICIES)
def test_cuda_tree_edges(gen, policy):
    histories = [
        [5, 6, 7, 5, 6],  # continuations run into the suffix itself
        [1, 1, 1, 1],
        [9, 8, 9, 8, 9, 8],
        [3, 4, 3],
        [3, 3, 5, 3, 3],  # [3] is a prefix of [3, 5]: adds no node
        [1, 2, 3, 1, 5, 1, 9, 1, 2, 3, 8, 1, 2, 4, 8, 1, 5, 1, 6, 1],  # count ties
        [2, 2],
        [7],  # shorter than any n
        [],  # empty: root -1
        [1, 2, 3, 4, 5, 6],  # no match
    ]
    for dtype in (torch.int32, torch.int64):
        tokens, lengths = pack(gen, histories, dtype)
        for min_n, max_n in ((1, 1), (1, 4), (2, 2), (3, 8)):
            for num_tokens in (1, 2, 5, 64):
                for tree_width in (1, 2, 3, 8):
                    for max_nodes in (None, 0, 1, 3):
                        kwargs = dict(min_n=min_n, max_n=max_n, num_tokens=num_tokens, tree_width=tree_width,
                                      max_nodes=max_nodes, policy=policy)
                        check_tree_cuda(tokens, lengths, dtype, **kwargs)


@requires_cuda
@requires_cuda_tree
@pytest.mark.gpu
def test_cuda_tree_graph_capture(gen):
    """The op launches without a host sync and allocates by shape only: it captures into a CUDA
    graph, and replays on new contents of the same input buffers give the reference's trees."""
    kwargs = dict(min_n=1, max_n=3, num_tokens=4, tree_width=4, max_nodes=None, policy="latest")
    histories = make_histories(gen, "zipf", [500, 0, 37, 3000])
    tokens, lengths = pack(gen, histories, torch.int64)
    static_tokens, static_lengths = tokens.cuda(), lengths.cuda()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm up outside the graph
            ngram_propose_tree(static_tokens, static_lengths, **kwargs, backend="cuda")
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ngram_propose_tree(static_tokens, static_lengths, **kwargs, backend="cuda")
    for kind in ("small_vocab", "planted", "zipf"):
        new = make_histories(gen, kind, [int(randint(gen, 0, tokens.shape[1] + 1)) for _ in histories])
        new_tokens, new_lengths = pack(gen, new, torch.int64, extra=0)
        padded = torch.full_like(tokens, -1)
        padded[:, : new_tokens.shape[1]] = new_tokens
        static_tokens.copy_(padded.cuda())
        static_lengths.copy_(new_lengths.cuda())
        graph.replay()
        torch.cuda.synchronize()
        want = ngram_propose_tree(padded, new_lengths, **kwargs, backend="reference")
        assert torch.equal(out.tokens.cpu(), want.tokens), kind
        assert torch.equal(out.parents.cpu(), want.parents), kind


# ----------------------------------------------------------------------------- bad input


def good():
    return torch.tensor([[1, 2, 1, 2, 0], [3, 3, 3, 0, 0]]), torch.tensor([4, 3])


BAD = [
    ("min_n", dict(min_n=3, max_n=2)),
    ("min_n", dict(min_n=0)),
    ("min_n", dict(min_n=-1, max_n=2)),
    ("min_n", dict(min_n=1.0)),
    ("max_n", dict(max_n=0, min_n=1)),
    ("max_n", dict(max_n=True)),
    ("num_tokens", dict(num_tokens=0)),
    ("num_tokens", dict(num_tokens=-3)),
    ("num_tokens", dict(num_tokens=2.5)),
    ("policy", dict(policy="middle")),
    ("policy", dict(policy=None)),
    ("lengths", dict(lengths=torch.tensor([4, 6]))),
    ("lengths", dict(lengths=torch.tensor([-1, 3]))),
    ("lengths", dict(lengths=torch.tensor([4.0, 3.0]))),
    ("lengths", dict(lengths=torch.tensor([[4, 3]]))),
    ("lengths", dict(lengths=torch.tensor([4, 3, 1]))),
    ("lengths", dict(lengths=torch.tensor([4, 3]).to("meta"))),
    ("tokens", dict(tokens=torch.tensor([[1.0, 2.0, 1.0, 2.0, 0.0], [3.0, 3.0, 3.0, 0.0, 0.0]]))),
    ("tokens", dict(tokens=torch.tensor([1, 2, 1, 2]), lengths=torch.tensor([4]))),
    ("tokens", dict(tokens=torch.zeros(2, 3, 4, dtype=torch.int64))),
    ("tokens", dict(tokens=torch.zeros(0, 5, dtype=torch.int64), lengths=torch.zeros(0, dtype=torch.int64))),
    ("tokens", dict(tokens=[[1, 2]], lengths=torch.tensor([2]))),
    ("tokens", dict(tokens=torch.tensor([[1, 2, -1, 2, 0], [3, 3, 3, 0, 0]]))),  # -1 is padding, not a token
    ("tokens", dict(tokens=torch.tensor([[1, 2, 1, 2, 0], [3, -5, 3, 0, 0]], dtype=torch.int32))),
]


@pytest.mark.parametrize("fn", ("propose", "tree"))
def test_padding_past_lengths_is_not_checked(fn):
    """Entries past lengths[b] are ignored, so -1 padding there is fine."""
    tokens = torch.tensor([[1, 2, 1, 2, -1], [3, 3, 3, -1, -1]])
    op = ngram_propose if fn == "propose" else ngram_propose_tree
    op(tokens, torch.tensor([4, 3]))


@pytest.mark.parametrize("fn", ("propose", "tree"))
@pytest.mark.parametrize("name, kwargs", BAD, ids=[f"{n}-{i}" for i, (n, _) in enumerate(BAD)])
def test_bad_input(fn, name, kwargs):
    tokens, lengths = good()
    args = dict(tokens=tokens, lengths=lengths)
    args.update(kwargs)
    op = ngram_propose if fn == "propose" else ngram_propose_tree
    op(*good())  # the unmodified inputs are fine
    with pytest.raises(ValueError, match=f"^{name}:"):
        op(**args)


@pytest.mark.parametrize(
    "name, kwargs",
    [("tree_width", dict(tree_width=0)), ("tree_width", dict(tree_width=1.5)), ("max_nodes", dict(max_nodes=-1)), ("max_nodes", dict(max_nodes=2.0))],
)
def test_tree_bad_input(name, kwargs):
    with pytest.raises(ValueError, match=f"^{name}:"):
        ngram_propose_tree(*good(), **kwargs)
