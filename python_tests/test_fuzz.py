"""Property-based fuzzing (hypothesis) of every op against `reference`, and against the brute
forces of the per-op test files.

Hypothesis draws the structure of each case (shapes, dtypes, tree shapes, layouts, scalar
arguments) and a seed for the tensor contents, so a failure shrinks to a small case. Covered:
batch 1..4, T = 1 and trees up to 70 nodes (two mask words), chains / stars / bushy / deep /
random trees with and without padding, a tree shared by the batch, S = T (empty prefixes, no
spare slots), V = 1, D in {32, 64, 80, 128}, GQA, fp32 / bf16 / fp16, int32 / int64 indices,
transposed HF-layout views and slices of bigger buffers.

Replay: every run draws a fresh seed, printed as `SPECDEC_TEST_SEED=...` with a failing test's
output (the same variable as conftest.py's `gen`); `SPECDEC_TEST_SEED=<seed> pytest ...` reruns
the same examples. Hypothesis also prints the failing (shrunk) example and a
`@reproduce_failure` blob. `SPECDEC_FUZZ_SCALE=<k>` multiplies every example count (for
longer local fuzzing; CI uses 1).

Tolerances are those of the per-op tests: tree attention between backends TOL_BACKEND (one or
two output roundings), the Triton kernel TOL_VS_REFERENCE; verify's greedy rows exactly and at
most one sampled row per call differing (CPU, see test_verify_cpu.py) or max(1, 2%) (Triton,
see test_verify_triton.py); every other op exactly.
"""

import importlib.util
import os
import random

import pytest
import torch
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

import specdec_kernels as sk
from specdec_kernels import (NgramIndex, compact_kv_cache_, ngram_propose, ngram_propose_tree, pack_tree_mask,
                             tree_attention, tree_mask, verify, verify_chain)

from conftest import HAS_CUDA, compare_verify, import_interpreted_kernels, triton_interpret_env
from test_kv_cache import brute_compact
from test_ngram import brute_propose, brute_tree
from test_tree import brute_pack, brute_tree_mask
from test_tree_attention import TOL_BACKEND

SEED = int(os.environ.get("SPECDEC_TEST_SEED", random.SystemRandom().randrange(2**31)))
SCALE = int(os.environ.get("SPECDEC_FUZZ_SCALE", "1"))
HAS_TRITON = importlib.util.find_spec("triton") is not None
# Kernel modules built for the Triton interpreter (None on a CUDA machine, without triton, or
# when triton was imported without TRITON_INTERPRET=1 first: see conftest.py).
TRITON_ATTENTION = import_interpreted_kernels("specdec_kernels.ops.triton.tree_attention") if HAS_TRITON else None
TRITON_VERIFY = import_interpreted_kernels("specdec_kernels.ops.triton.verify") if HAS_TRITON else None
TRITON_SKIP = "triton is not installed" if not HAS_TRITON else (
    "the Triton interpreter is unavailable in this process (CUDA present, or triton imported first)")
# The Triton kernel keeps fp32 sums in another order than the reference: test_tree_attention_triton's fp32 tolerance.
TRITON_FP32_TOL = dict(atol=2e-5, rtol=1e-4)

CPU_BACKENDS = {op: [None] + sk.available_backends(op, "cpu") for op in
                ("tree_mask", "pack_tree_mask", "tree_attention", "verify", "compact_kv_cache_", "ngram_propose",
                 "ngram_propose_tree")}
FLOATS = (torch.float32, torch.bfloat16, torch.float16)
INTS = (torch.int32, torch.int64)
KINDS = ("chain", "star", "bushy", "deep", "random")


def fuzz(max_examples: int):
    """hypothesis settings for one test: `max_examples` (times SPECDEC_FUZZ_SCALE), no deadline
    (the machine is shared and the Triton interpreter is slow), fresh random examples seeded by
    SEED, no example database (nothing written into the checkout), the reproduce blob printed."""

    def wrap(test):
        configured = settings(
            max_examples=max_examples * SCALE,
            deadline=None,
            derandomize=False,
            database=None,
            print_blob=True,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )(test)
        return seed(SEED)(configured)

    return wrap


@pytest.fixture(autouse=True)
def _print_seed():
    """Shown with a failing test's captured output, for replay."""
    print(f"SPECDEC_TEST_SEED={SEED}  # replay these examples with this environment variable")


