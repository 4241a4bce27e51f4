"""Chi-square tests: `verify` emits tokens distributed exactly like sequential sampling.

The target is a Markov model with a small vocabulary: the root's logits are `ROOT_LOGITS`, and
a drafted node holding token t has logits `TRANS_LOGITS[t]`, so a node's logits depend only on
its token path. Sequential sampling from the warped target (temperature, top-k, top-p) thus
emits x1 ~ warp(ROOT_LOGITS), then x2 ~ warp(TRANS_LOGITS[x1]), ... Whatever the drafts, the
first emitted token follows warp(ROOT_LOGITS); given that the k-th emitted token a was an
accepted draft (k <= num_accepted), the (k+1)-th follows warp(TRANS_LOGITS[a]). Each test runs
tens of thousands of independent rows in one call and checks these distributions with
chi-square tests. Everything uses fixed seeds (no flakes) and a family-wise threshold of 1e-4
with a Bonferroni correction over all the tests of this file; real bugs give p-values far
below it.

Drafts are sampled here with torch.multinomial from draft distributions deliberately different
from the target: i.i.d. siblings (repeats allowed) when draft_probs are passed, distinct
siblings (sampled without replacement, from a draft/target mix) for deterministic drafts. Some rows are ragged
(trailing padding nodes holding valid tokens and garbage logits), so an accepted padding node
would show up too.

Backends: every test runs for `reference` and, when the extension has the compiled CPU
kernel, for "cpu" on the same rows; on a CUDA machine also for "triton" (when
triton imports) and "cuda" (when the extension has a CUDA verify kernel), on the same rows
moved to the GPU. Without a GPU the Triton kernel runs only in the interpreter at ~50 ms per
row, far too slow for 30k-row chi-square tests; there it gets one reduced case
(test_triton_interpreted_subset: 150 rows of the star, first token only, a coarse check), and
its exactness rests on test_verify_triton.py, which shows it returns the reference's tokens row
for row on identical Philox draws.
"""

import importlib.util
import math
import os

import numpy as np
import pytest
import scipy.stats
import torch

import specdec_kernels as sk
from specdec_kernels import verify

from conftest import HAS_CUDA
from test_verify import bf_argmax, bf_warp


def _stat_backends():
    """(backend, device) pairs the chi-square tests run for (see the module docstring)."""
    found = [("reference", "cpu")]
    if "cpu" in sk.available_backends("verify", "cpu"):
        found.append(("cpu", "cpu"))
    if HAS_CUDA:
        if importlib.util.find_spec("triton") is not None:
            found.append(("triton", "cuda"))
        if "cuda" in sk.available_backends("verify", "cuda"):
            found.append(("cuda", "cuda"))
    return found


STAT_BACKENDS = _stat_backends()

V = 8
_g = torch.Generator().manual_seed(20240611)
ROOT_LOGITS = torch.randn(V, generator=_g) * 1.3
TRANS_LOGITS = torch.randn(V, V, generator=_g) * 1.3
DRAFT_ROOT = torch.softmax(torch.randn(V, generator=_g) * 1.3, -1)
DRAFT_TRANS = torch.softmax(torch.randn(V, V, generator=_g) * 1.3, -1)
# Greedy ties: at the root, tokens 2 and 6 share the maximum (greedy must pick 2); in each
# transition row, the two largest logits are made equal.
ROOT_LOGITS[2] = ROOT_LOGITS[6] = ROOT_LOGITS.max() + 0.5
_top2 = TRANS_LOGITS.topk(2, dim=-1).indices
TRANS_LOGITS.scatter_(1, _top2, TRANS_LOGITS.gather(1, _top2[:, :1]).expand(V, 2).clone())
# Drafts propose the tied tokens often, so greedy ties are decided inside the tree.
DRAFT_ROOT = 0.5 * DRAFT_ROOT + 0.25 * torch.nn.functional.one_hot(torch.tensor([2, 6]), V).float().sum(0)

