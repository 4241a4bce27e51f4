"""`SuffixIndex` (the cross-sequence suffix cache): compiled against its plain-Python
reference on random streams (drafts, counts, match lengths, eviction), both against a brute
force over the cached sequences, the memory bound, and bad input."""

import time

import pytest
import torch

from specdec_kernels.ops.reference.suffix_index import ALL_ORDERS
from specdec_kernels.ops.suffix_index import SuffixIndex, _has_compiled_class

from conftest import max_gap_while, randint

HAS_INDEX = _has_compiled_class()
BACKENDS = (["cpu"] if HAS_INDEX else []) + ["python"]
requires_index = pytest.mark.skipif(not HAS_INDEX, reason="no compiled SuffixIndex")


class BruteForce:
    """The cache's meaning without its data structure: every appended token as (token, prev,
    next) by absolute position, a draft by scanning every cached position newest first."""

    def __init__(self, num_slots, max_tokens, max_depth, max_candidates):
        self.tokens, self.prev, self.next = [], [], []
        self.begin, self.max_tokens, self.max_candidates = 0, max_tokens, max_candidates
        self.orders = [k for k in ALL_ORDERS if k <= max_depth]
        self.slots = [(None, []) for _ in range(num_slots + 1)]  # (last position, tokens)

    def push(self, slot, token):
        if len(self.tokens) - self.begin >= self.max_tokens:
            self.begin += 1
        last, seq = self.slots[slot]
        p = len(self.tokens)
        linked = last is not None and last >= self.begin
        self.tokens.append(token), self.prev.append(last if linked else None), self.next.append(None)
        if linked and self.next[last] is None:
            self.next[last] = p
        self.slots[slot] = (p, seq + [token])

    def start(self, slot, prompt):
        self.slots[slot] = (None, [])
        for t in prompt:
            self.push(slot, t)

    def add(self, seqs):
        for s in seqs:
            self.start(-1, s)
        self.slots[-1] = (None, [])

    def context(self, p, k):
        """The k tokens ending at p (newest first), or None if not all cached."""
        out = []
        while len(out) < k:
            if p is None or p < self.begin:
                return None
            out.append(self.tokens[p])
            p = self.prev[p]
        return out

    def draft(self, slot, depth, max_nodes):
        seq = self.slots[slot][1]
        match, kept = 0, []
        for k in reversed([k for k in self.orders if k <= len(seq)]):
            want = seq[::-1][:k]
            kept = [p for p in range(len(self.tokens) - 1, self.begin - 1, -1)
                    if self.next[p] is not None and self.context(p, k) == want][: self.max_candidates]
            if kept:
                match = k
                break
        nodes = {}  # path tuple -> [count, creation]
        for p in kept:
            path, q = (), self.next[p]
            for _ in range(depth):
                if q is None:
                    break
                path += (self.tokens[q],)
                nodes.setdefault(path, [0, len(nodes)])[0] += 1
                q = self.next[q]
        order = sorted(nodes, key=lambda path: (-nodes[path][0], nodes[path][1]))[:max_nodes]
        index = {(): 0}
        tokens, parents, counts = [seq[-1]], [-1], [len(kept)]
        for i, path in enumerate(order):
            index[path] = i + 1
            tokens.append(path[-1]), parents.append(index[path[:-1]]), counts.append(nodes[path][0])
        pad = max_nodes + 1 - len(tokens)
        return tokens + [-1] * pad, parents + [-1] * pad, counts + [0] * pad, match