# ----------------------------------------------------------------------------- strategies


def generator(data) -> torch.Generator:
    """A torch generator for a case's tensor contents, its seed drawn (and shrunk) by hypothesis."""
    return torch.Generator().manual_seed(data.draw(st.integers(0, 2**32 - 1), label="content seed"))


def draw_parent_row(data, num_nodes: int, kind: str, ragged: bool) -> list:
    """One valid parent list of `kind` (see conftest.random_parents), padded with -1 after a
    drawn number of real nodes when `ragged`."""
    real = data.draw(st.integers(1, num_nodes), label="real nodes") if ragged else num_nodes
    row = [-1] * num_nodes
    for i in range(1, real):
        if kind == "chain":
            row[i] = i - 1
        elif kind == "star":
            row[i] = 0
        elif kind == "bushy":
            row[i] = data.draw(st.integers(0, min(i, 3) - 1))
        elif kind == "deep":
            row[i] = data.draw(st.integers(max(0, i - 2), i - 1))
        else:
            row[i] = data.draw(st.integers(0, i - 1))
    return row


def draw_tree(data, batch: int, num_nodes: int, *, allow_shared=True):
    """(parents int64 [B, T], shared): rows of one drawn kind, ragged or not; with `shared`,
    every row is the same tree (callers may pass it as a [T] tensor)."""
    kind = data.draw(st.sampled_from(KINDS), label="tree kind")
    ragged = data.draw(st.booleans(), label="padded")
    shared = allow_shared and data.draw(st.booleans(), label="shared tree")
    if shared:
        row = draw_parent_row(data, num_nodes, kind, ragged)
        return torch.tensor([row] * batch, dtype=torch.int64), True
    rows = [draw_parent_row(data, num_nodes, kind, ragged) for _ in range(batch)]
    return torch.tensor(rows, dtype=torch.int64), False


def with_layout(x: torch.Tensor, layout: str) -> torch.Tensor:
    """The same values as `x` in another memory layout: "contiguous"; "strided": every other
    element of a buffer twice as big (no dim contiguous); "transposed": the transpose of a
    contiguous tensor with the first two dims swapped."""
    if layout == "contiguous":
        return x.contiguous()
    if layout == "strided":
        buf = torch.zeros((*x.shape, 2), dtype=x.dtype)
        buf[..., 0] = x
        return buf[..., 0]
    if layout == "transposed":
        return x.transpose(0, 1).contiguous().transpose(0, 1)
    raise ValueError(layout)


# ----------------------------------------------------------------------------- tree_mask, pack_tree_mask

NODE_COUNTS = st.one_of(st.integers(1, 12), st.sampled_from((31, 63, 64, 65, 70, 128, 129)))


@fuzz(150)
@given(data=st.data())
def test_tree_mask(data):
    batch = data.draw(st.integers(1, 4), label="B")
    num_nodes = data.draw(NODE_COUNTS, label="T")
    parents, shared = draw_tree(data, batch, num_nodes)
    dtype = data.draw(st.sampled_from(INTS), label="dtype")
    one_d = shared and data.draw(st.booleans(), label="[T] input")
    layout = data.draw(st.sampled_from(("contiguous", "strided") if one_d else ("contiguous", "strided", "transposed")))
    given_parents = with_layout((parents[0] if one_d else parents).to(dtype), layout)
    expected = torch.tensor(brute_tree_mask(parents[:1] if one_d else parents), dtype=torch.bool)
    if one_d:
        expected = expected[0]
    for backend in ["reference"] + CPU_BACKENDS["tree_mask"]:
        mask = tree_mask(given_parents, backend=backend)
        assert mask.dtype == torch.bool and mask.shape == expected.shape, backend
        assert torch.equal(mask, expected), backend