# Tree shapes (parents of the full row) and the trailing nodes dropped in ragged rows.
SHAPES = {
    # root -> 1 -> 2 -> 3, plus one padding node
    "chain": ([-1, 0, 1, 2, -1], [3]),
    # root -> 1, 2, 3; 1 -> 4, 5; 2 -> 6, 7; 3 -> 8, 9; plus one padding node
    "tree": ([-1, 0, 0, 0, 1, 1, 2, 2, 3, 3, -1], [8, 9]),
    # root -> 6 children (many rejections in a row at one node), plus one padding node
    "star": ([-1, 0, 0, 0, 0, 0, 0, -1], [5, 6]),
}
WARPS = {
    "temp1.0": dict(temperature=1.0),
    "temp0.7": dict(temperature=0.7),
    "topk3": dict(temperature=1.0, top_k=3),
    "topp0.8": dict(temperature=1.0, top_p=0.8),
}
NUM_ROWS = 30000
# (shape, draft probs given, warp, rows): chain and tree x drafts x warps, plus stars of
# i.i.d. siblings (cheap: two steps), where sibling-level mistakes matter most.
CASES = [(shape, with_probs, warp_id, NUM_ROWS) for shape in ("chain", "tree") for with_probs in (True, False) for warp_id in WARPS]
CASES += [("star", True, "temp1.0", 40000), ("star", True, "topp0.8", 40000)]
# parametrized cases of this file (every backend, plus the interpreter subset), for the Bonferroni correction
NUM_STAT_TESTS = (len(CASES) + 2) * len(STAT_BACKENDS) + 1
FAMILY_ALPHA = 1e-4


def build_rows(shape, with_probs, num_rows, gen):
    """Target logits, tree tokens, parents and draft probs for num_rows independent rows."""
    structure, droppable = SHAPES[shape]
    num_nodes = len(structure)
    parents = torch.tensor(structure).expand(num_rows, num_nodes).clone()
    ragged = torch.rand(num_rows, generator=gen) < 0.25
    for i in droppable:
        parents[ragged, i] = -1
    tokens = torch.full((num_rows, num_nodes), -1, dtype=torch.int64)
    tokens[:, 0] = torch.randint(0, V, (num_rows,), generator=gen)
    # Deterministic drafters propose likely tokens (n-gram, top-k of a draft model): there the
    # proposals come from a mix of the draft and the target, so that deeper nodes are reached.
    root_dist = DRAFT_ROOT if with_probs else 0.5 * DRAFT_ROOT + 0.5 * torch.softmax(ROOT_LOGITS, -1)
    trans_dist = DRAFT_TRANS if with_probs else 0.5 * DRAFT_TRANS + 0.5 * torch.softmax(TRANS_LOGITS, -1)
    draft_dist = torch.zeros(num_rows, num_nodes, V)
    draft_dist[:, 0] = root_dist
    # Children of each node, in index order (padding included: they get tokens too).
    children = {}
    for i, p in enumerate(structure[1:], start=1):
        children.setdefault(p, []).append(i)
    for p in range(num_nodes):
        kids = [i for i in children.get(p, [])]
        if not kids:
            continue
        if with_probs:  # siblings i.i.d. from the parent's draft distribution
            drawn = torch.multinomial(draft_dist[:, p], len(kids), replacement=True, generator=gen)
        else:  # deterministic drafts: distinct siblings
            drawn = torch.multinomial(draft_dist[:, p], len(kids), replacement=False, generator=gen)
        for col, i in enumerate(kids):
            tokens[:, i] = drawn[:, col]
            draft_dist[:, i] = trans_dist[drawn[:, col]]
    # Padding nodes (structure -1 beyond the root): a valid token, garbage logits.
    pad_cols = [i for i in range(1, num_nodes) if structure[i] == -1]
    for i in pad_cols:
        tokens[:, i] = torch.randint(0, V, (num_rows,), generator=gen)
    logits = TRANS_LOGITS[tokens.clamp(min=0)]
    logits[:, 0] = ROOT_LOGITS
    garbage = torch.randn(num_rows, num_nodes, V, generator=gen) * 4
    logits = torch.where((parents == -1).unsqueeze(-1) & (torch.arange(num_nodes) > 0)[None, :, None], garbage, logits)
    return logits, tokens, parents, (draft_dist if with_probs else None)


def check_paths(out, tokens, parents):
    """Vectorised output invariants: root first, real nodes, parent links, emitted drafts."""
    num_rows, num_nodes = tokens.shape
    rows = torch.arange(num_rows)
    acc = out.accepted_nodes.long()
    num = out.num_accepted.long()
    assert (acc[:, 0] == 0).all()
    for d in range(1, num_nodes):
        live = num >= d
        assert (acc[~live, d] == -1).all()
        node = acc[live, d]
        assert (node > 0).all()
        assert (parents[rows[live], node] == acc[live, d - 1]).all(), "path leaves the parent links (padding accepted?)"
        assert (out.output_tokens[live, d - 1] == tokens[rows[live], node]).all()
    emitted = out.output_tokens[rows, num]
    assert ((emitted >= 0) & (emitted < V)).all()
    assert ((out.output_tokens >= 0).sum(1) == num + 1).all()


