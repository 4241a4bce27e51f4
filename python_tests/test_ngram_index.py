"""The compiled CPU n-gram kernels on long and adversarial histories (against `reference`),
and `NgramIndex` (compiled and pure-Python) fed step by step against `ngram_propose`."""

import time

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels import ngram_propose, ngram_propose_tree
from specdec_kernels.ops.ngram_index import NgramIndex, _has_compiled_class

from conftest import HAS_C, max_gap_while, randint, requires_c, requires_cuda
from test_ngram import pack, planted, zipf_tokens

POLICIES = ("earliest", "latest")
HAS_INDEX = _has_compiled_class()
INDEX_BACKENDS = (["cpu"] if HAS_INDEX else []) + ["python"]
requires_cpu_kernel = pytest.mark.skipif(
    not HAS_C or "cpu" not in sk.available_backends("ngram_propose", "cpu"), reason="no compiled CPU ngram kernel"
)


# ----------------------------------------------------------------------------- inputs


def text_like(gen, length, vocab=5000, segment=64):
    """Random tokens where most segments copy an earlier stretch (as code and chat do)."""
    out = []
    while len(out) < length:
        if len(out) > segment and float(torch.rand((), generator=gen)) < 0.7:
            start = int(randint(gen, 0, len(out) - segment))
            out.extend(out[start : start + int(randint(gen, 1, segment + 1))])
        else:
            out.extend(randint(gen, 0, vocab, (int(randint(gen, 1, segment + 1)),)).tolist())
    return out[:length]


def history(gen, kind, length):
    if kind == "random":
        return randint(gen, 0, 50000, (length,)).tolist()
    if kind == "small_vocab":
        return randint(gen, 0, 3, (length,)).tolist()
    if kind == "zipf":
        return zipf_tokens(gen, length)
    if kind == "planted":
        return planted(gen, length)
    if kind == "text":
        return text_like(gen, length)
    raise ValueError(kind)


def assert_same(got, want, what):
    assert got[0].dtype == want[0].dtype and got[1].dtype == want[1].dtype, what
    assert torch.equal(got[1], want[1]), (what, got[1], want[1])
    assert torch.equal(got[0], want[0]), (what, got[0], want[0])


def strided_copy(tokens):
    """tokens on the GPU as a strided view: every other column of a buffer twice as wide."""
    wide = torch.zeros(tokens.shape[0], 2 * tokens.shape[1], dtype=tokens.dtype, device="cuda")
    wide[:, ::2] = tokens.cuda()
    return wide[:, ::2]


def check_against_reference(backend, tokens, lens, sizes, policy, what, move=None):
    """ngram_propose on `backend` equals the reference for every (min_n, max_n, num_tokens) in
    `sizes`; move(tokens, lens) gives the backend's inputs (default: the same tensors)."""
    inputs = move(tokens, lens) if move is not None else (tokens, lens)
    for min_n, max_n, num_tokens in sizes:
        kwargs = dict(min_n=min_n, max_n=max_n, num_tokens=num_tokens, policy=policy)
        want = ngram_propose(tokens, lens, **kwargs, backend="reference")
        got = ngram_propose(*inputs, **kwargs, backend=backend)
        assert_same((got[0].cpu(), got[1].cpu()), want, (*what, kwargs))


# ----------------------------------------------------------------------------- compiled ngram_propose


@requires_cpu_kernel
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("kind", ("random", "small_vocab", "zipf", "planted", "text"))
def test_propose_long_rows_match_reference(gen, kind, policy):
    """Ragged batch with a few long rows (up to 128k) and every short length around the
    32-token SIMD block boundaries."""
    lengths = [131072, int(randint(gen, 20000, 40000)), 0, 1, 2, 31, 32, 33, 63, 64, 65, int(randint(gen, 0, 3000))]
    histories = [history(gen, kind, n) for n in lengths]
    for dtype in (torch.int32, torch.int64):
        tokens, lens = pack(gen, histories, dtype, garbage_vocab=50)
        check_against_reference("cpu", tokens, lens, ((1, 4, 5), (2, 8, 3), (3, 3, 12)), policy, (dtype,))


@requires_cpu_kernel
@pytest.mark.parametrize("policy", POLICIES)
def test_propose_every_short_length(gen, policy):
    """Every length 0..100 of small-vocabulary rows: matches everywhere, runs into the suffix."""
    histories = [history(gen, "small_vocab", n) for n in range(101)]
    tokens, lens = pack(gen, histories, torch.int64)
    sizes = [(min_n, max_n, 7) for min_n, max_n in ((1, 1), (1, 4), (2, 6), (5, 5), (1, 40))]
    check_against_reference("cpu", tokens, lens, sizes, policy, ())


