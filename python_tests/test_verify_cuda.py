"""The CUDA `verify` kernel against backend="reference" on the same GPU tensors.

Both backends read the same Philox uniforms, so greedy rows must match exactly and sampled
rows token for token except where two candidates (a race, an acceptance test, a top-p
boundary) are within fp32 rounding of each other, which the two implementations round
differently (sum orders, exp of the normaliser): the tests require nearly all sampled rows
to match and every row to satisfy the output contract. Every test skips without a GPU or
without a compiled CUDA verify kernel (setup.py builds it where torch has CUDA and nvcc is found).
"""

import pytest
import torch

from specdec_kernels import verify, verify_chain

from conftest import cuda_kernel_marks, distinct_sibling_tokens, random_parents, randint
from test_verify import random_logits

pytestmark = cuda_kernel_marks("verify")

# Sampled rows whose tokens may differ from the reference (fp32 near-ties only).
MIN_SAMPLED_AGREEMENT = 0.97


# Non-finite logits here: 5% NaN, 5% -inf, 0.2% +inf (test_verify.random_logits cuts).
NONFINITE_CUTS = (0.05, 0.1, 0.102)


def random_draft_probs(gen, batch, num_nodes, vocab):
    probs = torch.softmax(torch.randn(batch, num_nodes, vocab, generator=gen) * 2, dim=-1)
    zero = torch.rand(batch, num_nodes, vocab, generator=gen) < 0.2
    zero[..., 0] = False
    probs = torch.where(zero, 0.0, probs)
    return probs / probs.sum(-1, keepdim=True)


def sampled_tree_tokens(gen, parents, draft_probs):
    """Children drawn from their parent's draft distribution (siblings may repeat)."""
    batch, num_nodes, vocab = draft_probs.shape
    dist = draft_probs[torch.arange(batch)[:, None], parents.clamp(min=0)].reshape(-1, vocab)
    tokens = torch.multinomial(dist, 1, generator=gen).reshape(batch, num_nodes)
    tokens[:, 0] = randint(gen, 0, vocab, (batch,))
    return torch.where(parents >= 0, tokens, torch.full_like(tokens, -1)) if num_nodes > 1 else tokens


def target_guided_tokens(gen, parents, logits):
    """Distinct-sibling tokens where the first child of each node holds its argmax, so greedy
    and low-temperature rows walk deep into the tree (random tokens would stop at the root)."""
    tokens = distinct_sibling_tokens(gen, parents, logits.shape[-1])
    best = logits.float().nan_to_num(nan=-float("inf")).argmax(-1)
    for b in range(parents.shape[0]):
        seen = set()
        for i in range(1, parents.shape[1]):
            p = int(parents[b, i])
            if p >= 0 and p not in seen:
                seen.add(p)
                want = int(best[b, p])
                siblings = [j for j in range(1, parents.shape[1]) if int(parents[b, j]) == p]
                holder = [j for j in siblings if int(tokens[b, j]) == want]
                if holder:  # swap so node i holds the argmax
                    tokens[b, holder[0]] = tokens[b, i]
                tokens[b, i] = want
    return tokens


def row_params(gen, batch, vocab, greedy_fraction=0.25):
    temperature = torch.rand(batch, generator=gen) * 1.5 + 0.2
    temperature = torch.where(torch.rand(batch, generator=gen) < greedy_fraction, 0.0, temperature)
    ks = torch.tensor([0, 0, 1, 3, 50, vocab - 1, vocab, vocab + 7])
    top_k = ks[randint(gen, 0, len(ks), (batch,))]
    ps = torch.tensor([1.0, 1.0, 0.3, 0.8, 0.95, 0.999])
    top_p = ps[randint(gen, 0, len(ps), (batch,))]
    return temperature, top_k, top_p


def build(gen, batch, num_nodes, vocab, kind, *, with_probs, dtype, nonfinite=False, ties=False, guided=True):
    parents = random_parents(gen, batch, num_nodes, kind, ragged=True)
    logits = random_logits(gen, batch, num_nodes, vocab, torch.float32, nonfinite=nonfinite, ties=ties,
                           nonfinite_cuts=NONFINITE_CUTS)
    if with_probs:
        draft_probs = random_draft_probs(gen, batch, num_nodes, vocab)
        tokens = sampled_tree_tokens(gen, parents, draft_probs)
    else:
        draft_probs = None
        tokens = target_guided_tokens(gen, parents, logits) if guided else distinct_sibling_tokens(gen, parents, vocab)
    temperature, top_k, top_p = row_params(gen, batch, vocab)
    cuda = lambda t: None if t is None else t.cuda()  # noqa: E731
    return dict(
        target_logits=logits.to(dtype).cuda(),
        tree_tokens=tokens.cuda(),
        parents=parents.cuda(),
        draft_probs=cuda(None if draft_probs is None else draft_probs.to(dtype)),
        temperature=temperature.cuda(),
        top_k=top_k.cuda(),
        top_p=top_p.cuda(),
        seed=randint(gen, -(2**62), 2**62, (batch,)).cuda(),
    )


