"""The compiled CPU verify kernel (csrc/verify.cpp, include/specdec/verify.h) against the reference.

Both read the same Philox uniforms and follow the same rules operation by operation, so they
return the same rows. Greedy rows must match exactly (argmax has no rounding). Sampled rows
may differ only where the reference's torch kernels round differently from the C++ code: the
softmax and residual sums (torch sums fp32 SIMD lanes, the kernel sums in fp64) and exp / log
(Sleef vs libm) can move p, r or E by an ulp, which flips a decision only when it sits within
an ulp of its threshold (two race ratios tying to ~1e-7, u * q(x) within an ulp of r(x), a
top-p boundary). Also, the reference renormalises every row of a batch after top-p when any
row uses it (dividing by a sum that is 1 up to rounding), the kernel only rows with top_p < 1.
Measured on 1.5 x 10^5 random sampled rows (V < 4000, trees of 8 nodes, a third of the rows
with top-k / top-p, half with draft probabilities): no mismatch; the tests allow one mismatching sampled row
per call so a once-in-a-million near tie cannot make them flaky, and check every row's
structural invariants exactly.
"""

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels import verify, verify_chain

from conftest import boundary_tie_case, compare_verify, drafted_tree_case, randint

pytestmark = pytest.mark.skipif(
    "cpu" not in sk.available_backends("verify", "cpu"), reason="specdec_kernels._C has no CPU verify kernel"
)

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DTYPE_IDS = ("fp32", "bf16", "fp16")


def make_case(gen, batch, num_nodes, vocab, *, dtype=torch.float32, probs_dtype=None, **kwargs):
    """`drafted_tree_case` (conftest) with NaN logits on padding nodes, sampled drafts from the
    first 50 ids, logits in `dtype` and draft probs in `probs_dtype` (default `dtype`)."""
    logits, tokens, parents, q = drafted_tree_case(gen, batch, num_nodes, vocab, sampled_token_range=min(vocab, 50),
                                                   nan_padding=True, **kwargs)
    return logits.to(dtype), tokens, parents, None if q is None else q.to(probs_dtype or dtype)


def run_both(logits, tokens, parents, **kw):
    return verify(logits, tokens, parents, backend="cpu", **kw), verify(logits, tokens, parents, backend="reference", **kw)


def compare(out, ref, greedy, tokens, parents, vocab, label=""):
    """Greedy rows exactly; at most one sampled row may differ (see the module docstring).
    Returns the number of sampled rows that matched."""
    return compare_verify(out, ref, greedy, tokens, parents, vocab, label)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("with_probs", (False, True), ids=("deterministic", "draft_probs"))
@pytest.mark.parametrize("kind", ("chain", "star", "bushy", "random"))
def test_greedy_rows_exact(gen, kind, with_probs, dtype):
    batch, vocab = 8, 1001
    logits, tokens, parents, q = make_case(gen, batch, 9, vocab, kind=kind, with_probs=with_probs, dtype=dtype)
    logits[0, 0, :7] = logits[0, 0].float().max() + 1  # a tie: the lowest id wins
    out, ref = run_both(logits, tokens, parents, draft_probs=q, temperature=0.0)
    compare(out, ref, torch.ones(batch, dtype=torch.bool), tokens, parents, vocab, "greedy")
    assert torch.equal(out.output_tokens, ref.output_tokens)
    assert int(ref.num_accepted.sum()) > 0  # the paths really went below the root


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("with_probs", (False, True), ids=("deterministic", "draft_probs"))
@pytest.mark.parametrize("kind", ("chain", "bushy", "random"))
def test_sampled_rows_match_reference(gen, kind, with_probs, dtype):
    # (distinct siblings need as many tokens as a node has children: up to 10 of 11 nodes)
    batch, vocab = 16, int(randint(gen, 2 if with_probs else 11, 3000))
    logits, tokens, parents, q = make_case(gen, batch, 11, vocab, kind=kind, with_probs=with_probs, dtype=dtype)
    temperature = torch.rand(batch, generator=gen) + 0.3
    out, ref = run_both(logits, tokens, parents, draft_probs=q, temperature=temperature,
                        seed=int(randint(gen, 0, 2**62)))
    assert compare(out, ref, torch.zeros(batch, dtype=torch.bool), tokens, parents, vocab, kind) >= batch - 1
    assert int(ref.num_accepted.sum()) > 0


