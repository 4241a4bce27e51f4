"""The Triton verify kernel against the reference, on the same inputs and the same Philox draws.

On a machine without CUDA the kernel runs in the Triton interpreter in this process, set up
like test_tree_attention_triton.py (conftest.py imports triton with TRITON_INTERPRET=1; this
module imports the kernel module the same way; the `interpreter` fixture sets the variable
only while these tests run). Shapes stay small: the interpreter runs every program in numpy.
Where that is impossible (a CUDA machine, or triton imported first) one test reruns them in a
fresh CPU-only process. On a CUDA machine the GPU tests run bf16 logits at LLM vocabulary sizes.

Tolerance. Greedy rows must match the reference exactly (argmax has no rounding). Sampled rows
read the same uniforms, so they match too unless a decision (an acceptance test u * q < r, a
race between two tokens, a top-p boundary) falls within fp32 rounding of its threshold: the
kernel computes the same quantities with a different summation order, exp/log implementation
and, for SpecInfer residuals, a closed form (p - c q)^+ / Z instead of repeated normalisation.
That happens to about one decision in 10^5-10^6; every test compares at most a few hundred
rows, so we allow max(1, 2%) mismatching sampled rows per call (in practice 0) and check every
row's structural invariants (a real path, emitted ids in range) exactly.
"""

import importlib.util
import os

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels import verify, verify_chain
from specdec_kernels.ops.sampling import target_probs

from conftest import (boundary_tie_case, compare_verify, drafted_tree_case, import_interpreted_kernels, interpreter_fixture,
                      randint, requires_cuda, run_in_fresh_cpu_process)

HAS_TRITON = importlib.util.find_spec("triton") is not None
pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
KERNEL_MODULE = "specdec_kernels.ops.triton.verify"


INTERPRETED = import_interpreted_kernels(KERNEL_MODULE)

interpreter = interpreter_fixture(INTERPRETED)


# ----------------------------------------------------------------------------- inputs and comparison


def make_case(gen, batch, num_nodes, vocab, *, dtype=torch.float32, device="cpu", **kwargs):
    """`drafted_tree_case` (conftest): drafts likely enough that paths go deep, logits and draft
    probs in `dtype` on `device`."""
    logits, tokens, parents, q = drafted_tree_case(gen, batch, num_nodes, vocab, **kwargs)
    q = None if q is None else q.to(device=device, dtype=dtype)
    return logits.to(device=device, dtype=dtype), tokens.to(device), parents.to(device), q


def compare(out, ref, greedy, tokens, parents, vocab, label=""):
    """Greedy rows exactly; sampled rows: at most max(1, 2%) rows differ (see the module docstring)."""
    return compare_verify(out, ref, greedy, tokens, parents, vocab, label, sampled_rows_per_mismatch=50)


def run_both(logits, tokens, parents, **kw):
    out = verify(logits, tokens, parents, backend="triton", **kw)
    ref = verify(logits, tokens, parents, backend="reference", **kw)
    return out, ref


# ----------------------------------------------------------------------------- interpreter (CPU)


@pytest.mark.parametrize("with_probs", (False, True), ids=("deterministic", "draft_probs"))
@pytest.mark.parametrize("kind", ("chain", "star", "random"))
def test_greedy_rows_exact(interpreter, gen, kind, with_probs):
    logits, tokens, parents, q = make_case(gen, 6, 9, 1000, kind=kind, with_probs=with_probs)
    logits[0, 0, :7] = logits[0, 0].max() + 1  # a tie: lowest id wins
    out, ref = run_both(logits, tokens, parents, draft_probs=q, temperature=0.0)
    compare(out, ref, torch.ones(6, dtype=torch.bool), tokens, parents, 1000, "greedy")
    assert torch.equal(out.output_tokens, ref.output_tokens)


@pytest.mark.parametrize("with_probs", (False, True), ids=("deterministic", "draft_probs"))
@pytest.mark.parametrize("kind", ("chain", "bushy", "random"))
def test_sampled_rows_match_reference(interpreter, gen, kind, with_probs):
    logits, tokens, parents, q = make_case(gen, 12, 9, 1000, kind=kind, with_probs=with_probs)
    out, ref = run_both(logits, tokens, parents, draft_probs=q, temperature=1.0, seed=int(randint(gen, 0, 2**62)))
    compared = compare(out, ref, torch.zeros(12, dtype=torch.bool), tokens, parents, 1000, kind)
    assert compared >= 11
    assert int(ref.num_accepted.sum()) > 0  # the paths really went below the root