def check_contract(out, tree_tokens, parents, vocab):
    """Dtypes, shapes, a path that follows parent links, tokens in the vocabulary."""
    batch, num_nodes = tree_tokens.shape
    assert out.accepted_nodes.dtype == torch.int32 and out.accepted_nodes.shape == (batch, num_nodes)
    assert out.num_accepted.dtype == torch.int32 and out.num_accepted.shape == (batch,)
    assert out.output_tokens.dtype == torch.int64 and out.output_tokens.shape == (batch, num_nodes)
    acc, num, toks = out.accepted_nodes.cpu(), out.num_accepted.cpu(), out.output_tokens.cpu()
    tree_tokens, parents = tree_tokens.cpu(), parents.cpu()
    assert (acc[:, 0] == 0).all()
    assert ((num >= 0) & (num < num_nodes)).all()
    pos = torch.arange(num_nodes)[None, :]
    assert ((acc >= 0) == (pos <= num[:, None])).all()
    assert ((toks != -1) == (pos <= num[:, None])).all()
    emitted = toks.gather(1, num[:, None].long())
    assert ((emitted >= 0) & (emitted < vocab)).all(), "an emitted token outside the vocabulary"
    for b in torch.nonzero(num > 0).flatten().tolist():
        n = int(num[b])
        path = acc[b, : n + 1].long()
        assert (parents[b, path[1:]] == path[:-1]).all(), f"row {b}: path leaves the parent links"
        assert (toks[b, :n] == tree_tokens[b, path[1:]]).all()


def compare(case, min_agreement=MIN_SAMPLED_AGREEMENT):
    out = verify(**case, backend="cuda")
    ref = verify(**case, backend="reference")
    vocab = case["target_logits"].shape[-1]
    check_contract(out, case["tree_tokens"], case["parents"], vocab)
    same = (
        (out.accepted_nodes == ref.accepted_nodes).all(-1)
        & (out.num_accepted == ref.num_accepted)
        & (out.output_tokens == ref.output_tokens).all(-1)
    )
    greedy = case["temperature"] == 0
    assert same[greedy].all(), f"greedy rows differ: {torch.nonzero(greedy & ~same).flatten().tolist()}"
    sampled = ~greedy
    if sampled.sum() >= 20:
        agreement = same[sampled].float().mean().item()
        assert agreement >= min_agreement, f"only {agreement:.3f} of the sampled rows match the reference"
    elif sampled.any():
        assert same[sampled].float().mean().item() >= 0.5
    return out, ref