def chi_square_p(samples, probs, label):
    """p-value of a chi-square goodness-of-fit test of samples (token ids) against probs."""
    counts = np.bincount(samples.numpy(), minlength=V).astype(float)
    probs = np.asarray(probs, dtype=float)
    outside = counts[probs == 0].sum()
    assert outside == 0, f"{label}: {int(outside)} samples of zero-probability tokens"
    n = counts.sum()
    expected = probs * n
    # merge the bins expected to be small into one
    small = (expected < 5) & (probs > 0)
    big = expected >= 5
    obs = list(counts[big]) + ([counts[small].sum()] if small.any() else [])
    exp = list(expected[big]) + ([expected[small].sum()] if small.any() else [])
    if len(obs) < 2:
        return 1.0
    exp = np.array(exp) * (sum(obs) / sum(exp))
    return float(scipy.stats.chisquare(obs, exp).pvalue)


def warped(logits, warp):
    return bf_warp(logits.tolist(), warp.get("temperature", 1.0), warp.get("top_k", 0), warp.get("top_p", 1.0), check=False)[0]


def emitted_distribution_pvalues(out, warp, rows=None, min_count=400):
    """(label, p-value) for the first token and each (position k, previous token a) group."""
    tokens_out = out.output_tokens if rows is None else out.output_tokens[rows]
    num = out.num_accepted.long() if rows is None else out.num_accepted.long()[rows]
    results = [("first token", chi_square_p(tokens_out[:, 0], warped(ROOT_LOGITS, warp), "first token"))]
    trans = [warped(TRANS_LOGITS[a], warp) for a in range(V)]
    for k in range(1, tokens_out.shape[1]):
        live = num >= k
        if int(live.sum()) < min_count:
            break
        prev, nxt = tokens_out[live, k - 1], tokens_out[live, k]
        for a in range(V):
            group = prev == a
            if int(group.sum()) >= min_count:
                label = f"token {k + 1} after {a}"
                results.append((label, chi_square_p(nxt[group], trans[a], label)))
    return results


def assert_pvalues(results, num_tests_here):
    threshold = FAMILY_ALPHA / (NUM_STAT_TESTS * num_tests_here)
    bad = [(label, p) for label, p in results if not p > threshold]
    assert not bad, f"chi-square below {threshold:.1e}: {bad}"


def _case_id(case):
    shape, with_probs, warp_id, num_rows = case
    return f"{shape}-{'draft_probs' if with_probs else 'deterministic'}-{warp_id}-{num_rows // 1000}k"


def run_verify(backend, device, logits, tokens, parents, draft_probs, **kwargs):
    """verify on `device` with `backend`; outputs back on the CPU."""
    move = lambda x: x if x is None or not isinstance(x, torch.Tensor) else x.to(device)  # noqa: E731
    kwargs = {k: move(v) for k, v in kwargs.items()}
    out = verify(move(logits), move(tokens), move(parents), draft_probs=move(draft_probs), backend=backend, **kwargs)
    return type(out)(*(t.cpu() for t in out))


BACKEND_IDS = [b for b, _ in STAT_BACKENDS]


@pytest.mark.parametrize("backend,device", STAT_BACKENDS, ids=BACKEND_IDS)
@pytest.mark.parametrize("shape,with_probs,warp_id,num_rows", CASES, ids=[_case_id(c) for c in CASES])
def test_emitted_tokens_follow_target(shape, with_probs, warp_id, num_rows, backend, device):
    warp = WARPS[warp_id]
    case = f"{shape}-{with_probs}-{warp_id}"
    gen = torch.Generator().manual_seed(sum(map(ord, case)))
    logits, tokens, parents, draft_probs = build_rows(shape, with_probs, num_rows, gen)
    out = run_verify(backend, device, logits, tokens, parents, draft_probs, seed=1000 + sum(map(ord, case)), **warp)
    check_paths(out, tokens, parents)
    results = emitted_distribution_pvalues(out, warp)
    # the first token and at least two conditional groups were tested (deterministic chains
    # stop early: a single child is accepted with probability ~0.3)
    assert len(results) >= 3, results
    assert_pvalues(results, num_tests_here=24)  # at most ~20 chi-square tests per case