@pytest.mark.parametrize("with_probs", (False, True), ids=("deterministic", "draft_probs"))
def test_mixed_rows_per_row_warps(interpreter, gen, with_probs):
    """Greedy and sampled rows in one batch, per-row temperature / top-k / top-p, ragged trees."""
    batch = 12
    logits, tokens, parents, q = make_case(gen, batch, 7, 1000, kind="bushy", with_probs=with_probs)
    temperature = torch.tensor([0.0, 1.0, 0.7, 1.3] * 3)
    top_k = torch.tensor([0, 0, 5, 1, 40, 0, 1000, 7, 0, 3, 999, 2])
    top_p = torch.tensor([1.0, 0.9, 1.0, 0.5, 0.8, 1.0, 0.95, 0.3, 1.0, 0.2, 0.99, 1.0])
    seed = randint(gen, -(2**62), 2**62, (batch,))
    out, ref = run_both(logits, tokens, parents, draft_probs=q, temperature=temperature, top_k=top_k, top_p=top_p,
                        seed=seed)
    compare(out, ref, temperature == 0, tokens, parents, 1000, "mixed")
    # a row's result does not depend on its batch
    alone = verify(logits[3:4], tokens[3:4], parents[3:4], draft_probs=None if q is None else q[3:4],
                   temperature=temperature[3:4], top_k=top_k[3:4], top_p=top_p[3:4], seed=seed[3:4], backend="triton")
    assert torch.equal(alone.output_tokens[0], out.output_tokens[3])


def test_top_k_top_p_boundary_ties(interpreter, gen):
    """Tied logits at the top-k boundary and at the top-p boundary are kept, as in the reference."""
    logits, tokens, parents, top_k, top_p = boundary_tie_case()
    for seed in range(6):
        out, ref = run_both(logits, tokens, parents, temperature=1.0, top_k=top_k, top_p=top_p, seed=seed)
        assert torch.equal(out.output_tokens, ref.output_tokens)
        first = out.output_tokens[:, 0]
        assert ((first[:1] >= 10) & (first[:1] < 16)).all()


def test_odd_vocab_sizes(interpreter, gen):
    """V = 32003 (not a multiple of the block) and V = 1: every kept set and sample in range."""
    logits, tokens, parents, q = make_case(gen, 2, 3, 32003, kind="chain", with_probs=True, ragged=False)
    temperature = torch.tensor([0.0, 0.9])
    out, ref = run_both(logits, tokens, parents, draft_probs=q, temperature=temperature, top_k=torch.tensor([0, 100]),
                        top_p=torch.tensor([1.0, 0.9]), seed=5)
    compare(out, ref, temperature == 0, tokens, parents, 32003, "V=32003")
    logits, tokens, parents, _ = make_case(gen, 3, 3, 1, kind="chain", ragged=False)
    tokens = torch.zeros_like(tokens)
    out, ref = run_both(logits, tokens, parents, temperature=torch.tensor([0.0, 1.0, 0.5]), seed=1)
    assert torch.equal(out.output_tokens, ref.output_tokens)


@pytest.mark.parametrize("with_probs", (False, True), ids=("deterministic", "draft_probs"))
def test_non_finite_logits(interpreter, gen, with_probs):
    """NaN is probability 0, +inf tokens share the mass, all -inf/NaN nodes emit token 0."""
    batch, vocab = 8, 500
    logits, tokens, parents, q = make_case(gen, batch, 5, vocab, kind="chain", with_probs=with_probs, ragged=False)
    logits[0, 0] = float("-inf")  # nothing left at the root
    logits[1, 0] = float("nan")
    logits[2, 0, ::3] = float("nan")
    logits[3, 0, 7] = float("inf")
    logits[3, 0, 9] = float("inf")
    logits[4, 0, 5] = float("inf")
    logits[5, :, 100:] = float("-inf")
    logits[6, 0] = float("-inf")
    logits[6, 0, 77] = 0.0
    if q is not None:
        q[7, 0, 3] = float("nan")
        q[7, 0, 4] = float("inf")
    temperature = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.8, 1.0, 1.0])
    for top_k, top_p in ((None, None), (10, 0.9)):
        with sk.config.value_checks(False):  # NaN / inf draft probs on purpose: checked, they raise ValueError
            out, ref = run_both(logits, tokens, parents, draft_probs=q, temperature=temperature, top_k=top_k,
                                top_p=top_p, seed=11)
        compare(out, ref, temperature == 0, tokens, parents, vocab, "non-finite")
        assert out.output_tokens[0, 0] == 0 and out.output_tokens[1, 0] == 0
        assert int(out.output_tokens[3, 0]) in (7, 9) or out.num_accepted[3] > 0
        assert out.output_tokens[6, 0] == 77 or out.num_accepted[6] > 0


