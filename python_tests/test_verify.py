"""Tests of `verify` / `verify_chain` against an independent, scalar brute force.

The brute force below (`bf_verify_row`) is written from the rules in the module docstring of
`specdec_kernels/reference/verify.py`, one row at a time, with plain Python floats (float64)
and explicit loops over each node's children list. It reads the same counter-based random
numbers (`specdec_kernels.ops.philox.uniform`) as the implementation:

* acceptance test of drafted node j: u = uniform(seed, node=j, PURPOSE_ACCEPT, index=0);
* sampling at node i: exponential race, token = argmax_v w_v / (-log u_v) with
  u_v = uniform(seed, node=i, PURPOSE_SAMPLE, index=v).

Floating point: the implementation warps logits and updates residuals in fp32, the brute force
in float64 (except logit / temperature, rounded to fp32 exactly like any fp32 implementation,
so top-k boundaries and ties are decided on the same numbers). The brute force carries a
first-order bound on the fp32 error of every probability (per-entry error plus one common
scale factor, since each normalisation scales all entries alike; measured actual errors stay
below ~20% of it), and a decision whose outcome could flip within that bound (an acceptance
test, a race, a top-p boundary) marks the row "ambiguous": it is not compared. In practice
well under 1% of rows are skipped; every test checks that at least 75% were compared, so the
comparison is exact and the tests do not flake.

Statistical (chi-square) tests live in test_verify_stats.py.
"""

import math

import numpy as np
import pytest
import torch

import specdec_kernels
from specdec_kernels import verify, verify_chain
from specdec_kernels.ops.philox import PURPOSE_ACCEPT, PURPOSE_SAMPLE, row_seeds, seeds_from_int, uniform

from conftest import distinct_sibling_tokens, random_parents, randint, sibling_tokens

INF = math.inf


# --------------------------------------------------------------------------------------------
# Scalar brute force
# --------------------------------------------------------------------------------------------


class Ambiguous(Exception):
    """A decision of this row is too close to call under fp32-vs-float64 rounding."""


FP32_EPS = 1.2e-7
FP32_MAX = float(np.finfo(np.float32).max)


def fp32_div(a, b):
    """a / b correctly rounded to fp32 (overflow clamped to the largest finite fp32)."""
    with np.errstate(over="ignore"):
        x = float(np.float32(a) / np.float32(b))
    return FP32_MAX if x == INF else x


def bf_sanitize(row):
    """Python floats; NaN -> -inf (probability 0)."""
    return [-INF if math.isnan(v) else float(v) for v in row]


def bf_argmax(row):
    """Greedy token: the largest logit, lowest id on ties, NaN never wins, all -inf/NaN -> 0."""
    vals = bf_sanitize(row)
    best = 0
    for v in range(1, len(vals)):
        if vals[v] > vals[best]:
            best = v
    return best


def bf_warp(row, temperature, top_k, top_p, check=True):
    """float64 probabilities of the sampled target: temperature, then top-k, then top-p.

    row: Python floats (one node's logits). temperature > 0, top_k int (0 or >= V: off), top_p
    float in (0, 1] (1: off).

    Returns (p, a, gamma): p the float64 probabilities, and a bound on what an fp32
    implementation computes: p32[v] = c * (p[v] + e[v]) with |e[v]| <= a[v] and |c - 1| <= gamma
    (a common scale c, since every normalisation multiplies all entries by the same factor).
    Raises Ambiguous when fp32 rounding could move a top-p boundary.
    """
    vocab = len(row)
    vals = bf_sanitize(row)
    infinite = [v for v in range(vocab) if vals[v] == INF]
    if infinite:  # +inf tokens share all the probability
        p = [1.0 / len(infinite) if v in infinite else 0.0 for v in range(vocab)]
        return p, [0.0] * vocab, 4 * FP32_EPS
    # logit / temperature rounded to fp32 like any fp32 implementation (IEEE division is
    # correctly rounded), so top-k boundaries and ties are decided on the same values.
    x = [fp32_div(v, temperature) for v in vals]

    if 0 < top_k < vocab:
        kth = sorted(x, reverse=True)[top_k - 1]
        x = [xv if xv >= kth else -INF for xv in x]

    if all(xv == -INF for xv in x):  # nothing left: token 0
        return [1.0] + [0.0] * (vocab - 1), [0.0] * vocab, 0.0
    m = max(x)
    e = [math.exp(xv - m) if xv != -INF else 0.0 for xv in x]
    total = sum(e)
    p = [ev / total for ev in e]
    # fp32: x - m rounds (relative 2**-24 of |x - m|), exp a few ulp, then the sum and the
    # division (common factor). Probabilities below 1e-30 may underflow: fully uncertain.
    a = [
        0.0 if pv == 0.0 else (1.01 * pv if pv < 1e-30 else (1.5 * abs(xv - m) + 8) * FP32_EPS * pv)
        for xv, pv in zip(x, p)
    ]
    gamma = 2 * (vocab + 2) * FP32_EPS

    if top_p < 1.0:
        # Groups of equal probability, most likely first; keep a group iff the mass of the
        # strictly more likely tokens is < top_p (the first group always).
        tol = 2 * (sum(a) + gamma + (vocab + 2) * FP32_EPS)  # bound on a fp32 prefix sum's error
        levels = sorted({pv for pv in p if pv > 0}, reverse=True)
        level_err = {pv: max(av for qv, av in zip(p, a) if qv == pv) + gamma * pv for pv in levels}
        kept = []
        mass_before = 0.0
        for i, level in enumerate(levels):
            if check and abs(mass_before - top_p) <= tol:
                raise Ambiguous("top-p boundary")
            if i == 0 or mass_before < top_p:
                kept.append(level)
            else:
                if check and kept[-1] - level <= level_err[kept[-1]] + level_err[level]:
                    raise Ambiguous("top-p: distinct probabilities that may tie in fp32")
                break
            mass_before += sum(pv for pv in p if pv == level)
        smallest = kept[-1]
        p = [pv if pv >= smallest else 0.0 for pv in p]
        a = [av if pv > 0 else 0.0 for av, pv in zip(a, p)]
        total = sum(p)
        # p32 / sum(p32) = c2 * (p + e) / total: the scale c cancels, a new common factor c2.
        gamma = (sum(a) / total + (vocab + 2) * FP32_EPS) * 1.01
        p = [pv / total for pv in p]
        a = [av / total + 2 * FP32_EPS * pv for av, pv in zip(a, p)]
    return p, a, gamma


def bf_race(weights, uniforms, a):
    """Exponential race: argmax_v w_v / (-log u_v), lowest id on ties.

    The fp32 weights are c * (w + e) with |e| <= a: the common scale c does not change the
    winner, so the margin needs a only (plus fp32 rounding of -log u and of the division).
    """
    exps = [-math.log(u) for u in uniforms]
    ratios = [w / e for w, e in zip(weights, exps)]
    best = 0
    for v in range(1, len(ratios)):
        if ratios[v] > ratios[best]:
            best = v
    for v in range(len(ratios)):
        if v != best:
            margin = a[best] / exps[best] + a[v] / exps[v] + 1e-6 * ratios[best]
            if ratios[best] - ratios[v] <= margin:
                raise Ambiguous("race near tie")
    return best