@pytest.mark.parametrize("backend,device", STAT_BACKENDS, ids=BACKEND_IDS)
@pytest.mark.parametrize("with_probs", [True, False], ids=["draft_probs", "deterministic"])
def test_greedy_rows_mixed_with_sampled_rows(with_probs, backend, device):
    """Even rows greedy (exactly the argmax chain, lowest id on ties), odd rows sampled."""
    gen = torch.Generator().manual_seed(77 + with_probs)
    num_rows = NUM_ROWS
    logits, tokens, parents, draft_probs = build_rows("tree", with_probs, num_rows, gen)
    greedy = torch.arange(num_rows) % 2 == 0
    temperature = torch.where(greedy, 0.0, 0.9)
    top_k = torch.where(greedy, 1, 0)  # top-k/top-p must not change greedy rows
    top_p = torch.where(greedy, 0.3, 1.0)
    out = run_verify(backend, device, logits, tokens, parents, draft_probs, temperature=temperature, top_k=top_k,
                     top_p=top_p, seed=31337)
    check_paths(out, tokens, parents)

    # Greedy rows: walk the argmax chain through the tree (first child holding it).
    num_nodes = tokens.shape[1]
    best_root = bf_argmax(ROOT_LOGITS.tolist())
    best_next = [bf_argmax(TRANS_LOGITS[a].tolist()) for a in range(V)]
    assert best_root == 2  # tie between 2 and 6 at the root
    rows = torch.nonzero(greedy).flatten()
    cur = torch.zeros(len(rows), dtype=torch.int64)
    want = torch.full((len(rows),), best_root)
    done = torch.zeros(len(rows), dtype=torch.bool)
    expected_out = torch.full((len(rows), num_nodes), -1, dtype=torch.int64)
    expected_num = torch.zeros(len(rows), dtype=torch.int64)
    p_rows, t_rows = parents[rows], tokens[rows]
    ties_decided = 0
    for depth in range(num_nodes):
        expected_out[~done, depth] = want[~done]
        is_match = (p_rows == cur[:, None]) & (t_rows == want[:, None]) & (torch.arange(num_nodes) > 0)
        holds_6 = (p_rows == cur[:, None]) & (t_rows == 6)
        if depth == 0:
            ties_decided = int((is_match.any(1) & holds_6.any(1)).sum())
        found = is_match.any(1) & ~done
        nxt = is_match.int().argmax(1)
        expected_num += found.long()
        cur = torch.where(found, nxt, cur)
        want = torch.where(found, torch.tensor(best_next)[t_rows[torch.arange(len(rows)), nxt]], want)
        done |= ~found
        if done.all():
            break
    assert ties_decided > 100  # many greedy rows hold both tied tokens below the root
    assert torch.equal(out.num_accepted[rows].long(), expected_num)
    assert torch.equal(out.output_tokens[rows], expected_out)

    # Sampled rows: chi-square.
    sampled = torch.nonzero(~greedy).flatten()
    results = emitted_distribution_pvalues(out, dict(temperature=0.9), rows=sampled)
    assert len(results) >= 4, results
    assert_pvalues(results, num_tests_here=24)


def test_triton_interpreted_subset():
    """Reduced case for the Triton kernel in the interpreter (see the module docstring): 150 rows
    of the star with i.i.d. siblings, the first emitted token against the target. Coarse (it
    catches a wrong residual or race, not small biases); the full suite runs it on a GPU."""
    from test_verify_triton import INTERPRETED

    if INTERPRETED is None:
        pytest.skip("the Triton interpreter is not available in this process (GPU runs use the full suite)")
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        gen = torch.Generator().manual_seed(4242)
        logits, tokens, parents, draft_probs = build_rows("star", True, 150, gen)
        out = verify(logits, tokens, parents, draft_probs=draft_probs, seed=4243, backend="triton")
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old
    check_paths(out, tokens, parents)
    label = "first token (triton, interpreted)"
    assert_pvalues([(label, chi_square_p(out.output_tokens[:, 0], warped(ROOT_LOGITS, {}), label))], num_tests_here=1)