@requires_cpu_kernel
@pytest.mark.parametrize("policy", POLICIES)
def test_propose_adversarial_rows(gen, policy):
    """Rows where every position is a candidate and the backward extension almost reaches max_n."""
    period = 9
    row = ([1] + [0] * (period - 1)) * 3000
    row[-period] = 2  # the suffix "2 0 0 ..." never occurs whole: every candidate falls short
    constant = [7] * 5000  # every position matches at max_n: the early exit
    periodic = [3, 4, 5] * 2000
    histories = [row, constant, periodic, row[:1000] + [9]]
    for dtype in (torch.int32, torch.int64):
        tokens, lens = pack(gen, histories, dtype)
        check_against_reference("cpu", tokens, lens, [(1, max_n, 6) for max_n in (2, 8, 16)], policy, (dtype,))


@requires_cpu_kernel
def test_propose_extreme_token_values():
    """Token ids whose 32-bit halves collide (the SIMD int64 compare needs both halves), and the
    int64 extremes."""
    big = 2**32
    collisions = [5, big + 5, 5 + 2 * big, 9, big + 5, 1, 5 + 2 * big, 2, big + 5]
    extremes = [-(2**63), 2**63 - 1, -1, 0, 2**63 - 1, 4, -1, 5, -(2**63), 2**63 - 1] + [0] * 40
    for policy in POLICIES:
        check_against_reference("cpu", torch.tensor([collisions]), torch.tensor([len(collisions)]), [(1, 3, 3)], policy, ())
    # Negative ids are rejected by the value checks (-1 is padding); the kernels still match
    # the reference on them when the checks are off, which is what this is about.
    with sk.config.value_checks(False):
        for policy in POLICIES:
            check_against_reference("cpu", torch.tensor([extremes]), torch.tensor([len(extremes)]), [(1, 3, 3)], policy, ())


@requires_c
def test_compiled_propose_checks_direct_calls():
    op = torch.ops.specdec.ngram_propose.default
    tokens = torch.tensor([[1, 2, 1]])
    if "CPU" not in sk.ops._extension.COMPILED["ngram_propose"]:
        pytest.skip("no compiled CPU kernel")
    for args, name in (
        ((tokens.float(), torch.tensor([3]), 1, 2, 3, "earliest"), "tokens"),
        ((tokens, torch.tensor([4]), 1, 2, 3, "earliest"), "lengths"),
        ((tokens, torch.tensor([3], dtype=torch.int32), 1, 2, 3, "earliest"), "lengths"),
        ((tokens, torch.tensor([3]), 0, 2, 3, "earliest"), "min_n"),
        ((tokens, torch.tensor([3]), 3, 2, 3, "earliest"), "max_n"),
        ((tokens, torch.tensor([3]), 1, 2, 0, "earliest"), "num_tokens"),
        ((tokens, torch.tensor([3]), 1, 2, 3, "first"), "policy"),
    ):
        with pytest.raises(RuntimeError, match=f"ngram_propose.*{name}"):
            op(*args)


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("policy", POLICIES)
def test_cuda_propose_matches_reference(gen, policy):
    """The CUDA kernel (built where torch has CUDA and nvcc is found) against reference."""
    if "cuda" not in sk.available_backends("ngram_propose", "cuda"):
        pytest.skip("no compiled CUDA ngram kernel in this build")
    lengths = [131072, 20000, 0, 1, 2, 255, 256, 257, 1023, 1024, 1025, int(randint(gen, 0, 5000))]
    for kind in ("small_vocab", "zipf", "planted", "text", "random"):
        histories = [history(gen, kind, n) for n in lengths]
        for dtype in (torch.int32, torch.int64):
            tokens, lens = pack(gen, histories, dtype, garbage_vocab=50)
            sizes = ((1, 4, 5), (2, 8, 3), (3, 3, 300))
            check_against_reference("cuda", tokens, lens, sizes, policy, (kind, dtype),
                                    move=lambda t, n: (t.cuda(), n.cuda()))
            check_against_reference("cuda", tokens, lens, sizes, policy, (kind, dtype, "strided"),
                                    move=lambda t, n: (strided_copy(t), n.cuda()))


# ----------------------------------------------------------------------------- compiled ngram_propose_tree