def bf_verify_row(logits, tokens, parents, draft_probs, temperature, top_k, top_p, seed):
    """One row, scalar rules. logits: T lists of V floats; tokens, parents: T ints; draft_probs:
    T lists of V floats or None; temperature, top_k, top_p: Python numbers; seed: int64.

    Returns (accepted_nodes list, num_accepted, output_tokens list), each -1 padded to T.
    """
    num_nodes = len(parents)
    vocab = len(logits[0])
    children = [[] for _ in range(num_nodes)]
    for j in range(1, num_nodes):
        if parents[j] >= 0:  # padding nodes (parent -1) are nobody's child
            children[parents[j]].append(j)

    seed_t = torch.tensor(seed, dtype=torch.int64)
    nodes = torch.arange(num_nodes)
    u_accept = uniform(seed_t, nodes, PURPOSE_ACCEPT, 0).tolist()
    u_sample = uniform(seed_t, nodes[:, None], PURPOSE_SAMPLE, torch.arange(vocab)[None, :]).tolist()

    greedy = temperature == 0
    path, out = [0], []
    cur = 0
    while True:
        nxt = None
        if greedy:
            target = bf_argmax(logits[cur])
            for j in children[cur]:
                if tokens[j] == target:
                    nxt = j
                    break
            emitted = target
        elif draft_probs is None:
            p, a, _ = bf_warp(logits[cur], temperature, top_k, top_p)
            y = bf_race(p, u_sample[cur], a)
            for j in children[cur]:
                if tokens[j] == y:
                    nxt = j
                    break
            emitted = y
        else:
            # Residual r, with the fp32 one equal to c * (r + e), |e| <= a, |c - 1| <= gamma.
            r, a, gamma = bf_warp(logits[cur], temperature, top_k, top_p)
            q = [0.0 if math.isnan(v) else max(v, 0.0) for v in draft_probs[cur]]
            for j in children[cur]:
                x = tokens[j]
                lhs, rhs = u_accept[j] * q[x], r[x]
                rhs_err = gamma * rhs + (1 + gamma) * a[x]
                if q[x] == 0.0:  # accepted iff r(x) > 0
                    if rhs == 0.0 and a[x] == 0.0:
                        accept = False
                    elif rhs > rhs_err:
                        accept = True
                    else:
                        raise Ambiguous("q(x) = 0 and r(x) ~ 0")
                else:
                    if abs(lhs - rhs) <= rhs_err + 2 * FP32_EPS * lhs:
                        raise Ambiguous("acceptance test near tie")
                    accept = lhs < rhs
                if accept:
                    nxt = j
                    break
                # Rejected: r <- normalise(max(r - q, 0)), unchanged if that is all zero.
                # fp32: c (r + e) - q = c (r - q + e + (1 - 1/c) q), rounded; max(., 0) keeps
                # the scale c outside; normalising cancels it and brings a new common factor.
                g = gamma / (1 - gamma)
                diff = [rv - qv for rv, qv in zip(r, q)]
                eta = [av + g * qv + (FP32_EPS * abs(d) if qv > 0 else 0.0) for av, qv, d in zip(a, q, diff)]
                updated = [max(d, 0.0) for d in diff]
                # a coordinate surely below zero is exactly 0 in fp32 too
                f = [0.0 if d < -et else et for d, et in zip(diff, eta)]
                total, f_total = sum(updated), sum(f)
                if total == 0.0 and f_total == 0.0:
                    continue  # r == q: leave r unchanged
                if total <= 2 * f_total + vocab * FP32_EPS * total or f_total > 0.1 * total:
                    raise Ambiguous("residual mass ~ 0")
                r = [u / total for u in updated]
                a = [fv / total + 2 * FP32_EPS * rv for fv, rv in zip(f, r)]
                gamma = (f_total / total + (vocab + 2) * FP32_EPS) / (1 - f_total / total) * 1.01
            emitted = None if nxt is not None else bf_race(r, u_sample[cur], a)
        if nxt is None:
            out.append(emitted)
            break
        out.append(tokens[nxt])
        path.append(nxt)
        cur = nxt

    num_accepted = len(path) - 1
    pad = lambda xs: xs + [-1] * (num_nodes - len(xs))  # noqa: E731
    return pad(path), num_accepted, pad(out)


def bf_verify(target_logits, tree_tokens, parents, draft_probs, temperature, top_k, top_p, seeds):
    """Brute force for a batch: a list with one (accepted, num, out) tuple or None (ambiguous) per row."""
    batch, num_nodes, vocab = target_logits.shape
    parents = parents.expand(batch, num_nodes) if parents.dim() == 1 else parents
    logits = target_logits.float().tolist()
    dp = None if draft_probs is None else draft_probs.float().tolist()
    results = []
    for b in range(batch):
        try:
            results.append(
                bf_verify_row(
                    logits[b],
                    [int(t) for t in tree_tokens[b]],
                    [int(p) for p in parents[b]],
                    None if dp is None else dp[b],
                    float(temperature[b]),
                    int(top_k[b]),
                    float(top_p[b]),
                    int(seeds[b]),
                )
            )
        except Ambiguous:
            results.append(None)
    return results


def as_row_values(value, batch, dtype, default):
    """The per-row value the op sees, as a [B] tensor (fp32 for floats, like the implementation)."""
    if value is None:
        value = default
    if isinstance(value, torch.Tensor):
        return value.reshape(-1).expand(batch).to(dtype) if value.dim() == 0 else value.to(dtype)
    return torch.full((batch,), value, dtype=dtype)


def compare_with_bruteforce(out, target_logits, tree_tokens, parents, *, draft_probs, temperature, top_k, top_p, seed, min_fraction=0.75):
    batch = target_logits.shape[0]
    seeds = seeds_from_int(seed, batch, "cpu") if isinstance(seed, int) else seed
    temps = as_row_values(temperature, batch, torch.float32, 1.0)
    ks = as_row_values(top_k, batch, torch.int64, 0)
    ps = as_row_values(top_p, batch, torch.float32, 1.0)
    expected = bf_verify(target_logits, tree_tokens, parents, draft_probs, temps, ks, ps, seeds)
    compared = 0
    for b, exp in enumerate(expected):
        if exp is None:
            continue
        compared += 1
        acc, num, toks = exp
        assert out.accepted_nodes[b].tolist() == acc, f"row {b}: accepted_nodes"
        assert int(out.num_accepted[b]) == num, f"row {b}: num_accepted"
        assert out.output_tokens[b].tolist() == toks, f"row {b}: output_tokens"
    assert compared >= min_fraction * batch, f"only {compared}/{batch} rows could be compared"
    return compared


def check_invariants(out, tree_tokens, parents, vocab):
    """Output contract: dtypes, root first, path follows parent links, emitted tokens."""
    batch, num_nodes = tree_tokens.shape
    parents = parents.expand(batch, num_nodes) if parents.dim() == 1 else parents
    assert out.accepted_nodes.dtype == torch.int32
    assert out.num_accepted.dtype == torch.int32
    assert out.output_tokens.dtype == torch.int64
    assert out.accepted_nodes.shape == (batch, num_nodes)
    assert out.num_accepted.shape == (batch,)
    assert out.output_tokens.shape == (batch, num_nodes)
    for b in range(batch):
        acc = out.accepted_nodes[b].tolist()
        num = int(out.num_accepted[b])
        toks = out.output_tokens[b].tolist()
        assert acc[0] == 0
        assert 0 <= num < num_nodes
        assert all(a == -1 for a in acc[num + 1 :]) and all(a >= 0 for a in acc[: num + 1])
        for d in range(1, num + 1):
            assert int(parents[b, acc[d]]) == acc[d - 1], f"row {b}: path leaves the parent links"
            assert toks[d - 1] == int(tree_tokens[b, acc[d]])
        assert sum(t != -1 for t in toks) == num + 1
        assert all(t == -1 for t in toks[num + 1 :])
        assert all(0 <= t < vocab for t in toks[: num + 1])


# --------------------------------------------------------------------------------------------
# Random inputs
# --------------------------------------------------------------------------------------------


def random_draft_probs(gen, batch, num_nodes, vocab, zero_fraction=0.2):
    """Random distributions, some entries exactly 0 (at least one positive per node)."""
    scale = torch.rand(batch, 1, 1, generator=gen) * 2.5 + 0.3  # flat to peaky
    probs = torch.softmax(torch.randn(batch, num_nodes, vocab, generator=gen) * scale, dim=-1)
    zero = torch.rand(batch, num_nodes, vocab, generator=gen) < zero_fraction
    zero[..., int(randint(gen, 0, vocab))] = False
    probs = torch.where(zero, 0.0, probs)
    return probs / probs.sum(-1, keepdim=True)


def sampled_tree_tokens(gen, parents, draft_probs):
    """Each child drawn independently from draft_probs[b, parent] (siblings may repeat)."""
    batch, num_nodes, vocab = draft_probs.shape
    parent_dist = draft_probs[torch.arange(batch)[:, None], parents.clamp(min=0)]
    tokens = torch.multinomial(parent_dist.reshape(-1, vocab).float(), 1, generator=gen).reshape(batch, num_nodes)
    tokens[:, 0] = randint(gen, 0, vocab, (batch,))
    return torch.where(parents >= 0, tokens, torch.full_like(tokens, -1)) if num_nodes > 1 else tokens