def test_residual_with_zero_mass(interpreter, gen):
    """draft probs equal to the target: a child outside the top-k set is rejected and max(r - q, 0)
    sums to zero, so the residual stays the target, and the correction is sampled from it."""
    batch, vocab = 6, 200
    logits = torch.randn(batch, 3, vocab, generator=gen)
    temperature, top_k = torch.ones(batch), torch.full((batch,), 5)
    p = target_probs(logits.reshape(-1, vocab), temperature.repeat_interleave(3), top_k.repeat_interleave(3),
                     torch.ones(batch * 3)).reshape(batch, 3, vocab)
    outside = p[:, 0].argsort(-1)[:, :2]  # two tokens with probability 0
    tokens = torch.cat([torch.zeros(batch, 1, dtype=torch.int64), outside], 1)
    parents = torch.tensor([-1, 0, 0])
    for seed in range(3):
        out, ref = run_both(logits, tokens, parents, draft_probs=p.clone(), temperature=temperature, top_k=top_k,
                            seed=seed)
        assert torch.equal(out.output_tokens, ref.output_tokens)
        assert (out.num_accepted == 0).all()
        assert (p[torch.arange(batch), 0, out.output_tokens[:, 0]] > 0).all()


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=str)
def test_16_bit_logits_and_draft_probs(interpreter, gen, dtype):
    logits, tokens, parents, q = make_case(gen, 8, 6, 1000, kind="random", with_probs=True, dtype=dtype)
    temperature = torch.tensor([0.0, 1.0] * 4)
    out, ref = run_both(logits, tokens, parents, draft_probs=q, temperature=temperature, seed=3)
    compare(out, ref, temperature == 0, tokens, parents, 1000, str(dtype))


def test_verify_chain_and_shared_parents(interpreter, gen):
    """verify_chain (the [T] parents broadcast with stride 0, zero draft probs at the last node)."""
    batch, k, vocab = 6, 4, 700
    logits = torch.randn(batch, k + 1, vocab, generator=gen) * 2
    drafts = randint(gen, 0, vocab, (batch, k))
    for i in range(k):
        logits[torch.arange(batch), i, drafts[:, i]] += 5
    q = torch.softmax(torch.randn(batch, k, vocab, generator=gen), -1)
    temperature = torch.tensor([0.0, 1.0, 0.6, 0.0, 1.0, 1.0])
    for draft_probs in (None, q):
        kw = dict(draft_probs=draft_probs, temperature=temperature, seed=9)
        out = verify_chain(logits, drafts, backend="triton", **kw)
        ref = verify_chain(logits, drafts, backend="reference", **kw)
        tree_tokens = torch.cat([torch.zeros(batch, 1, dtype=torch.int64), drafts], 1)
        compare(out, ref, temperature == 0, tree_tokens, torch.arange(-1, k).expand(batch, -1), vocab, "chain")


def test_ragged_padding_never_accepted(interpreter, gen):
    """Padding nodes (parent -1) hold tokens equal to the argmax: they must never be taken."""
    batch, vocab = 4, 300
    logits, tokens, parents, _ = make_case(gen, batch, 6, vocab, kind="chain", ragged=False)
    parents[:, 3:] = -1
    tokens[:, 3:] = logits[:, 0].argmax(-1, keepdim=True)  # a padding node holding the root's argmax
    out, ref = run_both(logits, tokens, parents, temperature=torch.tensor([0.0, 0.0, 1.0, 1.0]), seed=2)
    compare(out, ref, torch.tensor([True, True, False, False]), tokens, parents, vocab, "padding")
    assert (out.num_accepted <= 2).all()