@fuzz(150)
@given(data=st.data())
def test_pack_tree_mask(data):
    """Tree masks and arbitrary bool masks, [T, T] and [B, T, T], contiguous or transposed views."""
    g = generator(data)
    batch = data.draw(st.integers(1, 3), label="B")
    num_nodes = data.draw(NODE_COUNTS, label="T")
    if data.draw(st.booleans(), label="tree mask"):
        parents, _ = draw_tree(data, batch, num_nodes, allow_shared=False)
        mask = tree_mask(parents, backend="reference")
    else:
        density = data.draw(st.sampled_from((0.0, 0.1, 0.5, 1.0)), label="density")
        mask = torch.rand(batch, num_nodes, num_nodes, generator=g) < density
    if data.draw(st.booleans(), label="2-D"):
        mask = mask[0]
    if data.draw(st.booleans(), label="transposed view"):  # same values, other strides
        mask = mask.transpose(-1, -2).contiguous().transpose(-1, -2)
    expected = torch.tensor(brute_pack(mask), dtype=torch.int64).reshape(*mask.shape[:-1], -1)
    for backend in ["reference"] + CPU_BACKENDS["pack_tree_mask"]:
        packed = pack_tree_mask(mask, backend=backend)
        assert packed.dtype == torch.int64, backend
        assert torch.equal(packed, expected), backend


# ----------------------------------------------------------------------------- tree_attention


def draw_attention_case(data, *, dtypes=FLOATS, max_batch=3, max_nodes=20, wide_nodes=(63, 64, 65), max_prefix=400,
                        head_dims=(32, 64, 80, 128)):
    """(q, k_cache, v_cache, mask, cache_seqlens, scale, parents): random values, garbage past
    each row's tree, layouts and mask forms drawn. Prefixes are short, or up to `max_prefix`
    (many 64-key tiles; past 256 keys the CPU kernel splits a row's keys over threads)."""
    g = generator(data)
    batch = data.draw(st.integers(1, max_batch), label="B")
    num_nodes = data.draw(st.one_of(st.integers(1, max_nodes), st.just(1), st.sampled_from(wide_nodes)), label="T")
    kv_heads = data.draw(st.integers(1, 2), label="Hkv")
    q_heads = kv_heads * data.draw(st.sampled_from((1, 2, 4)), label="group")
    head_dim = data.draw(st.sampled_from(head_dims), label="D")
    dtype = data.draw(st.sampled_from(dtypes), label="dtype")
    parents, shared = draw_tree(data, batch, num_nodes)
    longest = data.draw(st.sampled_from((40, 40, 40, max_prefix)), label="longest prefix")
    prefix = torch.tensor([data.draw(st.integers(0, longest), label="prefix") for _ in range(batch)], dtype=torch.int32)
    if data.draw(st.booleans(), label="empty prefixes"):
        prefix.zero_()  # with no spare slots below: S = T
    spare = data.draw(st.sampled_from((0, 0, 1, 7)), label="spare slots")
    cache_len = int(prefix.max()) + num_nodes + spare
    layout = data.draw(st.sampled_from(("contiguous", "hf", "slice")), label="layout")

    def tensor(tokens, heads):  # [B, tokens, heads, D] random values in the drawn layout
        if layout == "hf":  # HF caches are [B, H, S, D]: the ops take .transpose(1, 2) views
            return torch.randn(batch, heads, tokens, head_dim, generator=g).to(dtype).transpose(1, 2)
        if layout == "slice":  # a window of a bigger buffer: every stride but the last differs
            big = torch.randn(batch + 1, tokens + 2, heads + 1, head_dim + 8, generator=g).to(dtype)
            return big[1:, 1 : 1 + tokens, :heads, 4 : 4 + head_dim]
        return torch.randn(batch, tokens, heads, head_dim, generator=g).to(dtype)

    q, k, v = tensor(num_nodes, q_heads), tensor(cache_len, kv_heads), tensor(cache_len, kv_heads)
    for b in range(batch):  # finite garbage nobody may see: past the tree
        end = int(prefix[b]) + num_nodes
        k[b, end:] = 30.0
        v[b, end:] = 1e3
    mask = tree_mask(parents[0] if shared and data.draw(st.booleans(), label="[T, T] mask") else parents)
    if data.draw(st.booleans(), label="packed mask"):
        mask = pack_tree_mask(mask)
    scale = data.draw(st.sampled_from((None, 0.05, 0.3)), label="scale")
    if data.draw(st.booleans(), label="strided seqlens"):
        prefix = with_layout(prefix, "strided")
    return q, k, v, mask, prefix, scale, parents


def reference_attention(q, k, v, mask, prefix, scale):
    return tree_attention(q, k, v, mask, prefix, scale=scale, backend="reference")