def random_stream(gen, *, num_slots, vocab, steps, max_tokens, backends, depth=6, max_nodes=8, max_depth=32,
                  max_candidates=4, max_probes=1 << 20, table_bits=0, brute=True):
    """Drive every backend (and the brute force) with the same random operations; compare
    each draft."""
    indexes = {b: SuffixIndex(num_slots, max_tokens=max_tokens, max_depth=max_depth, max_candidates=max_candidates,
                              max_probes=max_probes, backend=b, _table_bits=table_bits) for b in backends}
    oracle = BruteForce(num_slots, max_tokens, max_depth, max_candidates) if brute else None
    text = lambda n: randint(gen, 0, vocab, (n,)).tolist()  # noqa: E731
    started = set()
    for step in range(steps):
        op = int(randint(gen, 0, 10))
        if op == 0:
            seqs = [text(int(randint(gen, 0, 12))) for _ in range(int(randint(gen, 1, 3)))]
            for ix in indexes.values():
                ix.add(seqs)
            if oracle:
                oracle.add(seqs)
        elif op == 1 or not started:
            slot, prompt = int(randint(gen, 0, num_slots)), text(int(randint(gen, 1, 10)))
            for ix in indexes.values():
                ix.start(slot, prompt)
            if oracle:
                oracle.start(slot, prompt)
            started.add(slot)
        elif op == 2 and len(started) < num_slots:
            src = sorted(started)[int(randint(gen, 0, len(started)))]
            slot = min(set(range(num_slots)) - started)
            for ix in indexes.values():
                ix.fork(slot, src)
            if oracle:
                oracle.slots[slot] = oracle.slots[src]
            started.add(slot)
        else:
            slots = sorted(started)
            perm = torch.randperm(len(slots), generator=gen).tolist()
            slots = [slots[i] for i in perm[: int(randint(gen, 1, len(slots) + 1))]]
            width = int(randint(gen, 0, 4))
            tokens = randint(gen, 0, vocab, (len(slots), width))
            counts = randint(gen, 0, width + 1, (len(slots),))
            tokens = torch.where(torch.arange(width)[None, :] < counts[:, None], tokens, -1)
            outs = {b: ix.append_and_draft(slots, tokens, counts, num_tokens=depth, max_nodes=max_nodes)
                    for b, ix in indexes.items()}
            first = next(iter(outs.values()))
            for b, out in outs.items():
                for name, got, want in zip(out._fields, out, first):
                    assert torch.equal(got, want), (step, b, name, got, want)
            if oracle:
                for r, slot in enumerate(slots):
                    for t in tokens[r, : int(counts[r])].tolist():
                        oracle.push(slot, t)
                for r, slot in enumerate(slots):
                    want = oracle.draft(slot, depth, max_nodes)
                    got = (first.tokens[r].tolist(), first.parents[r].tolist(), first.counts[r].tolist(),
                           int(first.match_lengths[r]))
                    assert got == tuple(want), (step, slot, got, want)
        sizes = {b: ix.cached_tokens for b, ix in indexes.items()}
        assert len(set(sizes.values())) == 1 and max(sizes.values()) <= max_tokens, sizes
    return indexes


@pytest.mark.parametrize("vocab,max_tokens,max_depth", [(3, 10_000, 32), (5, 40, 32), (4, 17, 6), (2, 300, 3)])
def test_matches_brute_force_and_reference(vocab, max_tokens, max_depth):
    """Every backend's drafts (tokens, parents, counts, match lengths) equal the brute force's,
    with eviction (small budgets), forks, finished sequences and several context lengths."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    random_stream(gen, num_slots=4, vocab=vocab, steps=150, max_tokens=max_tokens, backends=BACKENDS,
                  max_depth=max_depth)


@requires_index
@pytest.mark.parametrize("table_bits,max_probes", [(1, 3), (2, 1), (0, 5)])
def test_compiled_equals_reference_with_collisions_and_probe_limits(table_bits, max_probes):
    """A 2-4 bucket table (every chain mixes contexts) and short probe limits change what is
    found, identically in the compiled index and the reference."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    random_stream(gen, num_slots=5, vocab=4, steps=200, max_tokens=64, backends=["cpu", "python"],
                  max_probes=max_probes, table_bits=table_bits, brute=False, max_candidates=3)