def random_row_params(gen, batch, vocab, greedy_fraction=0.2):
    temperature = torch.rand(batch, generator=gen) * 1.7 + 0.3
    temperature = torch.where(torch.rand(batch, generator=gen) < greedy_fraction, 0.0, temperature)
    ks = torch.tensor([0, 1, 2, 3, vocab, vocab + 5])
    top_k = ks[randint(gen, 0, len(ks), (batch,))]
    ps = torch.tensor([1.0, 1.0, 0.5, 0.8, 0.95, 0.3])
    top_p = ps[randint(gen, 0, len(ps), (batch,))]
    return temperature, top_k, top_p


def random_logits(gen, batch, num_nodes, vocab, dtype, *, ties=False, nonfinite=False, nonfinite_cuts=(0.1, 0.17, 0.2)):
    """[B, T, V] logits in `dtype`: integers in [-2, 2] (ties) or Gaussian with a per-row scale
    from flat to peaky. nonfinite: entries with a uniform r < cuts[0] become NaN, r < cuts[1]
    -inf, r < cuts[2] +inf, and about 10% of the nodes are entirely NaN or -inf."""
    nan_cut, neg_inf_cut, pos_inf_cut = nonfinite_cuts
    if ties:
        logits = randint(gen, -2, 3, (batch, num_nodes, vocab)).float()
    else:
        scale = torch.rand(batch, 1, 1, generator=gen) * 3 + 0.5  # flat to peaky
        logits = torch.randn(batch, num_nodes, vocab, generator=gen) * scale
    if nonfinite:
        r = torch.rand(batch, num_nodes, vocab, generator=gen)
        logits = torch.where(r < nan_cut, float("nan"), logits)
        logits = torch.where((r >= nan_cut) & (r < neg_inf_cut), float("-inf"), logits)
        logits = torch.where((r >= neg_inf_cut) & (r < pos_inf_cut), float("inf"), logits)
        # some nodes entirely -inf / NaN
        dead = torch.rand(batch, num_nodes, 1, generator=gen) < 0.1
        logits = torch.where(dead, torch.where(r < 0.5, float("nan"), float("-inf")), logits)
    return logits.to(dtype)


CASES = [
    # id, tree kind, T, V, logits dtype
    ("T1-V7-fp32", "random", 1, 7, torch.float32),
    ("chain-T2-V2-fp32", "chain", 2, 2, torch.float32),
    ("chain-T9-V13-bf16", "chain", 9, 13, torch.bfloat16),
    ("star-T12-V17-fp16", "star", 12, 17, torch.float16),
    ("bushy-T40-V41-fp32", "bushy", 40, 41, torch.float32),
    ("deep-T40-V5-bf16", "deep", 40, 5, torch.bfloat16),
    ("random-T17-V19-fp16", "random", 17, 19, torch.float16),
    ("random-T33-V37-bf16", "random", 33, 37, torch.bfloat16),
]


def build_case(gen, kind, num_nodes, vocab, dtype, with_probs, batch, **logit_kw):
    parents = random_parents(gen, batch, num_nodes, kind, ragged=True)
    if with_probs:
        draft_probs = random_draft_probs(gen, batch, num_nodes, vocab).to(dtype)
        tokens = sampled_tree_tokens(gen, parents, draft_probs.float())
    else:
        draft_probs = None
        tokens = distinct_sibling_tokens(gen, parents, vocab)
    logits = random_logits(gen, batch, num_nodes, vocab, dtype, **logit_kw)
    return logits, tokens, parents, draft_probs