@fuzz(150)
@given(data=st.data())
def test_tree_attention_cpu(data):
    q, k, v, mask, prefix, scale, _ = draw_attention_case(data)
    ref = reference_attention(q, k, v, mask, prefix, scale)
    assert ref.shape == q.shape and ref.dtype == q.dtype and torch.isfinite(ref).all()
    for backend in CPU_BACKENDS["tree_attention"]:
        out = tree_attention(q, k, v, mask, prefix, scale=scale, backend=backend)
        assert out.shape == q.shape and out.dtype == q.dtype, backend
        torch.testing.assert_close(out, ref, **TOL_BACKEND[q.dtype], msg=lambda m: f"backend={backend}: {m}")


@pytest.mark.skipif(TRITON_ATTENTION is None, reason=TRITON_SKIP)
@fuzz(40)
@given(data=st.data())
def test_tree_attention_triton_interpreter(data):
    """fp32 only: the interpreter runs the kernel in numpy, where 16-bit dots are emulated."""
    q, k, v, mask, prefix, scale, _ = draw_attention_case(data, dtypes=(torch.float32,), max_batch=2, max_nodes=12,
                                                          wide_nodes=(65,), max_prefix=300)
    ref = reference_attention(q, k, v, mask, prefix, scale)
    with triton_interpret_env():
        out = tree_attention(q, k, v, mask, prefix, scale=scale, backend="triton")
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out, ref, **TRITON_FP32_TOL)


# ----------------------------------------------------------------------------- verify, verify_chain


def draw_verify_case(data, *, dtypes=FLOATS, max_batch=4, max_nodes=10, vocabs=(1, 2, 3, 17, 64, 300, 1000, 4099)):
    """(logits, tree_tokens, parents, draft_probs, kwargs, greedy [B]) with drafts likely enough
    that paths go deep: each drafted token gets a bump on its parent's logit (and q mass)."""
    g = generator(data)
    batch = data.draw(st.integers(1, max_batch), label="B")
    num_nodes = data.draw(st.integers(1, max_nodes), label="T")
    vocab = data.draw(st.sampled_from(vocabs), label="V")
    dtype = data.draw(st.sampled_from(dtypes), label="dtype")
    parents, shared = draw_tree(data, batch, num_nodes)
    with_probs = data.draw(st.booleans(), label="draft probs")
    siblings = max(int((parents == p).sum(-1).max()) for p in range(num_nodes)) if num_nodes > 1 else 0
    if siblings > vocab:  # deterministic drafts need distinct siblings: not enough ids
        with_probs = True
    real = parents >= 0
    real[:, 0] = True
    tokens = torch.full((batch, num_nodes), -1, dtype=torch.int64)
    for b in range(batch):
        tokens[b, 0] = int(torch.randint(0, vocab, (), generator=g))
        for p in range(num_nodes):
            children = torch.nonzero(parents[b] == p).flatten()
            children = children[children > 0]
            if not len(children):
                continue
            if with_probs:  # i.i.d. from a few ids, so siblings repeat sometimes
                tokens[b, children] = torch.randint(0, min(vocab, 5), (len(children),), generator=g)
            else:
                tokens[b, children] = torch.randperm(vocab, generator=g)[: len(children)]
    logit_scale = data.draw(st.sampled_from((0.5, 2.0, 8.0)), label="logit scale")
    logits = torch.randn(batch, num_nodes, vocab, generator=g) * logit_scale
    q = torch.softmax(torch.randn(batch, num_nodes, vocab, generator=g) * 2, -1) if with_probs else None
    for b in range(batch):
        for i in range(1, num_nodes):
            p = int(parents[b, i])
            if p >= 0:
                logits[b, p, tokens[b, i]] += 6.0
                if q is not None:
                    q[b, p, tokens[b, i]] += 0.3
    special = data.draw(st.sampled_from(("finite", "finite", "-inf", "nan", "+inf", "all -inf")), label="non-finite")
    if special != "finite":  # defined results (reference/verify.py): NaN is probability 0, +inf takes it all
        hit = torch.rand(batch, num_nodes, vocab, generator=g) < (1.0 if special == "all -inf" else 0.2)
        if special == "all -inf":
            hit &= torch.rand(batch, num_nodes, 1, generator=g) < 0.5  # whole nodes
        logits[hit] = {"-inf": -float("inf"), "all -inf": -float("inf"), "nan": float("nan"), "+inf": float("inf")}[special]
    if q is not None:
        if data.draw(st.booleans(), label="zeros in q"):  # a drafted token may have q(x) = 0: its ratio is +inf
            q[torch.rand(batch, num_nodes, vocab, generator=g) < 0.3] = 0.0
            q[..., 0] += 1e-3  # keep every row's sum positive
        q = (q / q.sum(-1, keepdim=True)).to(data.draw(st.sampled_from(FLOATS), label="draft probs dtype"))
    if data.draw(st.booleans(), label="batch-transposed logits"):  # [T, B, V] memory, last dim contiguous
        logits = logits.to(dtype).transpose(0, 1).contiguous().transpose(0, 1)
    else:
        logits = logits.to(dtype)
    tokens = tokens.to(data.draw(st.sampled_from(INTS), label="token dtype"))

    mode = data.draw(st.sampled_from(("greedy", "sampled", "mixed")), label="rows")
    hot = torch.rand(batch, generator=g) + 0.3
    if mode == "greedy":
        temperature = torch.zeros(batch)
    elif mode == "sampled":
        temperature = hot
    else:
        temperature = torch.where(torch.rand(batch, generator=g) < 0.4, 0.0, hot)
    kwargs = dict(temperature=temperature)
    if data.draw(st.booleans(), label="top-k / top-p"):
        kwargs["top_k"] = torch.where(torch.rand(batch, generator=g) < 0.5,
                                      torch.randint(0, vocab + 2, (batch,), generator=g), 0)
        kwargs["top_p"] = torch.where(torch.rand(batch, generator=g) < 0.5, torch.rand(batch, generator=g) * 0.9 + 0.1, 1.0)
    if data.draw(st.booleans(), label="per-row seeds"):
        kwargs["seed"] = torch.randint(-(2**62), 2**62, (batch,), generator=g)
    else:
        kwargs["seed"] = data.draw(st.integers(-(2**63), 2**63 - 1), label="seed")
    one_d = shared and data.draw(st.booleans(), label="[T] parents")
    given_parents = parents[0] if one_d else parents.to(data.draw(st.sampled_from(INTS), label="parents dtype"))
    return logits, tokens, given_parents, q, kwargs, temperature == 0, parents