@requires_cpu_kernel
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("kind", ("small_vocab", "zipf", "text"))
def test_tree_long_rows_match_reference(gen, kind, policy):
    lengths = [20000, int(randint(gen, 1000, 8000)), 0, 1, 33, int(randint(gen, 0, 500))]
    histories = [history(gen, kind, n) for n in lengths]
    tokens, lens = pack(gen, histories, (torch.int32, torch.int64)[int(randint(gen, 0, 2))])
    for min_n, max_n, num_tokens, tree_width, max_nodes in ((1, 4, 5, 4, None), (1, 2, 3, 8, 7), (2, 3, 6, 3, 0)):
        kwargs = dict(min_n=min_n, max_n=max_n, num_tokens=num_tokens, tree_width=tree_width,
                      max_nodes=max_nodes, policy=policy)
        want = ngram_propose_tree(tokens, lens, **kwargs, backend="reference")
        got = ngram_propose_tree(tokens, lens, **kwargs, backend="cpu")
        assert torch.equal(got.tokens, want.tokens), kwargs
        assert torch.equal(got.parents, want.parents), kwargs


# ----------------------------------------------------------------------------- NgramIndex


def expected_propose(histories, **kwargs):
    if not histories:  # ngram_propose needs a batch; the index answers an empty one
        return torch.empty(0, kwargs["num_tokens"], dtype=torch.int64), torch.empty(0, dtype=torch.int32)
    tokens, lens = pack(torch.Generator().manual_seed(0), histories, torch.int64)
    return ngram_propose(tokens, lens, **kwargs)


def next_tokens(gen, hist, count, vocab):
    """`count` new tokens: mostly copies of an earlier stretch (so drafts hit), else random."""
    if hist and float(torch.rand((), generator=gen)) < 0.6:
        start = int(randint(gen, 0, len(hist)))
        out = hist[start : start + count]
        return out + randint(gen, 0, vocab, (count - len(out),)).tolist()
    return randint(gen, 0, vocab, (count,)).tolist()


def run_steps(gen, index, *, num_slots, steps, vocab, max_k, configs, prompt_max=200):
    """Feed random accepted counts step by step; compare propose with ngram_propose every step."""
    histories = []
    for slot in range(num_slots):
        h = history(gen, "zipf", int(randint(gen, 0, prompt_max))) if slot % 2 else \
            randint(gen, 0, vocab, (int(randint(gen, 0, prompt_max)),)).tolist()
        index.reset(slot, torch.tensor(h, dtype=torch.int64))
        histories.append(h)
    for step in range(steps):
        active = [s for s in range(num_slots) if float(torch.rand((), generator=gen)) < 0.8]
        perm = torch.randperm(len(active), generator=gen).tolist()
        active = [active[i] for i in perm]  # slots in any order
        counts = [int(randint(gen, 0, max_k + 1)) for _ in active]
        rows = torch.full((len(active), max_k), -7, dtype=torch.int64)  # -7: garbage past counts
        for r, (s, c) in enumerate(zip(active, counts)):
            new = next_tokens(gen, histories[s], c, vocab)
            rows[r, :c] = torch.tensor(new, dtype=torch.int64)
            histories[s] = histories[s] + new
        min_n, max_n, num_tokens, policy = configs[step % len(configs)]
        kwargs = dict(min_n=min_n, max_n=max_n, num_tokens=num_tokens, policy=policy)
        if step % 2:
            got = index.append_and_propose(active, rows, torch.tensor(counts), **kwargs)
            want = expected_propose([histories[s] for s in active], **kwargs)
        else:
            index.append(torch.tensor(active, dtype=torch.int32), rows, counts)
            got = index.propose(list(range(num_slots)), **kwargs)
            want = expected_propose(histories, **kwargs)
        assert_same(got, want, (step, kwargs))
    for s in range(num_slots):
        assert index.length(s) == len(histories[s])
        assert index.history(s).tolist() == histories[s]


CONFIGS = [(1, 4, 5, "earliest"), (1, 4, 5, "latest"), (2, 3, 3, "earliest"), (1, 1, 8, "latest"), (4, 4, 2, "latest")]


@pytest.mark.parametrize("backend", INDEX_BACKENDS)
@pytest.mark.parametrize("vocab", (3, 20, 1000))
def test_index_stepwise_equals_propose(gen, backend, vocab):
    index = NgramIndex(6, max_n=4, backend=backend)
    run_steps(gen, index, num_slots=6, steps=60, vocab=vocab, max_k=6, configs=CONFIGS)