@requires_index
@pytest.mark.parametrize("max_probes,table_bits", [(64, 0), (3, 6)])
def test_compiled_equals_reference_many_rows_switching_text(max_probes, table_bits):
    """More rows than the compiled lookup interleaves (16), slots repeated in a draft, and rows
    that alternate between copying cached text (long matches) and novel tokens (order 1 or
    none): each slot's next lookup starts from the order its last one matched, which must
    never change what it finds (with short probe limits and collisions too)."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    vocab, rows = 40, 37
    ix = {b: SuffixIndex(rows, max_tokens=3000, max_candidates=4, max_probes=max_probes, backend=b,
                         _table_bits=table_bits) for b in ("cpu", "python")}
    texts = [randint(gen, 0, vocab, (int(randint(gen, 50, 200)),)) for _ in range(6)]
    for index in ix.values():
        index.add(texts)
    for r in range(rows):
        prompt = randint(gen, 0, vocab, (int(randint(gen, 1, 40)),))
        for index in ix.values():
            index.start(r, prompt)
    source = [None] * rows  # (text, position) a row copies, None: novel tokens
    longest = 0
    for step in range(40):
        tokens = torch.full((rows, 3), -1, dtype=torch.int64)
        counts = randint(gen, 0, 4, (rows,))
        for r in range(rows):
            if float(torch.rand((), generator=gen)) < 0.2:  # switch between copying and novel text
                text = texts[int(randint(gen, 0, len(texts)))]
                source[r] = None if source[r] is not None else (text, int(randint(gen, 0, len(text) - 4)))
            if source[r] is None:
                tokens[r] = randint(gen, 0, vocab, (3,))
            else:
                text, at = source[r]
                tokens[r] = text[at: at + 3] if at + 3 <= len(text) else randint(gen, 0, vocab, (3,))
                source[r] = (text, at + int(counts[r]))
        order = torch.randperm(rows, generator=gen)
        slots = torch.cat([order, order[: int(randint(gen, 0, 6))]])  # some slots drafted twice
        depth, nodes = int(randint(gen, 1, 12)), int(randint(gen, 0, 24))
        for index in ix.values():
            index.append(order, tokens[order], counts[order])
        outs = {b: index.draft(slots, num_tokens=depth, max_nodes=nodes) for b, index in ix.items()}
        for name, got, want in zip(outs["cpu"]._fields, outs["cpu"], outs["python"]):
            assert torch.equal(got, want), (step, name, got, want)
        longest = max(longest, int(outs["cpu"].match_lengths.max()))
    if table_bits == 0:  # (a 64-bucket table with 3 probes rarely finds long ones)
        assert longest >= 8  # rows on cached text did match long suffixes


def test_sibling_drafting():
    """Two forks of one prompt: the second drafts what the first just appended."""
    for backend in BACKENDS:
        ix = SuffixIndex(2, backend=backend)
        ix.start(0, [5, 6, 7])
        ix.fork(1, 0)
        ix.append([0], [[8, 9, 10]])
        out = ix.draft([1], num_tokens=4, max_nodes=4)
        assert out.tokens[0].tolist() == [7, 8, 9, 10, -1] and out.parents[0].tolist() == [-1, 0, 1, 2, -1]
        assert out.counts[0].tolist() == [1, 1, 1, 1, 0] and int(out.match_lengths[0]) == 3
        assert ix.cached_tokens == 6  # the shared prompt once


def test_memory_bound():
    """Memory is fixed at creation (<= 2 * 92 bytes per budgeted token + slots) and the token
    count never exceeds the budget, however much is appended."""
    for backend in BACKENDS:
        ix = SuffixIndex(2, max_tokens=1000, backend=backend)
        before = ix.memory_bytes()
        if backend == "cpu":
            assert 0 < before <= 1024 * 92 + 3 * 200
        gen = torch.Generator().manual_seed(0)
        ix.start(0, randint(gen, 0, 50, (10,)))
        for _ in range(30 if backend == "python" else 300):
            ix.append_and_draft([0], randint(gen, 0, 50, (1, 16)))
            assert ix.cached_tokens <= 1000
        ix.add([randint(gen, 0, 50, (3000,))])
        assert ix.cached_tokens == 1000 and ix.memory_bytes() == before


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_input(backend):
    ix = SuffixIndex(2, vocab_size=100, backend=backend)
    with pytest.raises(ValueError, match="prompt_tokens"):
        ix.start(0, [1, -3])
    with pytest.raises(ValueError, match="vocabulary"):
        ix.start(0, [1, 100])
    with pytest.raises(ValueError, match="prompt_tokens"):
        ix.start(0, torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="token_lists"):
        ix.add([[1, 2], [3, 200]])
    with pytest.raises(ValueError, match="token_lists"):
        ix.add([torch.tensor([0.5])])
    ix.start(0, [1, 2, 3])
    with pytest.raises(ValueError, match="accepted_tokens"):
        ix.append([0], [[4, -2]])
    with pytest.raises(ValueError, match="accepted_tokens"):
        ix.append([0], torch.tensor([[4.0]]))
    with pytest.raises(ValueError, match="counts"):
        ix.append([0], [[4, 5]], [3])
    with pytest.raises((ValueError, RuntimeError), match="slot"):
        ix.draft([2])
    with pytest.raises((ValueError, RuntimeError), match="no tokens"):
        ix.draft([1])
    with pytest.raises(ValueError, match="max_depth"):
        SuffixIndex(1, max_depth=33, backend=backend)
    with pytest.raises(ValueError, match="num_tokens"):
        ix.draft([0], num_tokens=-1)
    assert ix.length(0) == 3  # failed calls changed nothing


@requires_index
def test_compiled_checks_values_too():
    """The compiled class refuses bad ids itself (direct torch.classes use, or value checks off)."""
    from specdec_kernels import config

    ix = SuffixIndex(1, vocab_size=10, backend="cpu")
    ix.start(0, [1])
    with config.value_checks(False), pytest.raises(RuntimeError, match="vocabulary"):
        ix.append([0], [[10]])


@requires_index
def test_gil_released():
    """A long add runs without the GIL: another Python thread keeps running."""
    ix = SuffixIndex(1, max_tokens=1 << 21, backend="cpu")
    seq = torch.randint(0, 1000, (1 << 21,))
    start = time.perf_counter()
    ix.add([seq])
    alone = time.perf_counter() - start
    if alone < 0.05:
        pytest.skip(f"one call takes {alone * 1e3:.1f} ms here, too short to tell")
    assert max_gap_while(lambda: ix.add([seq])) < 0.6 * alone