@fuzz(150)
@given(data=st.data())
def test_verify_cpu(data):
    """Greedy rows exactly, sampled rows with the same Philox draws (at most one row differing
    by an ulp-level tie, see test_verify_cpu.py); the same seed twice gives the same result."""
    logits, tokens, parents, q, kwargs, greedy, parents_2d = draw_verify_case(data)
    vocab = logits.shape[-1]
    ref = verify(logits, tokens, parents, draft_probs=q, backend="reference", **kwargs)
    for backend in CPU_BACKENDS["verify"]:
        out = verify(logits, tokens, parents, draft_probs=q, backend=backend, **kwargs)
        compare_verify(out, ref, greedy, tokens, parents_2d, vocab, f"backend={backend}")
        again = verify(logits, tokens, parents, draft_probs=q, backend=backend, **kwargs)
        assert all(torch.equal(a, b) for a, b in zip(out, again)), f"backend={backend}: not deterministic"


@fuzz(80)
@given(data=st.data())
def test_verify_chain_cpu(data):
    """verify_chain on every backend against the reference, and the reference's verify_chain
    against its verify on the same chain written as a tree."""
    g = generator(data)
    batch = data.draw(st.integers(1, 4), label="B")
    k = data.draw(st.integers(0, 9), label="K")
    vocab = data.draw(st.sampled_from((1, 2, 50, 1000)), label="V")
    dtype = data.draw(st.sampled_from(FLOATS), label="dtype")
    drafts = torch.randint(0, min(vocab, 4), (batch, k), generator=g).to(data.draw(st.sampled_from(INTS)))
    logits = torch.randn(batch, k + 1, vocab, generator=g) * 2
    logits[:, :k].scatter_add_(2, drafts.long()[..., None], torch.full((batch, k, 1), 6.0))  # likely drafts
    logits = logits.to(dtype)
    q = None
    if data.draw(st.booleans(), label="draft probs"):
        q = torch.softmax(torch.randn(batch, k, vocab, generator=g), -1).to(data.draw(st.sampled_from(FLOATS)))
    temperature = data.draw(st.sampled_from((0.0, 0.6, 1.0)), label="temperature")
    kwargs = dict(draft_probs=q, temperature=temperature, seed=data.draw(st.integers(0, 2**62), label="seed"))
    ref = verify_chain(logits, drafts, backend="reference", **kwargs)
    chain = torch.arange(-1, k)
    tree_tokens = torch.cat([torch.zeros(batch, 1, dtype=torch.int64), drafts.long()], 1)
    tree_q = None if q is None else torch.cat([q, q.new_zeros(batch, 1, vocab)], 1)
    as_tree = verify(logits, tree_tokens, chain, draft_probs=tree_q, temperature=temperature, seed=kwargs["seed"],
                     backend="reference")
    assert all(torch.equal(a, b) for a, b in zip(ref, as_tree))
    greedy = torch.full((batch,), temperature == 0)
    for backend in CPU_BACKENDS["verify"]:
        out = verify_chain(logits, drafts, backend=backend, **kwargs)
        compare_verify(out, ref, greedy, tree_tokens, chain.expand(batch, -1), vocab, f"backend={backend}")