@pytest.mark.parametrize("batch", (1, 64))
@pytest.mark.parametrize("with_probs", (False, True), ids=("deterministic", "draft_probs"))
def test_mixed_rows_per_row_warps(gen, batch, with_probs):
    """Greedy and sampled rows in one batch, per-row temperature / top-k / top-p, ragged trees,
    threads over rows; a row's result does not depend on its batch."""
    vocab = 777
    logits, tokens, parents, q = make_case(gen, batch, 7, vocab, kind="bushy", with_probs=with_probs)
    temperature = torch.where(torch.rand(batch, generator=gen) < 0.3, 0.0, torch.rand(batch, generator=gen) + 0.2)
    top_k = torch.where(torch.rand(batch, generator=gen) < 0.5, randint(gen, 0, vocab + 2, (batch,)), 0)
    top_p = torch.where(torch.rand(batch, generator=gen) < 0.5, torch.rand(batch, generator=gen) * 0.9 + 0.1, 1.0)
    seed = randint(gen, -(2**62), 2**62, (batch,))
    kw = dict(draft_probs=q, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    out, ref = run_both(logits, tokens, parents, **kw)
    compare(out, ref, temperature == 0, tokens, parents, vocab, "mixed")
    b = batch - 1
    alone = verify(logits[b:], tokens[b:], parents[b:], draft_probs=None if q is None else q[b:],
                   temperature=temperature[b:], top_k=top_k[b:], top_p=top_p[b:], seed=seed[b:], backend="cpu")
    assert torch.equal(alone.output_tokens[0], out.output_tokens[b])


@pytest.mark.parametrize("with_probs", (False, True), ids=("deterministic", "draft_probs"))
def test_llm_vocab_bf16(gen, with_probs):
    """V = 49152 (SmolLM) and an odd V = 32003, bf16 logits, top-k / top-p rows, chains of 10."""
    for vocab in (49152, 32003):
        logits, tokens, parents, q = make_case(gen, 4, 11, vocab, kind="chain", with_probs=with_probs,
                                               dtype=torch.bfloat16, ragged=False, scale=3.0)
        temperature = torch.tensor([0.0, 0.7, 1.0, 0.9])
        top_k = torch.tensor([0, 0, 50, 1000])
        top_p = torch.tensor([1.0, 1.0, 0.9, 0.8])
        out, ref = run_both(logits, tokens, parents, draft_probs=q, temperature=temperature, top_k=top_k,
                            top_p=top_p, seed=int(randint(gen, 0, 2**62)))
        compare(out, ref, temperature == 0, tokens, parents, vocab, f"V={vocab}")


def test_draft_probs_dtype_differs_from_logits(gen):
    logits, tokens, parents, q = make_case(gen, 8, 6, 500, kind="random", with_probs=True, dtype=torch.float32,
                                           probs_dtype=torch.bfloat16)
    out, ref = run_both(logits, tokens, parents, draft_probs=q, temperature=0.8, seed=3)
    compare(out, ref, torch.zeros(8, dtype=torch.bool), tokens, parents, 500, "bf16 q")
    out, ref = run_both(logits.half(), tokens, parents, draft_probs=q.float(), temperature=0.8, seed=3)
    compare(out, ref, torch.zeros(8, dtype=torch.bool), tokens, parents, 500, "fp16 logits")


@pytest.mark.parametrize("num_drafts", (1, 5))
@pytest.mark.parametrize("with_probs", (False, True), ids=("deterministic", "draft_probs"))
def test_verify_chain(gen, num_drafts, with_probs):
    batch, vocab = 6, 300
    logits, tokens, parents, q = make_case(gen, batch, num_drafts + 1, vocab, kind="chain", with_probs=with_probs,
                                           ragged=False)
    draft_probs = None if q is None else q[:, :-1]
    kw = dict(draft_probs=draft_probs, temperature=torch.tensor([0.0, 1.0] * 3), seed=11)
    out = verify_chain(logits, tokens[:, 1:], backend="cpu", **kw)
    ref = verify_chain(logits, tokens[:, 1:], backend="reference", **kw)
    compare(out, ref, kw["temperature"] == 0, tokens, parents, vocab, "chain")


def test_top_k_top_p_boundary_ties():
    """Tied logits at the top-k and top-p boundaries are kept, as in the reference."""
    logits, tokens, parents, top_k, top_p = boundary_tie_case()
    for seed in range(20):
        out, ref = run_both(logits, tokens, parents, temperature=1.0, top_k=top_k, top_p=top_p, seed=seed)
        assert torch.equal(out.output_tokens, ref.output_tokens)
        assert 10 <= int(out.output_tokens[0, 0]) < 16


def test_odd_and_tiny_vocab(gen):
    logits, tokens, parents, q = make_case(gen, 3, 4, 1, kind="chain", ragged=False)
    tokens = torch.zeros_like(tokens)
    out, ref = run_both(logits, tokens, parents, temperature=torch.tensor([0.0, 1.0, 0.5]), seed=1)
    assert torch.equal(out.output_tokens, ref.output_tokens) and (out.num_accepted == 3).all()
    logits, tokens, parents, q = make_case(gen, 3, 4, 3, kind="random", with_probs=True)
    out, ref = run_both(logits, tokens, parents, draft_probs=q, temperature=torch.tensor([0.0, 1.0, 0.5]), seed=2)
    compare(out, ref, torch.tensor([True, False, False]), tokens, parents, 3, "V=3")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("with_probs", (False, True), ids=("deterministic", "draft_probs"))
def test_non_finite_logits(gen, dtype, with_probs):
    """NaN is probability 0, +inf tokens share the mass, all -inf/NaN nodes emit token 0;
    NaN / inf / negative draft probabilities are read as the reference reads them."""
    batch, vocab = 8, 500
    logits, tokens, parents, q = make_case(gen, batch, 5, vocab, kind="chain", with_probs=with_probs, ragged=False,
                                           dtype=dtype)
    logits[0, 0] = float("-inf")  # nothing left at the root
    logits[1, 0] = float("nan")
    logits[2, 0, ::3] = float("nan")
    logits[3, 0, 7] = float("inf")
    logits[3, 0, 9] = float("inf")
    logits[4, 1, :] = float("-inf")
    logits[4, 1, 3] = float("nan")
    if q is not None:
        q[5, 0, ::5] = float("nan")
        q[6, 0, ::7] = float("inf")
        q[7, 0, ::2] = -0.5
    for temperature in (0.0, 1.0):
        greedy = torch.full((batch,), temperature == 0.0)
        with sk.config.value_checks(False):  # bad draft probs on purpose: checked, they raise ValueError
            out, ref = run_both(logits, tokens, parents, draft_probs=q, temperature=temperature, seed=7)
        compare(out, ref, greedy, tokens, parents, vocab, f"T={temperature}")
        assert out.output_tokens[0, 0] == 0 and out.output_tokens[1, 0] == 0
        assert int(out.output_tokens[3, 0]) in (7, 9) or out.num_accepted[3] > 0


def test_tiny_temperature_and_unnormalised_draft_probs(gen):
    logits, tokens, parents, q = make_case(gen, 6, 6, 400, kind="random", with_probs=True)
    with sk.config.value_checks(False):  # unnormalised on purpose: checked, they raise ValueError
        out, ref = run_both(logits, tokens, parents, draft_probs=q * 3.0, temperature=1e-30, seed=4)
    compare(out, ref, torch.zeros(6, dtype=torch.bool), tokens, parents, 400, "tiny T")


def test_op_checks_name_the_argument():
    """Direct calls of torch.ops.specdec.verify get metadata checks (the Python API validates more)."""
    op = torch.ops.specdec.verify.default
    B, T, V = 2, 3, 10
    args = dict(
        target_logits=torch.randn(B, T, V), tree_tokens=torch.zeros(B, T, dtype=torch.int64),
        parents=torch.tensor([[-1, 0, 1]] * B), draft_probs=None, temperature=torch.ones(B),
        top_k=torch.zeros(B, dtype=torch.int64), top_p=torch.ones(B), seed=torch.zeros(B, dtype=torch.int64),
    )
    op(*args.values())  # good inputs pass
    for name, bad in (("target_logits", torch.randn(B, T, V).double()), ("tree_tokens", torch.zeros(B, T).int()),
                      ("parents", torch.zeros(B, T + 1, dtype=torch.int64)), ("temperature", torch.ones(B + 1)),
                      ("draft_probs", torch.rand(B, T, V + 1)), ("seed", torch.zeros(B))):
        with pytest.raises(RuntimeError, match=name):
            op(*dict(args, **{name: bad}).values())


def test_opcheck():
    B, T, V = 2, 4, 50
    logits = torch.randn(B, T, V)
    args = (logits, torch.zeros(B, T, dtype=torch.int64), torch.tensor([[-1, 0, 0, 1]] * B),
            torch.softmax(torch.randn(B, T, V), -1), torch.tensor([0.0, 0.8]), torch.zeros(B, dtype=torch.int64),
            torch.ones(B), torch.tensor([1, 2]))
    torch.library.opcheck(torch.ops.specdec.verify.default, args)


def test_strided_inputs(gen):
    """Views with gaps between rows / nodes (and a non-contiguous last dim) read correctly."""
    logits, tokens, parents, q = make_case(gen, 6, 5, 300, kind="random", with_probs=True)
    wide = torch.randn(6, 10, 320, generator=gen)
    wide[:, ::2, :300] = logits
    logits_view = wide[:, ::2, :300]
    q_view = q.transpose(1, 2).contiguous().transpose(1, 2)  # last dim not contiguous: copied
    temperature = torch.tensor([0.0, 1.0, 0.5, 0.0, 2.0, 0.9])
    out, ref = run_both(logits_view, tokens, parents, draft_probs=q_view, temperature=temperature, seed=9)
    compare(out, ref, temperature == 0, tokens, parents, 300, "strided")
    same = verify(logits.contiguous(), tokens, parents, draft_probs=q, temperature=temperature, seed=9, backend="cpu")
    assert torch.equal(out.output_tokens, same.output_tokens)


def test_top_p_kept_sets_of_every_size(gen):
    """The kernel sorts only the largest probabilities, growing that prefix (256, 2048, 16384,
    all) until it passes the top-p boundary. Kept sets from a handful of tokens to most of a
    49152-token vocabulary, with ties at the top, must sample exactly as the reference's full sort."""
    from specdec_kernels.ops.sampling import target_probs

    batch, vocab = 64, 49152
    scale = torch.logspace(0.7, -1.3, batch)  # peaked rows (few tokens kept) to flat rows (most kept)
    logits = torch.randn(batch, 1, vocab, generator=gen) * scale[:, None, None]
    logits[::8, 0, :300] = logits[::8, 0].max(-1, keepdim=True).values  # 300 tied top tokens
    top_p = torch.tensor([0.5, 0.9, 0.95, 0.99] * (batch // 4))
    temperature = torch.ones(batch)
    tokens = randint(gen, 0, vocab, (batch, 1))
    parents = torch.full((batch, 1), -1, dtype=torch.int64)
    kept = (target_probs(logits[:, 0], temperature, torch.zeros(batch, dtype=torch.int64), top_p) > 0).sum(-1)
    assert int(kept.min()) < 256 and int(kept.max()) > 16384  # every prefix size is exercised
    assert int(((kept > 256) & (kept <= 2048)).sum()) > 0 and int(((kept > 2048) & (kept <= 16384)).sum()) > 0
    for seed in range(4):
        out, ref = run_both(logits, tokens, parents, temperature=temperature, top_p=top_p, seed=seed)
        compare(out, ref, torch.zeros(batch, dtype=torch.bool), tokens, parents, vocab, f"top-p seed {seed}")