def test_reference_index_is_the_python_backend(gen):
    """The pure-Python index is a reference implementation (specdec_kernels.ops.reference), used
    directly with the compiled class's interface and as NgramIndex(backend="python")."""
    assert isinstance(NgramIndex(2, backend="python")._impl, sk.reference.NgramIndex)
    index = sk.reference.NgramIndex(2, 4)
    histories = [history(gen, "small_vocab", 40), history(gen, "zipf", 70)]
    for slot, h in enumerate(histories):
        index.reset(slot, torch.tensor(h, dtype=torch.int64))
    for policy in POLICIES:
        got = index.propose(torch.tensor([1, 0]), 1, 4, 5, policy)
        want = expected_propose(histories[::-1], min_n=1, max_n=4, num_tokens=5, policy=policy)
        assert_same(got, want, policy)
    with pytest.raises(ValueError, match="slots"):
        index.append(torch.tensor([0, 0]), torch.zeros(2, 1, dtype=torch.int64), torch.ones(2, dtype=torch.int64))
    assert index.length(0) == len(histories[0])  # rejected before anything was appended


@pytest.mark.skipif(not HAS_INDEX, reason="no compiled NgramIndex")
@pytest.mark.parametrize("hash_bits", (0, 1, 3))
def test_index_hash_collisions_are_harmless(gen, hash_bits):
    """With 0-3 hash bits every n-gram shares a handful of buckets: only slower, never wrong."""
    index = NgramIndex(3, max_n=5, backend="cpu", _hash_bits=hash_bits)
    configs = [(1, 5, 4, "earliest"), (1, 5, 4, "latest"), (2, 4, 6, "latest")]
    run_steps(gen, index, num_slots=3, steps=25, vocab=8, max_k=5, configs=configs, prompt_max=120)


@pytest.mark.skipif(not HAS_INDEX, reason="no compiled NgramIndex")
@pytest.mark.parametrize("policy", POLICIES)
def test_index_long_prompt(gen, policy):
    """A 128k-token prompt, then a few steps: the same drafts as a full rescan."""
    h = history(gen, "text", 131072)
    index = NgramIndex(2, max_n=6, backend="cpu")
    index.reset(1, h)
    index.reset(0, [])
    for step in range(4):
        new = next_tokens(gen, h, 3, 5000)
        h = h + new
        kwargs = dict(min_n=1, max_n=(6, 3, 1, 6)[step], num_tokens=5, policy=policy)
        got = index.append_and_propose([1, 0], torch.tensor([new, [0, 0, 0]]), [3, 0], **kwargs)
        tokens, lens = pack(gen, [h, []], torch.int64)
        want = ngram_propose(tokens, lens, **kwargs, backend="cpu" if HAS_C else "reference")
        assert_same(got, want, kwargs)


def test_index_edges():
    for backend in INDEX_BACKENDS:
        index = NgramIndex(3, max_n=3, dtype=torch.int32, backend=backend)
        d, n = index.propose([0, 1, 2], num_tokens=2)  # fresh slots: empty histories
        assert d.dtype == torch.int32 and d.tolist() == [[-1, -1]] * 3 and n.tolist() == [0, 0, 0]
        index.reset(0, [4])
        assert index.propose(0)[1].tolist() == [0]  # shorter than any n + 1
        index.append([0], [[4]])  # [4, 4]: n=1 at j=0 -> [4]
        d, n = index.propose(0, num_tokens=3)
        assert d.tolist() == [[4, -1, -1]] and n.tolist() == [1]
        index.reset(0, [1, 2, 3, 9, 1, 2, 4, 1, 2])
        assert index.propose(0, max_n=3, num_tokens=3)[0].tolist() == [[3, 9, 1]]
        assert index.propose(0, max_n=3, num_tokens=3, policy="latest")[0].tolist() == [[4, 1, 2]]
        assert index.propose(0, min_n=3, max_n=3)[1].tolist() == [0]
        index.append(torch.tensor([0]), torch.zeros(1, 0, dtype=torch.int64))  # K = 0
        index.reset(0, [])  # reset really forgets
        assert index.length(0) == 0 and index.propose(0)[1].tolist() == [0]
        d, n = index.propose(torch.tensor([], dtype=torch.int64))
        assert d.shape == (0, 5) and n.shape == (0,)
        d, n = index.append_and_propose([], [], [], num_tokens=3)  # no running sequence this step
        assert d.shape == (0, 3) and n.shape == (0,)
        # A history of one repeated token: every n matches, the proposal runs into the suffix.
        index.reset(2, [7] * 6)
        for policy, want in (("earliest", [[7, 7, 7, -1]]), ("latest", [[7, -1, -1, -1]])):
            d, n = index.propose([2], max_n=3, num_tokens=4, policy=policy)
            assert d.tolist() == want, policy