@pytest.mark.skipif(TRITON_VERIFY is None, reason=TRITON_SKIP)
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # numpy in the interpreter, on +inf logits
@fuzz(40)
@given(data=st.data())
def test_verify_triton_interpreter(data):
    """fp32 logits (the interpreter's dtype), the same comparison as test_verify_triton.py."""
    logits, tokens, parents, q, kwargs, greedy, parents_2d = draw_verify_case(
        data, dtypes=(torch.float32,), max_batch=3, max_nodes=7, vocabs=(1, 2, 17, 300))
    if q is not None:
        # fp32 for the interpreter; renormalised, since 16-bit probabilities summed to 1 within
        # their own rounding, not within verify's fp32 tolerance (rows that sum to 0 may hold anything).
        q = q.float()
        total = q.sum(-1, keepdim=True)
        q = torch.where(total > 0, q / total, q)
    ref = verify(logits, tokens, parents, draft_probs=q, backend="reference", **kwargs)
    with triton_interpret_env():
        out = verify(logits, tokens, parents, draft_probs=q, backend="triton", **kwargs)
    compare_verify(out, ref, greedy, tokens, parents_2d, logits.shape[-1], "triton", sampled_rows_per_mismatch=50)


# ----------------------------------------------------------------------------- compact_kv_cache_


def draw_path(data, row: list) -> list:
    """A root-to-node path of the tree given by the parent list `row`, each step a drawn child."""
    path = [0]
    while True:
        children = [i for i, p in enumerate(row) if i > 0 and p == path[-1]]
        if not children or not data.draw(st.booleans(), label="go deeper"):
            return path
        path.append(data.draw(st.sampled_from(children), label="child"))


@fuzz(150)
@given(data=st.data())
def test_compact_kv_cache(data):
    g = generator(data)
    batch = data.draw(st.integers(1, 4), label="B")
    num_nodes = data.draw(st.one_of(st.integers(1, 12), st.just(65)), label="T")
    parents, _ = draw_tree(data, batch, num_nodes, allow_shared=False)
    fill = data.draw(st.sampled_from(("padding", "garbage")), label="after the path")
    accepted = torch.full((batch, num_nodes), -1, dtype=torch.int64)
    if fill == "garbage":  # entries past num_accepted are not part of the path: any node id
        accepted = torch.randint(-1, num_nodes, (batch, num_nodes), generator=g)
    num_accepted = torch.zeros(batch, dtype=torch.int64)
    for b in range(batch):
        path = draw_path(data, parents[b].tolist())
        accepted[b, : len(path)] = torch.tensor(path)
        num_accepted[b] = len(path) - 1
    prefix = torch.tensor([data.draw(st.integers(0, 30), label="prefix") for _ in range(batch)])
    min_len = int(prefix.max()) + num_nodes
    caches = []
    for _ in range(data.draw(st.integers(1, 3), label="caches")):
        heads = data.draw(st.integers(1, 3), label="H")
        dim = data.draw(st.sampled_from((1, 5, 32, 64, 80, 128)), label="D")
        dtype = data.draw(st.sampled_from(FLOATS), label="dtype")
        cache_len = min_len + data.draw(st.sampled_from((0, 0, 3)), label="spare")
        layout = data.draw(st.sampled_from(("contiguous", "hf", "slice")), label="layout")
        if layout == "hf":
            cache = torch.randn(batch, heads, cache_len, dim, generator=g).to(dtype).transpose(1, 2)
        elif layout == "slice":
            cache = torch.randn(batch + 1, cache_len + 2, heads + 1, dim + 3, generator=g).to(dtype)[1:, 1:-1, 1:, :dim]
        else:
            cache = torch.randn(batch, cache_len, heads, dim, generator=g).to(dtype)
        caches.append(cache)
    prefix = prefix.to(data.draw(st.sampled_from(INTS), label="seqlens dtype"))
    accepted = accepted.to(data.draw(st.sampled_from(INTS), label="accepted dtype"))
    num_accepted = num_accepted.to(data.draw(st.sampled_from(INTS), label="num_accepted dtype"))
    expected = [brute_compact(c, prefix, accepted, num_accepted) for c in caches]
    expected_lens = prefix + num_accepted.to(prefix.dtype) + 1
    for backend in ["reference"] + CPU_BACKENDS["compact_kv_cache_"]:
        copies = []
        for c in caches:  # fresh copies with the original strides (views stay views)
            copy = torch.empty_strided(c.shape, c.stride(), dtype=c.dtype)
            copies.append(copy.copy_(c))
        new_lens = compact_kv_cache_(copies, prefix, accepted, num_accepted, backend=backend)
        assert new_lens.dtype == prefix.dtype and torch.equal(new_lens, expected_lens), backend
        for i, (got, want) in enumerate(zip(copies, expected)):
            assert torch.equal(got, want), f"backend={backend}, cache {i} ({tuple(got.shape)}, strides {got.stride()})"