SHAPES = [
    # batch, T, V, tree kind
    (64, 1, 7, "chain"),
    (64, 2, 2, "chain"),
    (48, 6, 1001, "chain"),
    (32, 16, 32003, "bushy"),
    (16, 64, 4099, "random"),
    (8, 128, 257, "deep"),
    (4, 9, 151937, "chain"),
    (2, 33, 151936, "random"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("with_probs", [False, True], ids=["deterministic", "draft_probs"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"B{b}-T{t}-V{v}-{k}" for b, t, v, k in SHAPES])
def test_matches_reference(gen, shape, with_probs, dtype):
    batch, num_nodes, vocab, kind = shape
    compare(build(gen, batch, num_nodes, vocab, kind, with_probs=with_probs, dtype=dtype))


@pytest.mark.parametrize("with_probs", [False, True], ids=["deterministic", "draft_probs"])
def test_large_batch(gen, with_probs):
    """512 rows: more rows than co-resident groups, so groups loop over rows."""
    compare(build(gen, 512, 8, 5003, "bushy", with_probs=with_probs, dtype=torch.bfloat16))


@pytest.mark.parametrize("with_probs", [False, True], ids=["deterministic", "draft_probs"])
@pytest.mark.parametrize("ties", [False, True], ids=["random", "integer_ties"])
def test_nonfinite_and_ties(gen, with_probs, ties):
    """NaN / +-inf logits, whole dead nodes (all -inf / NaN emit token 0), many exact ties
    (greedy lowest id, top-k/top-p boundary ties kept)."""
    case = build(gen, 64, 12, 3001, "random", with_probs=with_probs, dtype=torch.float32, nonfinite=True, ties=ties)
    compare(case)


def test_all_greedy_exact(gen):
    """A batch of greedy rows only: every row equal to the reference, bf16 ties included."""
    case = build(gen, 128, 17, 20011, "random", with_probs=False, dtype=torch.bfloat16)
    case["temperature"] = torch.zeros_like(case["temperature"])
    out, ref = compare(case)
    for a, b in zip(out, ref):
        assert torch.equal(a, b)


def test_mixed_row_settings_and_strides(gen):
    """Per-row temperature / top-k / top-p, a shared [T] parents, non-contiguous logits rows."""
    batch, num_nodes, vocab = 40, 7, 9001
    base = torch.randn(batch, num_nodes + 3, vocab + 5, generator=gen).cuda()
    logits = base[:, 2 : 2 + num_nodes, 3 : 3 + vocab]  # strided rows, odd offset: misaligned
    parents = torch.tensor([-1, 0, 0, 1, 1, 3, -1]).cuda()
    tokens = distinct_sibling_tokens(gen, parents.cpu().expand(batch, -1).contiguous(), vocab).cuda()
    temperature, top_k, top_p = row_params(gen, batch, vocab)
    kw = dict(temperature=temperature.cuda(), top_k=top_k.cuda(), top_p=top_p.cuda(), seed=1234)
    out = verify(logits, tokens, parents, backend="cuda", **kw)
    ref = verify(logits, tokens, parents, backend="reference", **kw)
    check_contract(out, tokens, parents.expand(batch, -1), vocab)
    same = (out.output_tokens == ref.output_tokens).all(-1) & (out.num_accepted == ref.num_accepted)
    assert same.float().mean().item() >= MIN_SAMPLED_AGREEMENT - 0.05


def test_verify_chain_and_row_independence(gen):
    """verify_chain on CUDA; a row's result does not depend on the batch it sits in (the
    vocabulary split changes with the batch size, the sums are exact so nothing moves)."""
    batch, k, vocab = 24, 5, 30011
    logits = torch.randn(batch, k + 1, vocab, generator=gen).cuda()
    drafts = randint(gen, 0, vocab, (batch, k)).cuda()
    probs = torch.softmax(torch.randn(batch, k, vocab, generator=gen), -1).cuda()
    seed = randint(gen, -(2**62), 2**62, (batch,)).cuda()
    kw = dict(draft_probs=probs, temperature=0.8, top_p=0.9, seed=seed, backend="cuda")
    full = verify_chain(logits, drafts, **kw)
    for b in (0, batch - 1):
        row = {**kw, "seed": seed[b : b + 1], "draft_probs": probs[b : b + 1]}
        one = verify_chain(logits[b : b + 1], drafts[b : b + 1], **row)
        assert torch.equal(one.output_tokens[0], full.output_tokens[b])
        assert torch.equal(one.accepted_nodes[0], full.accepted_nodes[b])


def test_deterministic(gen):
    case = build(gen, 32, 16, 50021, "bushy", with_probs=True, dtype=torch.float16)
    a = verify(**case, backend="cuda")
    b = verify(**case, backend="cuda")
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_cuda_graph_capture(gen):
    """The op captures into a CUDA graph (no host sync, no allocation outside the caching
    allocator) and replays with new inputs written into the captured buffers."""
    case = build(gen, 16, 8, 32003, "random", with_probs=True, dtype=torch.bfloat16)
    static = {k: v.clone() for k, v in case.items()}
    op = torch.ops.specdec.verify.default
    args = lambda c: (  # noqa: E731
        c["target_logits"], c["tree_tokens"], c["parents"], c["draft_probs"],
        c["temperature"], c["top_k"], c["top_p"], c["seed"],
    )
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        op(*args(static))  # warm-up outside the capture (kernel attributes, allocator)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = op(*args(static))
    new = build(gen, 16, 8, 32003, "random", with_probs=True, dtype=torch.bfloat16)
    for k in static:
        static[k].copy_(new[k])
    graph.replay()
    torch.cuda.synchronize()
    eager = op(*args(new))
    for x, y in zip(captured, eager):
        assert torch.equal(x, y)


def test_bad_input_messages():
    logits = torch.randn(2, 3, 11, device="cuda")
    tokens = torch.zeros(2, 3, dtype=torch.int64, device="cuda")
    parents = torch.tensor([[-1, 0, 1]] * 2, device="cuda")
    ones = torch.ones(2, device="cuda")
    k = torch.zeros(2, dtype=torch.int64, device="cuda")
    seed = torch.zeros(2, dtype=torch.int64, device="cuda")
    op = torch.ops.specdec.verify.default
    with pytest.raises(RuntimeError, match="tree_tokens"):
        op(logits, tokens.int(), parents, None, ones, k, ones, seed)
    with pytest.raises(RuntimeError, match="contiguous last"):
        op(logits.transpose(1, 2).contiguous().transpose(1, 2), tokens, parents, None, ones, k, ones, seed)
    with pytest.raises(RuntimeError, match="draft_probs"):
        op(logits, tokens, parents, torch.rand(2, 3, 12, device="cuda"), ones, k, ones, seed)
    with pytest.raises(RuntimeError, match="temperature"):
        op(logits, tokens, parents, None, ones.double(), k, ones, seed)