# --------------------------------------------------------------------------------------------
# A. Exact agreement with the brute force
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed_kind", ["int_seed", "tensor_seed"])
@pytest.mark.parametrize("with_probs", [False, True], ids=["deterministic", "draft_probs"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_bruteforce(gen, case, with_probs, seed_kind):
    _, kind, num_nodes, vocab, dtype = case
    batch = 32
    logits, tokens, parents, draft_probs = build_case(gen, kind, num_nodes, vocab, dtype, with_probs, batch)
    temperature, top_k, top_p = random_row_params(gen, batch, vocab)
    seed = int(randint(gen, 0, 2**62)) if seed_kind == "int_seed" else randint(gen, -(2**62), 2**62, (batch,))
    kw = dict(draft_probs=draft_probs, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    out = verify(logits, tokens, parents, **kw)
    ref = verify(logits, tokens, parents, backend="reference", **kw)
    for a, b in zip(out, ref):
        assert torch.equal(a, b)
    check_invariants(out, tokens, parents, vocab)
    compare_with_bruteforce(out, logits, tokens, parents, **kw)


@pytest.mark.parametrize("with_probs", [False, True], ids=["deterministic", "draft_probs"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_matches_bruteforce_nonfinite_and_ties(gen, with_probs, dtype):
    """NaN / +-inf logits sprinkled everywhere, whole dead nodes, integer logits (many ties)."""
    batch, num_nodes, vocab = 32, 15, 9
    for ties in (False, True):
        logits, tokens, parents, draft_probs = build_case(
            gen, "deep", num_nodes, vocab, dtype, with_probs, batch, ties=ties, nonfinite=True
        )
        temperature, top_k, top_p = random_row_params(gen, batch, vocab)
        seed = randint(gen, -(2**62), 2**62, (batch,))
        kw = dict(draft_probs=draft_probs, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        out = verify(logits, tokens, parents, **kw)
        check_invariants(out, tokens, parents, vocab)
        compare_with_bruteforce(out, logits, tokens, parents, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_matches_bruteforce_many_repeated_siblings(gen, dtype):
    """Small vocabulary, flat target and draft: many i.i.d. siblings repeat tokens, get rejected
    one after the other and push the residual through several updates (all rows sampled)."""
    batch, vocab = 64, 5
    # root -> 4 children, each with 3 children; ragged rows drop the last 0..11 nodes
    structure = torch.tensor([-1, 0, 0, 0, 0] + [1 + i // 3 for i in range(12)])
    num_nodes = len(structure)
    parents = structure.expand(batch, num_nodes).clone()
    real = randint(gen, 5, num_nodes + 1, (batch,))
    parents[torch.arange(num_nodes)[None, :] >= real[:, None]] = -1
    draft_probs = torch.softmax(torch.randn(batch, num_nodes, vocab, generator=gen), -1).to(dtype)
    tokens = sampled_tree_tokens(gen, parents, draft_probs.float())
    logits = (torch.randn(batch, num_nodes, vocab, generator=gen) * 1.2).to(dtype)
    temperature = torch.rand(batch, generator=gen) + 0.5
    top_k = torch.tensor([0, 0, 3, 4])[randint(gen, 0, 4, (batch,))]
    top_p = torch.tensor([1.0, 1.0, 0.9, 0.7])[randint(gen, 0, 4, (batch,))]
    seed = randint(gen, -(2**62), 2**62, (batch,))
    kw = dict(draft_probs=draft_probs, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    out = verify(logits, tokens, parents, **kw)
    check_invariants(out, tokens, parents, vocab)
    compare_with_bruteforce(out, logits, tokens, parents, **kw)


@pytest.mark.parametrize("with_probs", [False, True], ids=["deterministic", "draft_probs"])
def test_matches_bruteforce_scalar_args_and_shared_parents(gen, with_probs):
    """Scalar temperature / top_k / top_p, 0-dim tensors, and a [T] parents array for all rows."""
    batch, num_nodes, vocab = 20, 11, 12
    parents = random_parents(gen, 1, num_nodes, "random", ragged=False)[0]
    parents_2d = parents.expand(batch, num_nodes)
    for temperature, top_k, top_p in [
        (1.0, None, None),
        (0.0, 3, 0.5),
        (0.7, 4, None),
        (torch.tensor(1.3), torch.tensor(5), torch.tensor(0.9)),
        (1, 0, 1.0),
    ]:
        if with_probs:
            draft_probs = random_draft_probs(gen, batch, num_nodes, vocab)
            tokens = sampled_tree_tokens(gen, parents_2d.clone(), draft_probs)
        else:
            draft_probs = None
            tokens = distinct_sibling_tokens(gen, parents_2d.clone(), vocab)
        logits = random_logits(gen, batch, num_nodes, vocab, torch.float32)
        seed = int(randint(gen, 0, 2**31))
        kw = dict(draft_probs=draft_probs, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        out = verify(logits, tokens, parents, **kw)
        check_invariants(out, tokens, parents, vocab)
        compare_with_bruteforce(out, logits, tokens, parents, **kw)
        out_2d = verify(logits, tokens, parents_2d, **kw)
        for a, b in zip(out, out_2d):
            assert torch.equal(a, b)


@pytest.mark.parametrize("with_probs", [False, True], ids=["deterministic", "draft_probs"])
@pytest.mark.parametrize("num_drafts", [0, 1, 6])
def test_verify_chain_equals_verify_on_chain_tree(gen, num_drafts, with_probs):
    batch, vocab = 16, 10
    logits = random_logits(gen, batch, num_drafts + 1, vocab, torch.float32)
    if with_probs:
        chain_probs = random_draft_probs(gen, batch, max(num_drafts, 1), vocab)[:, :num_drafts]
        draft_tokens = torch.multinomial(chain_probs.reshape(-1, vocab), 1, generator=gen).reshape(batch, num_drafts) if num_drafts else torch.zeros(batch, 0, dtype=torch.int64)
        # Tree layout: node i's children drawn from draft_probs[:, i]; the leaf's row is unused.
        garbage = torch.softmax(torch.randn(batch, 1, vocab, generator=gen), -1)
        tree_probs = torch.cat([chain_probs, garbage], dim=1)
    else:
        chain_probs = tree_probs = None
        draft_tokens = randint(gen, 0, vocab, (batch, num_drafts))
    temperature, top_k, top_p = random_row_params(gen, batch, vocab)
    seed = randint(gen, -(2**62), 2**62, (batch,))
    kw = dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    chain = verify_chain(logits, draft_tokens, draft_probs=chain_probs, **kw)
    tokens = torch.cat([randint(gen, 0, vocab, (batch, 1)), draft_tokens], dim=1)
    parents = torch.arange(-1, num_drafts)
    tree = verify(logits, tokens, parents, draft_probs=tree_probs, **kw)
    for a, b in zip(chain, tree):
        assert torch.equal(a, b)
    check_invariants(chain, tokens, parents, vocab)
    compare_with_bruteforce(chain, logits, tokens, parents, draft_probs=tree_probs, **kw)


@pytest.mark.parametrize("with_probs", [False, True], ids=["deterministic", "draft_probs"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_greedy_is_argmax_chain_lowest_index_on_ties(gen, dtype, with_probs):
    """Integer logits (ties everywhere); trees that contain the argmax chain, the other tied
    tokens and repeats (with draft_probs). Expected path computed by hand, not by the brute force."""
    batch, num_nodes, vocab = 24, 16, 16
    logits = randint(gen, 0, 3, (batch, num_nodes, vocab)).float()
    logits[:, :, vocab - 1] = logits.amax(-1)  # the highest id always ties for the max
    logits = logits.to(dtype)
    parents = random_parents(gen, batch, num_nodes, "bushy", ragged=True)

    def prefer_tied(b, p, taken):
        row = logits[b, p].float()
        tied = [v for v in range(vocab) if row[v] == row.max()]
        # Prefer the tied-for-max tokens (highest first), so ties are decided in the tree.
        choices = [v for v in reversed(tied) if with_probs or v not in taken]
        if not choices or float(torch.rand((), generator=gen)) < 0.3:
            choices = [v for v in range(vocab) if with_probs or v not in taken]
        return choices[0] if float(torch.rand((), generator=gen)) < 0.6 else choices[int(randint(gen, 0, len(choices)))]

    tokens = sibling_tokens(gen, parents, vocab, prefer_tied)
    draft_probs = random_draft_probs(gen, batch, num_nodes, vocab) if with_probs else None
    top_k = randint(gen, 0, 4, (batch,))
    top_p = torch.full((batch,), 0.5)
    out = verify(logits, tokens, parents, draft_probs=draft_probs, temperature=0.0, top_k=top_k, top_p=top_p, seed=int(randint(gen, 0, 1000)))
    check_invariants(out, tokens, parents, vocab)
    for b in range(batch):
        cur, path, emitted = 0, [0], []
        while True:
            row = logits[b, cur].float().tolist()
            best = row.index(max(row))  # lowest index among the maxima
            nxt = next((j for j in range(1, num_nodes) if int(parents[b, j]) == cur and int(tokens[b, j]) == best), None)
            emitted.append(best)
            if nxt is None:
                break
            path.append(nxt)
            cur = nxt
        assert out.accepted_nodes[b, : len(path)].tolist() == path
        assert int(out.num_accepted[b]) == len(path) - 1
        assert out.output_tokens[b, : len(emitted)].tolist() == emitted
    # Greedy output does not depend on the seed, top-k or top-p.
    again = verify(logits, tokens, parents, draft_probs=draft_probs, temperature=0.0, seed=12345)
    for a, b in zip(out, again):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind", ["chain", "star", "bushy", "random"])
def test_verify_greedy_equals_verify_at_temperature_zero(gen, kind):
    """`verify_greedy` from each node's greedy token gives `verify`'s greedy result exactly:
    integer logits (ties), NaN and +inf among them, trees holding the argmax chain, repeated
    siblings, ragged rows with padding nodes; T = 1 (plain decoding) too."""
    from specdec_kernels import verify_greedy
    from specdec_kernels.ops.sampling import greedy_tokens

    for batch, num_nodes in ((6, 12), (3, 1), (1, 5)):
        vocab = 9
        logits = randint(gen, 0, 3, (batch, num_nodes, vocab)).float()
        logits[0, 0, 2] = float("nan")
        logits[-1, -1, 4] = float("inf")
        parents = random_parents(gen, batch, num_nodes, kind, ragged=True)

        def often_the_argmax(b, p, taken):
            best = int(greedy_tokens(logits[b, p]))
            return best if float(torch.rand((), generator=gen)) < 0.6 else int(randint(gen, 0, vocab))

        tokens = sibling_tokens(gen, parents, vocab, often_the_argmax)
        # (repeated siblings need draft probabilities, which a greedy row does not read)
        draft_probs = torch.full((batch, num_nodes, vocab), 1.0 / vocab)
        want = verify(logits, tokens, parents, draft_probs=draft_probs, temperature=0.0)
        got = verify_greedy(greedy_tokens(logits), tokens, parents)
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and torch.equal(a, b)
    with pytest.raises(ValueError, match=r"must all be \[B, T\]"):
        verify_greedy(torch.zeros(2, 3, dtype=torch.int64), torch.zeros(2, 4, dtype=torch.int64),
                      torch.zeros(2, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="integer"):
        verify_greedy(torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.int64), torch.zeros(2, 3, dtype=torch.int64))


# --------------------------------------------------------------------------------------------
# C. Pitfalls
# --------------------------------------------------------------------------------------------


def _star(batch, vocab, tokens_per_row):
    """Root with len(tokens_per_row) children."""
    k = len(tokens_per_row)
    parents = torch.tensor([-1] + [0] * k).expand(batch, k + 1).clone()
    tokens = torch.tensor([0] + list(tokens_per_row)).expand(batch, k + 1).clone()
    return tokens, parents


@pytest.mark.parametrize("with_probs", [False, True], ids=["deterministic", "draft_probs"])
@pytest.mark.parametrize("greedy", [False, True], ids=["sampled", "greedy"])
def test_nan_logits_have_probability_zero(greedy, with_probs):
    batch, vocab = 256, 6
    logits = torch.zeros(batch, 3, vocab)
    logits[:, :, [0, 2, 4]] = float("nan")
    logits[:, :, 1] = 0.5
    draft_probs = torch.full((batch, 3, vocab), 1.0 / vocab) if with_probs else None
    temperature = 0.0 if greedy else 1.0
    seed = torch.arange(batch, dtype=torch.int64)
    nan_tokens = torch.tensor([0, 2, 4])
    for children in ([2, 3], [4], [0, 2]):  # drafts holding NaN-logit tokens (and token 3)
        tokens, parents = _star(batch, vocab, children)
        for top_k, top_p in [(None, None), (2, None), (None, 0.5)]:
            out = verify(logits[:, : len(children) + 1], tokens, parents, draft_probs=None if draft_probs is None else draft_probs[:, : len(children) + 1], temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
            check_invariants(out, tokens, parents, vocab)
            emitted = out.output_tokens[out.output_tokens >= 0]
            assert not torch.isin(emitted, nan_tokens).any(), "a NaN-logit token was emitted"
            for i, tok in enumerate(children):
                if tok in nan_tokens.tolist():
                    assert not (out.accepted_nodes[:, 1] == i + 1).any(), "a NaN-logit draft was accepted"
            first = out.output_tokens[:, 0]
            if greedy:
                assert (first == 1).all()
            elif 3 not in children and top_k is None and top_p is None:
                assert set(first.tolist()) == {1, 3, 5}  # sampled from p, NaN tokens excluded


@pytest.mark.parametrize("with_probs", [False, True], ids=["deterministic", "draft_probs"])
@pytest.mark.parametrize("greedy", [False, True], ids=["sampled", "greedy"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_posinf_logits_share_all_mass(dtype, greedy, with_probs):
    batch, vocab = 600, 7
    logits = torch.randn(batch, 2, vocab, generator=torch.Generator().manual_seed(0)) * 3
    logits[:, 0, 3] = float("inf")
    logits[:, 0, 5] = float("inf")
    logits[:, 0, 6] = float("nan")
    logits = logits.to(dtype)
    tokens, parents = _star(batch, vocab, [4])  # a finite-logit draft: never accepted
    draft_probs = torch.full((batch, 2, vocab), 1.0 / vocab) if with_probs else None
    out = verify(logits, tokens, parents, draft_probs=draft_probs, temperature=0.0 if greedy else 0.8, top_k=2 if not greedy else None, seed=3)
    check_invariants(out, tokens, parents, vocab)
    assert (out.num_accepted == 0).all()
    emitted = out.output_tokens[:, 0]
    if greedy:
        assert (emitted == 3).all()  # lowest id among the +inf tokens
    else:
        counts = torch.bincount(emitted, minlength=vocab)
        assert counts[3] + counts[5] == batch
        assert 200 < counts[3] < 400  # ~Binomial(600, 1/2): 300 +- 12 sd
    # A draft holding a +inf token: p(x) = 1/2.
    tokens_inf, parents_inf = _star(batch, vocab, [5])
    out = verify(logits, tokens_inf, parents_inf, draft_probs=draft_probs, temperature=0.0 if greedy else 1.0, seed=4)
    check_invariants(out, tokens_inf, parents_inf, vocab)
    acceptance = out.num_accepted.float().mean()
    if greedy:
        assert (out.num_accepted == 0).all()  # argmax is 3, the lowest +inf id
    elif with_probs:
        assert 0.99 < acceptance  # u * (1/7) < 1/2 always
    else:
        assert 0.4 < acceptance < 0.6  # y ~ uniform{3, 5}


@pytest.mark.parametrize("with_probs", [False, True], ids=["deterministic", "draft_probs"])
@pytest.mark.parametrize("greedy", [False, True], ids=["sampled", "greedy"])
@pytest.mark.parametrize("fill", ["nan", "-inf", "mixed"])
def test_dead_node_emits_token_0(fill, greedy, with_probs):
    batch, vocab = 64, 5
    values = {"nan": float("nan"), "-inf": float("-inf")}
    logits = torch.randn(batch, 3, vocab)
    if fill == "mixed":
        logits[:, 0] = torch.tensor([float("nan"), float("-inf"), float("nan"), float("-inf"), float("nan")])
    else:
        logits[:, 0] = values[fill]
    tokens, parents = _star(batch, vocab, [2, 4])
    draft_probs = torch.full((batch, 3, vocab), 1.0 / vocab) if with_probs else None
    out = verify(logits, tokens, parents, draft_probs=draft_probs, temperature=0.0 if greedy else 1.0, top_k=2, top_p=0.5, seed=11)
    check_invariants(out, tokens, parents, vocab)
    assert (out.num_accepted == 0).all()
    assert (out.output_tokens[:, 0] == 0).all()
    # ... and if token 0 is drafted, it is the one accepted.
    tokens0, parents0 = _star(batch, vocab, [2, 0])
    out = verify(logits, tokens0, parents0, draft_probs=draft_probs, temperature=0.0 if greedy else 1.0, seed=12)
    assert (out.accepted_nodes[:, 1] == 2).all()
    assert (out.output_tokens[:, 0] == 0).all()


def test_residual_that_sums_to_zero_keeps_a_valid_distribution():
    """Target p == draft q exactly (uniform over 4 tokens, exact in fp32). A drafted token
    outside the support (p = q = 0) is rejected, which makes max(r - q, 0) all zero: r must stay
    p, the next child (any token in the support) is then always accepted, and a row whose only
    child was rejected samples from p, never NaN, never out of the vocabulary."""
    batch, vocab = 512, 8
    logits = torch.full((batch, 4, vocab), float("-inf"))
    logits[:, :, :4] = 1.0
    q = torch.zeros(batch, 4, vocab)
    q[:, :, :4] = 0.25
    # Row layout: root -> [node 1: token 6 (p = q = 0), node 2: token t in the support]
    support_token = torch.randint(0, 4, (batch,), generator=torch.Generator().manual_seed(1))
    parents = torch.tensor([-1, 0, 0, -1]).expand(batch, 4)
    tokens = torch.stack([torch.zeros(batch, dtype=torch.int64), torch.full((batch,), 6), support_token, torch.full((batch,), 2)], 1)
    seed = torch.arange(batch, dtype=torch.int64) * 7919
    out = verify(logits, tokens, parents, draft_probs=q, temperature=1.0, seed=seed)
    check_invariants(out, tokens, parents, vocab)
    assert (out.accepted_nodes[:, 1] == 2).all(), "a support token after the zero residual must be accepted"
    assert (out.output_tokens[:, 0] == support_token).all()
    assert (out.output_tokens[:, 1] < 4).all() and (out.output_tokens[:, 1] >= 0).all()
    # Only the off-support child: it is rejected and the correction is drawn from p (uniform on 0..3).
    parents1 = torch.tensor([-1, 0, -1, -1]).expand(batch, 4)
    out = verify(logits, tokens, parents1, draft_probs=q, temperature=1.0, seed=seed)
    check_invariants(out, tokens, parents1, vocab)
    assert (out.num_accepted == 0).all()
    counts = torch.bincount(out.output_tokens[:, 0], minlength=vocab)
    assert counts[4:].sum() == 0 and (counts[:4] > 80).all()  # ~128 each
    # Drafts from q == p: always accepted, no NaN anywhere.
    chain_parents = torch.tensor([-1, 0, 1, 2])
    chain_tokens = torch.randint(0, 4, (batch, 4), generator=torch.Generator().manual_seed(2))
    out = verify(logits, chain_tokens, chain_parents, draft_probs=q, temperature=1.0, seed=seed)
    assert (out.num_accepted == 3).all()


@pytest.mark.parametrize("with_probs", [False, True], ids=["deterministic", "draft_probs"])
@pytest.mark.parametrize("greedy", [False, True], ids=["sampled", "greedy"])
def test_padding_nodes_never_accepted(greedy, with_probs):
    """Padding nodes (parent -1) hold the target's certain token and carry a valid token id."""
    batch, num_nodes, vocab = 64, 6, 5
    logits = torch.full((batch, num_nodes, vocab), -5.0)
    logits[:, :, 3] = 20.0  # token 3 is (essentially) certain everywhere
    parents = torch.tensor([-1, 0, -1, -1, -1, -1]).expand(batch, num_nodes)
    tokens = torch.tensor([3, 1, 3, 3, 3, 3]).expand(batch, num_nodes)
    draft_probs = torch.full((batch, num_nodes, vocab), 1.0 / vocab) if with_probs else None
    out = verify(logits, tokens, parents, draft_probs=draft_probs, temperature=0.0 if greedy else 1.0, seed=5)
    check_invariants(out, tokens, parents, vocab)
    assert (out.num_accepted == 0).all()
    assert (out.accepted_nodes[:, 1:] == -1).all()
    assert (out.output_tokens[:, 0] == 3).all()
    # Only the root: no children at all.
    parents = torch.tensor([-1, -1, -1, -1, -1, -1])
    out = verify(logits, tokens, parents, draft_probs=draft_probs, temperature=0.0 if greedy else 1.0, seed=5)
    assert (out.num_accepted == 0).all() and (out.output_tokens[:, 0] == 3).all()
    # Deeper: chain root -> 1 (token 3, accepted) then padding holding token 3 again.
    parents = torch.tensor([-1, 0, -1, -1, -1, -1])
    tokens = torch.tensor([0, 3, 3, 3, 3, 3]).expand(batch, num_nodes)
    out = verify(logits, tokens, parents, draft_probs=draft_probs, temperature=0.0 if greedy else 1.0, seed=5)
    check_invariants(out, tokens, parents, vocab)
    assert (out.num_accepted == 1).all() and (out.accepted_nodes[:, 2:] == -1).all()


def test_draft_probability_zero_accepted_iff_target_positive():
    batch, vocab = 400, 6
    logits = torch.randn(batch, 2, vocab, generator=torch.Generator().manual_seed(9))
    logits[:, 0, 5] = float("-inf")  # p(5) = 0 at the root
    q = torch.softmax(torch.randn(batch, 2, vocab, generator=torch.Generator().manual_seed(10)), -1)
    q[:, 0, 2] = 0.0
    q[:, 0, 5] = 0.0
    q = q / q.sum(-1, keepdim=True)
    seed = torch.arange(batch, dtype=torch.int64)
    # token 2: q = 0, p > 0 -> always accepted
    tokens, parents = _star(batch, vocab, [2])
    out = verify(logits, tokens, parents, draft_probs=q, temperature=1.0, seed=seed)
    check_invariants(out, tokens, parents, vocab)
    assert (out.num_accepted == 1).all()
    # token 5: q = 0, p = 0 -> always rejected, then a valid correction
    tokens, parents = _star(batch, vocab, [5])
    out = verify(logits, tokens, parents, draft_probs=q, temperature=1.0, seed=seed)
    check_invariants(out, tokens, parents, vocab)
    assert (out.num_accepted == 0).all()
    assert ((out.output_tokens[:, 0] >= 0) & (out.output_tokens[:, 0] < 5)).all()
    # With top-k removing token 2 at the root: p(2) = 0 -> rejected.
    logits2 = logits.clone()
    logits2[:, 0, 2] = logits2[:, 0].nan_to_num(neginf=0).min(-1).values - 1
    tokens, parents = _star(batch, vocab, [2])
    out = verify(logits2, tokens, parents, draft_probs=q, temperature=1.0, top_k=3, seed=seed)
    assert (out.num_accepted == 0).all() and (out.output_tokens[:, 0] != 2).all()


@pytest.mark.parametrize("with_probs", [False, True], ids=["deterministic", "draft_probs"])
def test_same_seed_same_result_different_seed_differs(gen, with_probs):
    batch, num_nodes, vocab = 32, 12, 11  # vocab >= T - 1: room for distinct siblings
    draft_probs = None
    parents = random_parents(gen, batch, num_nodes, "bushy", ragged=False)
    if with_probs:
        draft_probs = random_draft_probs(gen, batch, num_nodes, vocab)
        tokens = sampled_tree_tokens(gen, parents, draft_probs)
    else:
        tokens = distinct_sibling_tokens(gen, parents, vocab)
    logits = random_logits(gen, batch, num_nodes, vocab, torch.float32) * 0.3  # flat: outcomes vary
    kw = dict(draft_probs=draft_probs, temperature=1.0)
    seed = randint(gen, -(2**62), 2**62, (batch,))
    a = verify(logits, tokens, parents, seed=seed, **kw)
    b = verify(logits, tokens, parents, seed=seed.clone(), **kw)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    c = verify(logits, tokens, parents, seed=1234, **kw)
    d = verify(logits, tokens, parents, seed=1234, **kw)
    for x, y in zip(c, d):
        assert torch.equal(x, y)
    e = verify(logits, tokens, parents, seed=seed + 1, **kw)
    f = verify(logits, tokens, parents, seed=1235, **kw)
    assert not torch.equal(a.output_tokens, e.output_tokens)
    assert not torch.equal(c.output_tokens, f.output_tokens)


@pytest.mark.parametrize("with_probs", [False, True], ids=["deterministic", "draft_probs"])
def test_row_independent_of_other_rows(gen, with_probs):
    batch, num_nodes, vocab = 24, 10, 9  # vocab >= T - 1: room for distinct siblings
    parents = random_parents(gen, batch, num_nodes, "random", ragged=True)
    if with_probs:
        draft_probs = random_draft_probs(gen, batch, num_nodes, vocab)
        tokens = sampled_tree_tokens(gen, parents, draft_probs)
    else:
        draft_probs = None
        tokens = distinct_sibling_tokens(gen, parents, vocab)
    logits = random_logits(gen, batch, num_nodes, vocab, torch.float32) * 0.5
    temperature, top_k, top_p = random_row_params(gen, batch, vocab)
    seed = randint(gen, -(2**62), 2**62, (batch,))
    full = verify(logits, tokens, parents, draft_probs=draft_probs, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    # Shuffle the rows and replace half of them with other content; compare the kept rows.
    perm = torch.randperm(batch, generator=gen)
    keep = perm[: batch // 2]
    other_parents = random_parents(gen, batch, num_nodes, "chain", ragged=True)
    other_tokens = distinct_sibling_tokens(gen, other_parents, vocab)
    mixed_parents = other_parents.clone()
    mixed_tokens = other_tokens.clone()
    mixed_logits = random_logits(gen, batch, num_nodes, vocab, torch.float32)
    mixed_probs = None if draft_probs is None else random_draft_probs(gen, batch, num_nodes, vocab)
    mixed_temp = torch.rand(batch, generator=gen)
    mixed_k = torch.zeros(batch, dtype=torch.int64)
    mixed_p = torch.ones(batch)
    mixed_seed = randint(gen, -(2**62), 2**62, (batch,))
    slots = torch.arange(batch // 2) * 2  # kept rows land on even slots, in shuffled order
    mixed_parents[slots] = parents[keep]
    mixed_tokens[slots] = tokens[keep]
    mixed_logits[slots] = logits[keep]
    if mixed_probs is not None:
        mixed_probs[slots] = draft_probs[keep]
    mixed_temp[slots] = temperature[keep]
    mixed_k[slots] = top_k[keep]
    mixed_p[slots] = top_p[keep]
    mixed_seed[slots] = seed[keep]
    mixed = verify(mixed_logits, mixed_tokens, mixed_parents, draft_probs=mixed_probs, temperature=mixed_temp, top_k=mixed_k, top_p=mixed_p, seed=mixed_seed)
    for field_full, field_mixed in zip(full, mixed):
        assert torch.equal(field_full[keep], field_mixed[slots])
    # A single row on its own.
    b = int(keep[0])
    alone = verify(logits[b : b + 1], tokens[b : b + 1], parents[b : b + 1], draft_probs=None if draft_probs is None else draft_probs[b : b + 1], temperature=temperature[b : b + 1], top_k=top_k[b : b + 1], top_p=top_p[b : b + 1], seed=seed[b : b + 1])
    for field_full, field_alone in zip(full, alone):
        assert torch.equal(field_full[b], field_alone[0])


@pytest.mark.parametrize("with_probs", [False, True], ids=["deterministic", "draft_probs"])
def test_int_seed_gives_each_row_its_own_stream(with_probs):
    batch, vocab = 64, 8
    logits = torch.zeros(batch, 4, vocab)  # uniform target: every row could emit anything
    parents = torch.tensor([-1, 0, 0, 1])
    tokens = torch.tensor([0, 1, 2, 3]).expand(batch, 4)
    # drafts twice as likely under q as under p: accepted half of the time
    draft_probs = torch.full((batch, 4, vocab), 0.5 / (vocab - 2))
    draft_probs[:, :, 1:4] = 2.0 / vocab
    draft_probs = draft_probs / draft_probs.sum(-1, keepdim=True) if with_probs else None
    out = verify(logits, tokens, parents, draft_probs=draft_probs, temperature=1.0, seed=42)
    rows = {tuple(out.output_tokens[b].tolist()) for b in range(batch)}
    assert len(rows) > 10, "rows with identical inputs and an int seed should get different streams"
    seeds = seeds_from_int(42, batch, "cpu")
    assert len(set(seeds.tolist())) == batch
    again = verify(logits, tokens, parents, draft_probs=draft_probs, temperature=1.0, seed=seeds)
    for a, b in zip(out, again):
        assert torch.equal(a, b)


def test_row_seeds_forms():
    """philox.row_seeds, the one place a `seed` argument becomes per-row seeds."""
    batch = 5
    assert torch.equal(row_seeds(42, batch, "cpu"), seeds_from_int(42, batch, "cpu"))
    given = torch.tensor([3, -7, 2**62, 0, 1], dtype=torch.int64)
    assert row_seeds(given, batch, torch.device("cpu")) is given  # used as given, no copy
    drawn = row_seeds(None, batch, "cpu")
    assert drawn.dtype == torch.int64 and drawn.shape == (batch,) and len(set(drawn.tolist())) == batch
    assert not torch.equal(drawn, row_seeds(None, batch, "cpu"))  # a fresh draw each call
    torch.manual_seed(11)
    first = row_seeds(None, batch, "cpu")
    torch.manual_seed(11)
    assert torch.equal(first, row_seeds(None, batch, "cpu"))  # from torch's global generator
    for bad in (1.5, True, "7", torch.zeros(batch, dtype=torch.int32), torch.zeros(batch + 1, dtype=torch.int64),
                torch.zeros(batch, 1, dtype=torch.int64), torch.zeros(batch, dtype=torch.int64, device="meta")):
        with pytest.raises(ValueError, match="^seed:"):
            row_seeds(bad, batch, "cpu")


# --------------------------------------------------------------------------------------------
# D. Bad input
# --------------------------------------------------------------------------------------------


def good_inputs(batch=3, num_nodes=5, vocab=7):
    logits = torch.randn(batch, num_nodes, vocab)
    parents = torch.tensor([-1, 0, 0, 1, -1]).expand(batch, num_nodes).clone()
    tokens = torch.tensor([1, 2, 3, 4, -1]).expand(batch, num_nodes).clone()
    draft_probs = torch.full((batch, num_nodes, vocab), 1.0 / vocab)
    return dict(target_logits=logits, tree_tokens=tokens, parents=parents, draft_probs=draft_probs)


def call(**overrides):
    args = good_inputs()
    args.update(overrides)
    positional = [args.pop(k) for k in ("target_logits", "tree_tokens", "parents")]
    return verify(*positional, **args)


def test_good_inputs_pass():
    call()
    call(draft_probs=None)


B, T, V = 3, 5, 7


def _bad_probs(spoil):
    """good_inputs()'s uniform draft probabilities with one row spoiled in place by `spoil`."""
    q = torch.full((B, T, V), 1.0 / V)
    spoil(q)
    return q


BAD_INPUTS = [
    # (id, overrides, the argument the error must name)
    ("logits-2d", dict(target_logits=torch.randn(B, V)), "target_logits"),
    ("logits-4d", dict(target_logits=torch.randn(B, T, V, 1)), "target_logits"),
    ("logits-T0", dict(target_logits=torch.randn(B, 0, V), tree_tokens=torch.zeros(B, 0, dtype=torch.int64), parents=torch.zeros(B, 0, dtype=torch.int64), draft_probs=None), "target_logits"),
    ("logits-V0", dict(target_logits=torch.randn(B, T, 0), draft_probs=None), "target_logits"),
    ("logits-int", dict(target_logits=torch.randint(0, 3, (B, T, V))), "target_logits"),
    ("logits-fp64", dict(target_logits=torch.randn(B, T, V, dtype=torch.float64)), "target_logits"),
    ("logits-not-tensor", dict(target_logits=[[[0.0] * V] * T] * B), "target_logits"),
    ("logits-last-dim-strided", dict(target_logits=torch.randn(B, T, 2 * V)[:, :, ::2]), "target_logits"),
    ("empty-batch", dict(target_logits=torch.randn(0, T, V), tree_tokens=torch.zeros(0, T, dtype=torch.int64), parents=torch.zeros(0, T, dtype=torch.int64), draft_probs=None), "target_logits"),
    ("tokens-shape", dict(tree_tokens=torch.zeros(B, T + 1, dtype=torch.int64)), "tree_tokens"),
    ("tokens-batch", dict(tree_tokens=torch.zeros(B + 1, T, dtype=torch.int64)), "tree_tokens"),
    ("tokens-1d", dict(tree_tokens=torch.zeros(T, dtype=torch.int64)), "tree_tokens"),
    ("tokens-float", dict(tree_tokens=torch.zeros(B, T)), "tree_tokens"),
    ("tokens-int16", dict(tree_tokens=torch.zeros(B, T, dtype=torch.int16)), "tree_tokens"),
    ("tokens-bool", dict(tree_tokens=torch.zeros(B, T, dtype=torch.bool)), "tree_tokens"),
    ("tokens-too-big", dict(tree_tokens=torch.tensor([[1, 2, 3, 4, -1], [1, 2, 7, 4, -1], [1, 2, 3, 4, -1]])), "tree_tokens"),
    ("tokens-negative", dict(tree_tokens=torch.tensor([[1, 2, 3, -1, -1]] * B)), "tree_tokens"),
    ("root-token-too-big", dict(tree_tokens=torch.tensor([[1, 2, 3, 4, -1], [V, 2, 3, 4, -1], [1, 2, 3, 4, -1]])), "tree_tokens"),
    ("root-token-negative", dict(tree_tokens=torch.tensor([[-2, 2, 3, 4, -1]] * B)), "tree_tokens"),
    ("parents-shape", dict(parents=torch.tensor([-1, 0, 0, 1])), "parents"),
    ("parents-batch", dict(parents=torch.tensor([[-1, 0, 0, 1, -1]] * (B + 1))), "parents"),
    ("parents-3d", dict(parents=torch.tensor([[-1, 0, 0, 1, -1]] * B)[:, :, None]), "parents"),
    ("parents-float", dict(parents=torch.tensor([[-1.0, 0, 0, 1, -1]] * B)), "parents"),
    ("parents-self", dict(parents=torch.tensor([[-1, 0, 2, 1, -1]] * B)), "parents"),
    ("parents-forward", dict(parents=torch.tensor([[-1, 0, 0, 4, -1]] * B)), "parents"),
    ("parents-below-minus-1", dict(parents=torch.tensor([[-1, 0, -2, 1, -1]] * B)), "parents"),
    ("root-parent-0", dict(parents=torch.tensor([[0, 0, 0, 1, -1]] * B)), "parents"),
    ("root-parent-in-one-row", dict(parents=torch.tensor([[-1, 0, 0, 1, -1], [-1, 0, 0, 1, -1], [2, 0, 0, 1, -1]])), "parents"),
    ("padding-not-trailing", dict(parents=torch.tensor([[-1, 0, -1, 1, -1]] * B)), "parents"),
    ("draft-probs-shape", dict(draft_probs=torch.full((B, T, V + 1), 0.1)), "draft_probs"),
    ("draft-probs-2d", dict(draft_probs=torch.full((B, T), 0.1)), "draft_probs"),
    ("draft-probs-int", dict(draft_probs=torch.ones(B, T, V, dtype=torch.int64)), "draft_probs"),
    ("draft-probs-fp64", dict(draft_probs=torch.full((B, T, V), 0.1, dtype=torch.float64)), "draft_probs"),
    ("duplicate-siblings", dict(tree_tokens=torch.tensor([[1, 2, 2, 4, -1]] * B), draft_probs=None), "tree_tokens"),
    # Rows of nodes with children (nodes 0 and 1 here) must be distributions (issue 16).
    ("draft-probs-nan", dict(draft_probs=_bad_probs(lambda q: q[1, 0, 3].fill_(float("nan")))), "draft_probs"),
    ("draft-probs-negative", dict(draft_probs=_bad_probs(lambda q: q[2, 1, :2].copy_(torch.tensor([-0.1, 0.1 + 2 / V])))), "draft_probs"),
    ("draft-probs-unnormalised", dict(draft_probs=_bad_probs(lambda q: q[0, 0].mul_(1.1))), "draft_probs"),
    ("draft-probs-logits", dict(draft_probs=torch.randn(B, T, V)), "draft_probs"),
    ("draft-probs-inf", dict(draft_probs=_bad_probs(lambda q: q[0, 1, 0].fill_(float("inf")))), "draft_probs"),
    ("temperature-negative", dict(temperature=-0.5), "temperature"),
    ("temperature-negative-row", dict(temperature=torch.tensor([1.0, -1.0, 0.0])), "temperature"),
    ("temperature-nan", dict(temperature=float("nan")), "temperature"),
    ("temperature-inf", dict(temperature=float("inf")), "temperature"),
    ("temperature-shape", dict(temperature=torch.ones(B + 1)), "temperature"),
    ("temperature-2d", dict(temperature=torch.ones(B, 1)), "temperature"),
    ("temperature-str", dict(temperature="hot"), "temperature"),
    ("top-p-zero", dict(top_p=0.0), "top_p"),
    ("top-p-above-1", dict(top_p=1.5), "top_p"),
    ("top-p-negative-row", dict(top_p=torch.tensor([0.5, -0.1, 1.0])), "top_p"),
    ("top-p-nan", dict(top_p=float("nan")), "top_p"),
    ("top-p-shape", dict(top_p=torch.full((B + 2,), 0.5)), "top_p"),
    ("top-k-negative", dict(top_k=-1), "top_k"),
    ("top-k-negative-row", dict(top_k=torch.tensor([0, 3, -2])), "top_k"),
    ("top-k-shape", dict(top_k=torch.ones(B - 1, dtype=torch.int64)), "top_k"),
    ("top-k-str", dict(top_k="3"), "top_k"),
    ("seed-shape", dict(seed=torch.zeros(B + 1, dtype=torch.int64)), "seed"),
    ("seed-2d", dict(seed=torch.zeros(B, 1, dtype=torch.int64)), "seed"),
    ("seed-int32", dict(seed=torch.zeros(B, dtype=torch.int32)), "seed"),
    ("seed-float-tensor", dict(seed=torch.zeros(B)), "seed"),
    ("seed-float", dict(seed=1.5), "seed"),
    ("seed-bool", dict(seed=True), "seed"),
    ("seed-str", dict(seed="42"), "seed"),
]


@pytest.mark.parametrize("overrides,name", [c[1:] for c in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_raises_naming_the_argument(overrides, name):
    with pytest.raises(ValueError, match=name):
        call(**overrides)


META_ARGS = [
    ("tree_tokens", lambda a: a["tree_tokens"].to("meta")),
    ("parents", lambda a: a["parents"].to("meta")),
    ("draft_probs", lambda a: a["draft_probs"].to("meta")),
    ("temperature", lambda a: torch.ones(B, device="meta")),
    ("top_k", lambda a: torch.ones(B, dtype=torch.int64, device="meta")),
    ("top_p", lambda a: torch.ones(B, device="meta")),
    ("seed", lambda a: torch.zeros(B, dtype=torch.int64, device="meta")),
]


@pytest.mark.parametrize("name,make", META_ARGS, ids=[m[0] for m in META_ARGS])
def test_tensor_on_other_device_raises(name, make):
    with pytest.raises(ValueError, match=name):
        call(**{name: make(good_inputs())})


def test_duplicate_siblings_allowed_with_draft_probs():
    out = call(tree_tokens=torch.tensor([[1, 2, 2, 4, -1]] * B))
    check_invariants(out, torch.tensor([[1, 2, 2, 4, -1]] * B), good_inputs()["parents"], V)


def test_draft_probs_rows_without_children_may_hold_anything():
    """Only the rows children were drawn from are checked: leaves and padding are never read."""
    args = good_inputs()  # children under nodes 0 and 1; nodes 2, 3 are leaves, node 4 padding
    clean = call(**args, seed=1)
    spoiled = args["draft_probs"].clone()
    spoiled[:, 2] = float("nan")
    spoiled[:, 3] = -1.0
    spoiled[:, 4] = 7.0
    out = call(**dict(args, draft_probs=spoiled), seed=1)
    for x, y in zip(out, clean):
        assert torch.equal(x, y)


@pytest.mark.parametrize("dtype, off", [(torch.float32, 9e-3), (torch.bfloat16, 0.0), (torch.float16, 0.0)], ids=str)
def test_draft_probs_tolerance(dtype, off):
    """Within the documented tolerance (1e-2 for every dtype) a row passes: softmax output
    rounded to 16 bits, and an fp32 row a little off; just past it, it does not."""
    gen = torch.Generator().manual_seed(5)
    q = torch.softmax(torch.randn(B, T, 50000, generator=gen) * 3, -1)
    q[:, :, 0] += off
    logits = torch.randn(B, T, 50000, generator=gen)
    tokens = torch.tensor([[1, 2, 3, 4, -1]] * B)
    parents = good_inputs()["parents"]
    verify(logits, tokens, parents, draft_probs=q.to(dtype), seed=2)
    tol = 1e-2
    q[:, :, 0] += 1.5 * tol
    with pytest.raises(ValueError, match="draft_probs.*sums to"):
        verify(logits, tokens, parents, draft_probs=q.to(dtype), seed=2)


def test_bad_draft_probs_accepted_with_value_checks_off():
    """Value checks off: no error, read as the reference reads them (NaN and negatives as 0)."""
    q = _bad_probs(lambda q: q[:, 0, 3].fill_(float("nan")))
    with specdec_kernels.config.value_checks(False):
        out = call(draft_probs=q, seed=3, backend="reference")
    check_invariants(out, good_inputs()["tree_tokens"], good_inputs()["parents"], V)


def test_padding_tokens_are_not_checked():
    """Padding nodes (parent -1 after the root) may hold any id, -1 or out of the vocabulary;
    the root may be -1 (no token: ngram_propose_tree's root for an empty history)."""
    tokens = torch.tensor([[1, 2, 3, 4, -1], [1, 2, 3, 4, V + 9], [-1, 2, 3, 4, -5]])
    out = call(tree_tokens=tokens, seed=4)
    check_invariants(out, tokens, good_inputs()["parents"], V)


def test_unknown_backend_raises():
    with pytest.raises(ValueError, match="backend"):
        call(backend="nope")


def test_cuda_backend_on_cpu_tensors_raises():
    with pytest.raises((ValueError, RuntimeError), match="cuda"):
        call(backend="cuda")


def test_reference_backend_accepted():
    args = good_inputs()
    a = call(backend="reference", seed=3, **args)
    b = call(backend=None, seed=3, **args)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


VERIFY_CHAIN_BAD = [
    ("draft-probs-nan", dict(draft_probs=torch.full((B, T - 1, V), 1.0 / V).index_fill_(2, torch.tensor([2]), float("nan"))), "draft_probs"),
    ("draft-probs-last-row-unnormalised", dict(draft_probs=torch.cat([torch.full((B, T - 2, V), 1.0 / V), torch.full((B, 1, V), 0.5)], 1)), "draft_probs"),
    ("draft-tokens-shape", dict(draft_tokens=torch.zeros(B, T, dtype=torch.int64)), "draft_tokens"),
    ("draft-tokens-float", dict(draft_tokens=torch.zeros(B, T - 1)), "draft_tokens"),
    ("draft-probs-shape", dict(draft_probs=torch.full((B, T, V), 0.1)), "draft_probs"),
    ("logits-2d", dict(target_logits=torch.randn(B, V)), "target_logits"),
    ("temperature-negative", dict(temperature=-1.0), "temperature"),
]


@pytest.mark.parametrize("overrides,name", [c[1:] for c in VERIFY_CHAIN_BAD], ids=[c[0] for c in VERIFY_CHAIN_BAD])
def test_verify_chain_bad_input(overrides, name):
    args = dict(target_logits=torch.randn(B, T, V), draft_tokens=torch.zeros(B, T - 1, dtype=torch.int64), draft_probs=None)
    args.update(overrides)
    with pytest.raises(ValueError, match=name):
        verify_chain(args.pop("target_logits"), args.pop("draft_tokens"), **args)


# --------------------------------------------------------------------------------------------
# Bugs found in specdec_kernels/verify.py input checking (fixed; these keep them fixed)
# --------------------------------------------------------------------------------------------


def test_draft_probs_not_a_tensor_raises_value_error():
    with pytest.raises(ValueError, match="draft_probs"):
        call(draft_probs=[[[0.1] * V] * T] * B)


@pytest.mark.parametrize(
    "draft_tokens",
    [torch.tensor([[1, 2, 9, 0]] * B), torch.tensor([[1, -1, 2, 0]] * B), torch.zeros(B, T - 1, dtype=torch.int64, device="meta")],
    ids=["too-big", "negative", "meta-device"],
)
def test_verify_chain_bad_draft_token_names_draft_tokens(draft_tokens):
    with pytest.raises(ValueError, match="draft_tokens"):
        verify_chain(torch.randn(B, T, V), draft_tokens)


@pytest.mark.parametrize("top_k", [2.5, torch.tensor([1.5, 2.0, 3.0])], ids=["float", "float-tensor"])
def test_non_integer_top_k_raises(top_k):
    with pytest.raises(ValueError, match="top_k"):
        call(top_k=top_k)


def test_tiny_temperature_does_not_overflow_into_ties():
    """logits / 1e-39 overflows fp32; the warp subtracts the row max first, so the largest
    logit keeps (almost) all the mass instead of every finite logit tying at +max."""
    rows = 400
    logits = torch.tensor([[[1.0, 2.0, 0.5]]]).expand(rows, 1, 3).contiguous()
    out = verify(logits, torch.zeros(rows, 1, dtype=torch.int64), torch.tensor([-1]), temperature=1e-39, seed=3)
    assert torch.equal(out.output_tokens[:, 0], torch.full((rows,), 1))