# ----------------------------------------------------------------------------- n-gram drafting


def draw_histories(data, g, *, max_len=120):
    """(tokens [B, L] with garbage past each length, lengths [B], lists): small alphabets so
    n-grams repeat, or large ones so most rows have no match."""
    batch = data.draw(st.one_of(st.integers(1, 4), st.integers(5, 40)), label="B")
    width = data.draw(st.one_of(st.integers(0, 12), st.integers(0, max_len), st.integers(max_len, 3000)), label="L")
    dtype = data.draw(st.sampled_from(INTS), label="tokens dtype")
    alphabets = (1, 2, 3, 5, 1000, 2**31 - 1) + ((2**40,) if dtype == torch.int64 else ())
    alphabet = data.draw(st.sampled_from(alphabets), label="alphabet")
    tokens = torch.randint(0, alphabet, (batch, width), generator=g)
    lengths = torch.tensor([data.draw(st.integers(0, width), label="length") for _ in range(batch)], dtype=torch.int64)
    if width and data.draw(st.booleans(), label="a full row"):
        lengths[0] = width
    histories = [tokens[b, : int(lengths[b])].tolist() for b in range(batch)]
    for b in range(batch):  # what lies past the length must not matter
        tokens[b, int(lengths[b]) :] = torch.randint(0, alphabet, (width - int(lengths[b]),), generator=g)
    tokens = tokens.to(dtype)
    if data.draw(st.booleans(), label="strided tokens"):
        tokens = with_layout(tokens, "strided")
    return tokens, lengths.to(data.draw(st.sampled_from(INTS), label="lengths dtype")), histories


def draw_ngram_args(data, max_max_n=6):
    min_n = data.draw(st.integers(1, max_max_n), label="min_n")
    max_n = data.draw(st.integers(min_n, max_max_n), label="max_n")
    return dict(min_n=min_n, max_n=max_n, num_tokens=data.draw(st.integers(1, 9), label="num_tokens"),
                policy=data.draw(st.sampled_from(("earliest", "latest")), label="policy"))


@fuzz(200)
@given(data=st.data())
def test_ngram_propose(data):
    tokens, lengths, histories, = draw_histories(data, generator(data))
    args = draw_ngram_args(data)
    expected = torch.full((len(histories), args["num_tokens"]), -1, dtype=tokens.dtype)
    expected_lens = torch.zeros(len(histories), dtype=torch.int32)
    for b, s in enumerate(histories):
        proposal = brute_propose(s, args["min_n"], args["max_n"], args["num_tokens"], args["policy"])
        expected[b, : len(proposal)] = torch.tensor(proposal, dtype=tokens.dtype)
        expected_lens[b] = len(proposal)
    for backend in ["reference"] + CPU_BACKENDS["ngram_propose"]:
        drafts, lens = ngram_propose(tokens, lengths, backend=backend, **args)
        assert drafts.dtype == tokens.dtype and lens.dtype == torch.int32, backend
        assert torch.equal(drafts, expected) and torch.equal(lens, expected_lens), backend