INDEX_BAD = [
    ("slots", lambda ix: ix.propose([5])),
    ("slots", lambda ix: ix.propose([-1])),
    ("slots", lambda ix: ix.append([1, 1], [[1], [2]])),
    ("slots", lambda ix: ix.propose(torch.tensor([[0]]))),
    ("accepted_tokens", lambda ix: ix.append([0], [[1.0]])),
    ("accepted_tokens", lambda ix: ix.append([0, 1], [[1]])),
    ("counts", lambda ix: ix.append([0], [[1, 2]], [3])),
    ("counts", lambda ix: ix.append([0], [[1, 2]], [-1])),
    ("counts", lambda ix: ix.append([0], [[1, 2]], [1, 1])),
    ("max_n", lambda ix: ix.propose([0], max_n=5)),
    ("min_n", lambda ix: ix.propose([0], min_n=0)),
    ("min_n", lambda ix: ix.propose([0], min_n=3, max_n=2)),
    ("num_tokens", lambda ix: ix.propose([0], num_tokens=0)),
    ("policy", lambda ix: ix.append_and_propose([0], [[1]], policy="first")),
    ("slot", lambda ix: ix.reset(2, [1])),
    ("prompt_tokens", lambda ix: ix.reset(0, [[1, 2]])),
    ("prompt_tokens", lambda ix: ix.reset(0, [1.5])),
    ("prompt_tokens", lambda ix: ix.reset(0, [4, -1, 2])),  # -1 is padding, never a token
    ("accepted_tokens", lambda ix: ix.append([0], [[3, -2]])),
    ("accepted_tokens", lambda ix: ix.append_and_propose([0, 1], [[1, -1], [-3, 0]], [1, 1])),
]


@pytest.mark.parametrize("backend", INDEX_BACKENDS)
@pytest.mark.parametrize("name, call", INDEX_BAD, ids=[f"{n}-{i}" for i, (n, _) in enumerate(INDEX_BAD)])
def test_index_bad_input(backend, name, call):
    index = NgramIndex(2, max_n=4, backend=backend)
    index.reset(0, [1, 2, 1])
    with pytest.raises((ValueError, RuntimeError), match=name):
        call(index)
    # A failed call leaves the index usable and unchanged.
    assert index.history(0).tolist() == [1, 2, 1]
    assert index.propose([0])[0].tolist() == [[2, 1, -1, -1, -1]]


def test_index_constructor_errors():
    for kwargs, name in ((dict(num_slots=0), "num_slots"), (dict(num_slots=2, max_n=0), "max_n"),
                         (dict(num_slots=2, dtype=torch.float32), "dtype"), (dict(num_slots=2, backend="gpu"), "backend")):
        with pytest.raises(ValueError, match=f"^{name}:"):
            NgramIndex(**kwargs)


# ----------------------------------------------------------------------------- the GIL


@requires_cpu_kernel
@pytest.mark.skipif(not HAS_INDEX, reason="no compiled NgramIndex")
def test_gil_released():
    """The compiled op and the index's methods run without holding the GIL: another Python
    thread keeps running while one long call is in flight."""
    s = torch.tensor([1] + [0] * 15, dtype=torch.int32).repeat(400_000)  # 6.4M tokens
    s[-16] = 2  # every candidate extends ~15 tokens, then fails: a long full scan
    tokens, lengths = s[None], torch.tensor([s.numel()])
    index = NgramIndex(1, max_n=4, backend="cpu", _hash_bits=0)  # one bucket: a slow reset
    prompt = torch.randint(0, 1000, (2200,))
    calls = {
        "op": lambda: ngram_propose(tokens, lengths, max_n=32, backend="cpu"),
        "index": lambda: index.reset(0, prompt),
    }
    for name, fn in calls.items():
        start = time.perf_counter()
        fn()
        alone = time.perf_counter() - start
        if alone < 0.02:
            pytest.skip(f"{name}: one call takes {alone * 1e3:.1f} ms here, too short to tell")
        assert max_gap_while(fn) < 0.6 * alone, name


@requires_c
def test_compiled_ngram_kernels_present():
    """The extension ships the compiled CPU n-gram kernels and the index class."""
    for op in ("ngram_propose", "ngram_propose_tree"):
        assert sk.available_backends(op, "cpu")[0] == "cpu", op
    assert HAS_INDEX
    assert NgramIndex(1).backend == "cpu"