def test_cpu_needs_interpreter(gen, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    logits, tokens, parents, _ = make_case(gen, 1, 2, 10)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        verify(logits, tokens, parents, backend="triton")


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("with_probs", (False, True), ids=("deterministic", "draft_probs"))
@pytest.mark.parametrize("batch, num_nodes, vocab, kind", [(3, 5, 152064, "chain"), (16, 16, 32000, "random"),
                                                           (64, 9, 128256, "chain"), (5, 64, 32003, "bushy")])
def test_gpu_matches_reference(gen, batch, num_nodes, vocab, kind, with_probs):
    logits, tokens, parents, q = make_case(gen, batch, num_nodes, vocab, kind=kind, with_probs=with_probs,
                                           dtype=torch.bfloat16, device="cuda")
    temperature = torch.tensor([0.0, 1.0, 0.7] * batch)[:batch].cuda()
    top_k = torch.tensor([0, 0, 50, 0] * batch)[:batch].cuda()
    top_p = torch.tensor([1.0, 0.9, 1.0, 1.0, 0.95] * batch)[:batch].cuda()
    out, ref = run_both(logits, tokens, parents, draft_probs=q, temperature=temperature, top_k=top_k, top_p=top_p,
                        seed=7)
    compare(out, ref, temperature == 0, tokens, parents, vocab, "gpu")


@pytest.mark.gpu
@requires_cuda
def test_gpu_cuda_graph_capture(gen):
    import specdec_kernels as sk

    logits, tokens, parents, q = make_case(gen, 4, 9, 32000, kind="chain", with_probs=True, dtype=torch.bfloat16,
                                           device="cuda")
    seed = torch.arange(4, dtype=torch.int64, device="cuda")
    kw = dict(draft_probs=q, temperature=torch.tensor([0.0, 1.0, 1.0, 0.5], device="cuda"), seed=seed)
    graph = torch.cuda.CUDAGraph()
    old = sk.config.check_values
    sk.config.check_values = False  # the value checks sync with the host
    try:
        verify(logits, tokens, parents, backend="triton", **kw)  # compile outside the capture
        with torch.cuda.graph(graph):
            captured = verify(logits, tokens, parents, backend="triton", **kw)
    finally:
        sk.config.check_values = old
    seed.add_(100)
    graph.replay()
    ref = verify(logits, tokens, parents, backend="reference", **kw)
    assert torch.equal(captured.output_tokens, ref.output_tokens)


@pytest.mark.gpu
@requires_cuda
def test_gpu_capture_first_with_scalar_settings(gen):
    """Sampling settings as Python scalars and an int seed, captured into a CUDA graph before
    any eager call at this batch size: the per-row defaults made during capture are not cached
    (they are filled only at replay), so a later eager call reads real values, and the int
    seed is made by a fill, which capture records."""
    import specdec_kernels as sk

    logits, tokens, parents, q = make_case(gen, 4, 9, 32000, kind="chain", with_probs=True, dtype=torch.bfloat16,
                                           device="cuda")
    other = make_case(gen, 2, 9, 32000, kind="chain", with_probs=True, dtype=torch.bfloat16, device="cuda")
    kw = dict(temperature=0.7, top_k=50, top_p=0.9, seed=1234)
    graph = torch.cuda.CUDAGraph()
    old = sk.config.check_values
    sk.config.check_values = False  # the value checks sync with the host
    try:
        verify(other[0], other[1], other[2], draft_probs=other[3], backend="triton", **kw)  # compile, another batch size
        with torch.cuda.graph(graph):
            captured = verify(logits, tokens, parents, draft_probs=q, backend="triton", **kw)
    finally:
        sk.config.check_values = old
    graph.replay()
    eager = verify(logits, tokens, parents, draft_probs=q, backend="triton", **kw)
    ref = verify(logits, tokens, parents, draft_probs=q, backend="reference", **kw)
    assert torch.equal(captured.output_tokens, ref.output_tokens)
    assert torch.equal(eager.output_tokens, ref.output_tokens)


@pytest.mark.skipif(INTERPRETED is not None or os.environ.get("SPECDEC_TRITON_CHILD") == "1",
                    reason="the interpreter tests ran in this process")
def test_interpreter_tests_in_a_fresh_process():
    """Where they could not run here (a GPU, or triton imported first), run them in a fresh CPU-only process."""
    run_in_fresh_cpu_process(__file__, "-m", "not gpu")