@fuzz(200)
@given(data=st.data())
def test_ngram_propose_tree(data):
    tokens, lengths, histories = draw_histories(data, generator(data))
    args = draw_ngram_args(data)
    tree_width = data.draw(st.integers(1, 5), label="tree_width")
    max_nodes = data.draw(st.one_of(st.none(), st.integers(0, 12)), label="max_nodes")
    budget = tree_width * args["num_tokens"] if max_nodes is None else max_nodes
    rows = [brute_tree(s, args["min_n"], args["max_n"], args["num_tokens"], tree_width, budget, args["policy"])
            for s in histories]
    expected_tokens = torch.tensor([r[0] for r in rows], dtype=tokens.dtype)
    expected_parents = torch.tensor([r[1] for r in rows], dtype=torch.int64)
    for backend in ["reference"] + CPU_BACKENDS["ngram_propose_tree"]:
        tree = ngram_propose_tree(tokens, lengths, tree_width=tree_width, max_nodes=max_nodes, backend=backend, **args)
        assert tree.tokens.dtype == tokens.dtype and tree.parents.dtype == torch.int64, backend
        assert torch.equal(tree.tokens, expected_tokens), backend
        assert torch.equal(tree.parents, expected_parents), backend


INDEX_BACKENDS = ["python"] + (["cpu"] if NgramIndex.has_compiled_backend() else [])


@fuzz(120)
@given(data=st.data())
def test_ngram_index(data):
    """A random sequence of resets, appends and queries; every query against ngram_propose
    (reference) on each slot's history, kept here as a plain list."""
    g = generator(data)
    backend = data.draw(st.sampled_from(INDEX_BACKENDS), label="backend")
    num_slots = data.draw(st.integers(1, 4), label="slots")
    max_n = data.draw(st.integers(1, 6), label="index max_n")
    alphabet = data.draw(st.sampled_from((1, 2, 4, 50)), label="alphabet")
    extra = {}
    if backend == "cpu" and data.draw(st.booleans(), label="colliding hashes"):
        extra["_hash_bits"] = data.draw(st.sampled_from((1, 3, 8)))  # test hook: collisions must not change answers
    index = NgramIndex(num_slots, max_n=max_n, dtype=data.draw(st.sampled_from(INTS), label="dtype"), backend=backend,
                       **extra)
    histories = [[] for _ in range(num_slots)]
    for _ in range(data.draw(st.integers(1, 12), label="steps")):
        action = data.draw(st.sampled_from(("reset", "append", "propose", "append_and_propose")), label="action")
        if action == "reset":
            slot = data.draw(st.integers(0, num_slots - 1), label="slot")
            prompt = torch.randint(0, alphabet, (data.draw(st.integers(0, 60), label="prompt length"),), generator=g)
            index.reset(slot, prompt)
            histories[slot] = prompt.tolist()
            continue
        slots = data.draw(st.lists(st.integers(0, num_slots - 1), min_size=1, max_size=num_slots, unique=True),
                          label="slots")
        kwargs = draw_ngram_args(data, max_max_n=max_n)
        if action != "propose":
            width = data.draw(st.integers(0, 6), label="K")
            new = torch.randint(0, alphabet, (len(slots), width), generator=g)
            counts = torch.tensor([data.draw(st.integers(0, width), label="count") for _ in slots])
            for r, s in enumerate(slots):
                histories[s] += new[r, : int(counts[r])].tolist()
        if action == "append":
            index.append(slots, new, counts)
            continue
        if action == "propose":
            drafts, lens = index.propose(slots, **kwargs)
        else:
            drafts, lens = index.append_and_propose(slots, new, counts, **kwargs)
        for r, s in enumerate(slots):
            assert index.length(s) == len(histories[s])
            row = torch.tensor(histories[s], dtype=torch.int64)[None]
            want, want_len = ngram_propose(row, torch.tensor([row.shape[1]]), backend="reference", **kwargs)
            got_len = int(lens[r])
            assert got_len == int(want_len[0]), f"slot {s}: draft length {got_len} != {int(want_len[0])}"
            assert drafts[r, :got_len].tolist() == want[0, :got_len].tolist(), f"slot {s}"
            assert (drafts[r, got_len:] == -1).all()
