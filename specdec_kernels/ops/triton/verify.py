"""Verification (batched rejection sampling over chains and token trees) in Triton, from logits.

Same rules and the same random numbers as `specdec_kernels.ops.reference.verify` (its module
docstring is the contract): greedy rows take the argmax (lowest id on ties); deterministic
drafts sample y ~ p with the exponential race and move to the child holding y; drafts with
probabilities run SpecInfer multi-step speculative sampling over the children in index order;
the uniforms are Philox4x32-10 draws keyed exactly like `specdec_kernels.ops.philox.uniform`, so on the
same inputs this kernel emits the same tokens as the reference, up to floating-point rounding
of the probabilities (a decision that sits within a few ulps of its threshold may go the other
way; the tests measure how rarely).

Work layout: one program per batch row walks its tree from the root, one node per step, and
loops over the vocabulary in blocks of BLOCK_V. Only the nodes on the accepted path (and the
node where the correction token is sampled) are read; the rest of the tree's logits are never
touched. Per visited node a sampled row makes these passes over the node's V logits:
  1. max / argmax (the greedy token; the row max that the softmax subtracts);
  2. top-k only: a bisection on the fp32 bit pattern of z = (x - max) / T for the k-th largest
     z (each step counts z >= mid and jumps to the nearest value actually present, so it
     converges in a handful of passes, at most 32); top-k then keeps every z >= it, ties
     included, exactly the reference's set;
  3. the softmax sum over the kept tokens (skipped for deterministic drafts without top-p:
     the race does not need normalised weights);
  4. top-p only: a bisection for the smallest probability s with mass(p > s) < top_p (keep v
     iff the mass of strictly more likely tokens is < top_p, the reference's rule), then the
     kept mass;
  5. deterministic drafts: the exponential race argmax_v p_v / E_v (Philox per token).
     Drafts with probabilities: per child, one scalar test u * q(x) < r(x); per rejected
     child one pass for the new residual mass; the race over the residual if all are rejected.
The SpecInfer residual after k rejections at a node is r_k = (p - c_k q)^+ / Z_k with scalars
c_{k+1} = c_k + Z_k, Z_k = sum (p - c_k q)^+ (c_0 = 0, Z_0 = 1): the same distribution as
normalising max(r - q, 0) k times, so it is never materialised; every pass recomputes p from
the logits. A residual mass <= 1e-5 counts as zero (see RESIDUAL_EPS; the reference tests
exact zero, which only its own bit-identical q reaches). The race reads Philox uniforms only for blocks whose largest weight could still
win (w_max / E_min >= best ratio so far, E_min = -log(1 - 2^-24) ~ 6e-8): Philox is ~70
integer ops per token, more than the bytes it would sit beside, and in real LLM distributions
most vocabulary blocks are far below that bar.

Bytes per visited node: V x elt of logits from HBM once (2 x 152k = 300 KB for Qwen2.5 in
bf16), the extra passes re-reading them from L2 (plus V x elt of draft probabilities with
draft_probs); greedy rows read each path node once. No host sync and no data-dependent
launch: one launch of B programs, so the call is CUDA-graph capturable.

Why per-row programs, not the vocabulary split over programs: every decision at a node needs a
reduction over the whole vocabulary (max, the top-k / top-p thresholds, the residual mass per
rejected sibling, the race), and the next node depends on it. Splitting V over programs means
either a launch per reduction (up to (passes x T) launches, a few us each, more than the whole
walk for a typical row) or a grid-wide barrier (deadlocks unless every program is resident,
and cannot run in the interpreter). The cost of this choice: a batch of a few rows keeps only
a few SMs busy, so small-batch calls are bound by one SM's bandwidth (tens of GB/s) rather than
the GPU's; with B >= the number of SMs every SM streams its own rows. This has not been
measured on a GPU yet (see bench/bench_verify.py).

Non-finite logits follow the reference: NaN is probability 0, +inf is clamped to the largest
float, and a node whose logits are all -inf/NaN emits token 0. Emitted ids are always in [0, V).
"""

import torch
import triton
import triton.language as tl

from .tree_attention import _on_device

try:  # accurate logf on the GPU (tl.log may lower to the approximate lg2)
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - very old triton
    libdevice = None

FP32_MAX: tl.constexpr = tl.constexpr(3.4028234663852886e38)
INT32_MIN: tl.constexpr = tl.constexpr(-2147483648)
INT32_MAX: tl.constexpr = tl.constexpr(2147483647)
# 1 / E_min with a margin: E = -log(u) >= -log(1 - 2^-24) ~ 5.96e-8 for every uniform we draw.
INV_E_MIN: tl.constexpr = tl.constexpr(2.0e7)
# A residual mass max(r - q, 0) at or below this is rounding noise (r == q): the reference's
# "sums to zero" rule. p is recomputed here with other rounding than whoever computed q (the
# reference, a draft model running the same weights), so r - q of an exact copy is not exactly 0
# but a few ulps per token, < 1e-6 in all; treating up to 1e-5 as zero changes a decision only
# where the true rejected mass is below 1e-5, i.e. with probability < 1e-5 per rejection.
RESIDUAL_EPS: tl.constexpr = tl.constexpr(1e-5)
PURPOSE_ACCEPT: tl.constexpr = tl.constexpr(0)
PURPOSE_SAMPLE: tl.constexpr = tl.constexpr(1)


def interpreted() -> bool:
    """Whether these kernels were built for the Triton interpreter (TRITON_INTERPRET=1 at import)."""
    return not isinstance(_verify_kernel, triton.runtime.JITFunction)


# ----------------------------------------------------------------------------- random numbers


@triton.jit
def _philox_word0(k0, k1, c0, c1, c2, c3):
    """Word 0 of Philox4x32-10 (uint32 counters and key), as `specdec_kernels.ops.philox.philox4x32_10`."""
    M0: tl.constexpr = 0xD2511F53
    M1: tl.constexpr = 0xCD9E8D57
    W0: tl.constexpr = 0x9E3779B9
    W1: tl.constexpr = 0xBB67AE85
    for _ in tl.static_range(10):
        hi0 = tl.umulhi(c0, M0)
        hi1 = tl.umulhi(c2, M1)
        lo0 = c0 * M0  # uint32: wraps modulo 2^32, the low half of the product
        lo1 = c2 * M1
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = k0 + W0
        k1 = k1 + W1
    return c0


@triton.jit
def _uniform(k0, k1, node, PURPOSE: tl.constexpr, index):
    """fp32 uniforms in (0, 1) of (seed, node, purpose, index): `specdec_kernels.ops.philox.uniform`."""
    zero = k0 * 0  # uint32 scalar
    word = _philox_word0(k0, k1, zero + index, zero + node, zero + PURPOSE, zero)
    return ((word >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2^-23


@triton.jit
def _exponential(u, ACCURATE_LOG: tl.constexpr):
    """E = -log(u) in fp32, correctly rounded-ish on the GPU: the race compares w / E, and an
    approximate log near u = 1 (E ~ 1e-7) would change which token wins."""
    if ACCURATE_LOG:
        return -libdevice.log(u)
    else:
        return -tl.log(u)


# ----------------------------------------------------------------------------- the warped target


@triton.jit
def _sanitize(x):
    """fp32 logits: NaN -> -inf (probability 0), +inf -> the largest finite float."""
    x = tl.where(x != x, float("-inf"), x)
    return tl.minimum(x, FP32_MAX)


@triton.jit
def _scaled(x, m_ref, temp):
    """z = (x - row max) / T, IEEE-rounded like the reference (top-k ties are decided on z);
    + 0.0 turns -0.0 into +0.0 so the bit-pattern keys order z like float comparison does."""
    return tl.math.div_rn(x - m_ref, temp) + 0.0


@triton.jit
def _ordered(z):
    """int32 key with the order of the fp32 values (for bisection on bit patterns)."""
    bits = z.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _target_p(x, offs, m_ref, temp, kth_key, norm, nothing_left, p_key, norm2):
    """Probabilities of the warped target at token ids `offs` from their sanitized logits x.

    kth_key: top-k keeps ordered(z) >= kth_key (INT32_MIN: off); norm: the softmax sum over
    the top-k set; nothing_left: every logit is -inf/NaN (token 0 gets all the mass); p_key:
    top-p keeps p with bit pattern >= p_key (0: off); norm2: the kept mass (1: off).
    """
    z = _scaled(x, m_ref, temp)
    z = tl.where(_ordered(z) >= kth_key, z, float("-inf"))
    p = tl.math.div_rn(tl.exp(z), norm)
    p = tl.where(nothing_left, tl.where(offs == 0, 1.0, 0.0), p)
    p = tl.where(p.to(tl.int32, bitcast=True) >= p_key, p, 0.0)
    return tl.math.div_rn(p, norm2)


@triton.jit
def _draft_q(q):
    """Draft probabilities as the reference reads them: NaN -> 0, +inf -> max, negatives -> 0."""
    q = tl.where(q != q, 0.0, q)
    return tl.maximum(tl.minimum(q, FP32_MAX), 0.0)


@triton.jit
def _row_max(row_ptr, vocab, BLOCK_V: tl.constexpr):
    """(max, argmax) of a node's sanitized logits; lowest id on ties, 0 when all are -inf."""
    best = tl.full([], float("-inf"), tl.float32)
    best_idx = tl.full([], 0, tl.int32)
    for start in range(0, vocab, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        x = _sanitize(tl.load(row_ptr + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32))
        m = tl.max(x, 0)
        i = tl.argmax(x, 0, tie_break_left=True).to(tl.int32) + start
        better = m > best
        best_idx = tl.where(better, i, best_idx)
        best = tl.where(better, m, best)
    return best, best_idx


@triton.jit
def _top_k_key(row_ptr, vocab, m_ref, temp, k, BLOCK_V: tl.constexpr):
    """ordered(z_k), z_k the k-th largest z: the largest key t with count(key >= t) >= k.

    Invariant count(key >= lo) >= k > count(key >= hi); each pass tests the midpoint and jumps
    lo up to the smallest key present at or above it, or hi down to just above the largest key
    present below it, so the bracket only holds keys that occur.
    """
    lo = tl.full([], INT32_MIN, tl.int64)
    hi = tl.full([], 1, tl.int64)  # ordered(+0.0) + 1: z <= 0 = z of the row max
    while hi - lo > 1:
        mid = lo + (hi - lo) // 2
        count = tl.full([], 0, tl.int64)
        min_ge = tl.full([], INT32_MAX, tl.int64)
        max_lt = tl.full([], INT32_MIN, tl.int64)
        for start in range(0, vocab, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            valid = offs < vocab
            x = _sanitize(tl.load(row_ptr + offs, mask=valid, other=float("-inf")).to(tl.float32))
            key = _ordered(_scaled(x, m_ref, temp)).to(tl.int64)
            ge = valid & (key >= mid)
            count += tl.sum(ge.to(tl.int64), 0)
            min_ge = tl.minimum(min_ge, tl.min(tl.where(ge, key, INT32_MAX), 0))
            max_lt = tl.maximum(max_lt, tl.max(tl.where(valid & ~ge, key, INT32_MIN), 0))
        enough = count >= k
        lo = tl.where(enough, min_ge, lo)
        hi = tl.where(enough, hi, max_lt + 1)
    return lo.to(tl.int32)


@triton.jit
def _softmax_sum(row_ptr, vocab, m_ref, temp, kth_key, BLOCK_V: tl.constexpr):
    """sum of exp(z) over the top-k set (z <= 0, so no overflow)."""
    total = tl.zeros([BLOCK_V], tl.float32)
    for start in range(0, vocab, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        x = _sanitize(tl.load(row_ptr + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32))
        z = _scaled(x, m_ref, temp)
        total += tl.where(_ordered(z) >= kth_key, tl.exp(z), 0.0)
    return tl.sum(total, 0)


@triton.jit
def _top_p_key(row_ptr, vocab, m_ref, temp, kth_key, norm, nothing_left, top_p, p_max, BLOCK_V: tl.constexpr):
    """Bit pattern of the smallest kept probability: the smallest key t (p >= 0, so fp32 bits
    order like values) with mass(key > t) < top_p. Keep v iff bits(p_v) >= it, i.e. iff the mass
    of strictly more likely tokens is < top_p. Invariant: the answer is in [lo, hi]."""
    lo = tl.full([], 0, tl.int64)
    hi = p_max.to(tl.int32, bitcast=True).to(tl.int64)  # mass above the max is 0 < top_p
    while lo < hi:
        mid = lo + (hi - lo) // 2
        mass = tl.zeros([BLOCK_V], tl.float32)
        min_gt = tl.full([], INT32_MAX, tl.int64)
        max_le = tl.full([], -1, tl.int64)
        for start in range(0, vocab, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            valid = offs < vocab
            x = _sanitize(tl.load(row_ptr + offs, mask=valid, other=float("-inf")).to(tl.float32))
            p = _target_p(x, offs, m_ref, temp, kth_key, norm, nothing_left, 0, 1.0)
            key = p.to(tl.int32, bitcast=True).to(tl.int64)
            gt = valid & (key > mid)
            mass += tl.where(gt, p, 0.0)
            min_gt = tl.minimum(min_gt, tl.min(tl.where(gt, key, INT32_MAX), 0))
            max_le = tl.maximum(max_le, tl.max(tl.where(valid & ~gt, key, -1), 0))
        small = tl.sum(mass, 0) < top_p
        hi = tl.where(small, tl.maximum(max_le, lo), hi)
        lo = tl.where(small, lo, min_gt)
    return lo.to(tl.int32)


@triton.jit
def _kept_mass(row_ptr, vocab, m_ref, temp, kth_key, norm, nothing_left, p_key, BLOCK_V: tl.constexpr):
    total = tl.zeros([BLOCK_V], tl.float32)
    for start in range(0, vocab, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        valid = offs < vocab
        x = _sanitize(tl.load(row_ptr + offs, mask=valid, other=float("-inf")).to(tl.float32))
        p = _target_p(x, offs, m_ref, temp, kth_key, norm, nothing_left, p_key, 1.0)
        total += tl.where(valid, p, 0.0)
    return tl.sum(total, 0)


@triton.jit
def _residual_mass(row_ptr, q_row_ptr, vocab, m_ref, temp, kth_key, norm, nothing_left, p_key, norm2, c,
                   BLOCK_V: tl.constexpr):
    """Z(c) = sum_v max(p_v - c q_v, 0)."""
    total = tl.zeros([BLOCK_V], tl.float32)
    for start in range(0, vocab, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        valid = offs < vocab
        x = _sanitize(tl.load(row_ptr + offs, mask=valid, other=float("-inf")).to(tl.float32))
        p = _target_p(x, offs, m_ref, temp, kth_key, norm, nothing_left, p_key, norm2)
        q = _draft_q(tl.load(q_row_ptr + offs, mask=valid, other=0.0).to(tl.float32))
        total += tl.where(valid, tl.maximum(p - c * q, 0.0), 0.0)
    return tl.sum(total, 0)


@triton.jit
def _race(row_ptr, q_row_ptr, vocab, k0, k1, node, m_ref, temp, kth_key, norm, nothing_left, p_key, norm2,
          c, z_res, warm_idx, HAS_Q: tl.constexpr, BLOCK_V: tl.constexpr, ACCURATE_LOG: tl.constexpr):
    """argmax_v w_v / E_v (lowest id on ties), w = p, or the residual (p - c q)^+ / Z when c > 0.

    Starts from the ratio of `warm_idx` (the most likely token) and skips the Philox draws of
    every block whose largest weight cannot reach the best ratio even with the smallest E.
    """
    use_residual = c > 0.0
    x_warm = _sanitize(tl.load(row_ptr + warm_idx).to(tl.float32))
    w_warm = _target_p(x_warm, warm_idx, m_ref, temp, kth_key, norm, nothing_left, p_key, norm2)
    if HAS_Q:
        q_warm = _draft_q(tl.load(q_row_ptr + warm_idx).to(tl.float32))
        w_warm = tl.where(use_residual, tl.math.div_rn(tl.maximum(w_warm - c * q_warm, 0.0), z_res), w_warm)
    e_warm = _exponential(_uniform(k0, k1, node, PURPOSE_SAMPLE, warm_idx.to(tl.uint32)), ACCURATE_LOG)
    best = tl.math.div_rn(w_warm, e_warm)
    best_idx = warm_idx
    for start in range(0, vocab, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        valid = offs < vocab
        x = _sanitize(tl.load(row_ptr + offs, mask=valid, other=float("-inf")).to(tl.float32))
        w = _target_p(x, offs, m_ref, temp, kth_key, norm, nothing_left, p_key, norm2)
        if HAS_Q:
            q = _draft_q(tl.load(q_row_ptr + offs, mask=valid, other=0.0).to(tl.float32))
            w = tl.where(use_residual, tl.math.div_rn(tl.maximum(w - c * q, 0.0), z_res), w)
        w = tl.where(valid, w, 0.0)
        if tl.max(w, 0) * INV_E_MIN >= best:
            e = _exponential(_uniform(k0, k1, node, PURPOSE_SAMPLE, offs.to(tl.uint32)), ACCURATE_LOG)
            ratio = tl.where(valid, tl.math.div_rn(w, e), -1.0)
            r_max = tl.max(ratio, 0)
            r_idx = tl.argmax(ratio, 0, tie_break_left=True).to(tl.int32) + start
            better = (r_max > best) | ((r_max == best) & (r_idx < best_idx))
            best_idx = tl.where(better, r_idx, best_idx)
            best = tl.where(better, r_max, best)
    return best_idx


# ----------------------------------------------------------------------------- the walk


@triton.jit
def _verify_kernel(
    logits_ptr, tokens_ptr, parents_ptr, q_ptr,
    temp_ptr, top_k_ptr, top_p_ptr, seed_ptr,
    accepted_ptr, num_accepted_ptr, out_tokens_ptr,
    stride_lb, stride_lt, stride_qb, stride_qt,
    stride_tb, stride_tt, stride_pb, stride_pt,
    num_nodes, vocab,
    HAS_Q: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_T: tl.constexpr, ACCURATE_LOG: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    temperature = tl.load(temp_ptr + b)
    greedy = temperature == 0.0
    temp = tl.where(greedy, 1.0, temperature)
    top_k = tl.load(top_k_ptr + b)
    top_p = tl.load(top_p_ptr + b)
    use_top_k = (top_k > 0) & (top_k < vocab)
    use_top_p = top_p < 1.0
    seed = tl.load(seed_ptr + b)
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)

    nodes = tl.arange(0, BLOCK_T)
    node_ok = nodes < num_nodes
    parents = tl.load(parents_ptr + b * stride_pb + nodes * stride_pt, mask=node_ok, other=-2)
    tokens = tl.load(tokens_ptr + b * stride_tb + nodes * stride_tt, mask=node_ok, other=-1)
    out_row = out_tokens_ptr + b * num_nodes
    acc_row = accepted_ptr + b * num_nodes

    cur = tl.full([], 0, tl.int32)
    num_acc = tl.full([], 0, tl.int32)
    done = tl.full([], 0, tl.int32)
    for _step in range(0, num_nodes):  # at most T - 1 moves and one stop
        if done == 0:
            row_ptr = logits_ptr + b * stride_lb + cur * stride_lt
            q_row_ptr = q_ptr + b * stride_qb + cur * stride_qt
            row_max, argmax = _row_max(row_ptr, vocab, BLOCK_V)
            nxt = tl.full([], -1, tl.int32)
            emitted = argmax
            if greedy:
                hit = (parents == cur) & (tokens == argmax) & (nodes > 0)
                first = tl.min(tl.where(hit, nodes, BLOCK_T), 0)
                nxt = tl.where(first < BLOCK_T, first, -1)
            else:
                nothing_left = row_max == float("-inf")
                m_ref = tl.where(nothing_left, 0.0, row_max)
                kth_key = tl.full([], INT32_MIN, tl.int32)
                if use_top_k & (nothing_left == 0):
                    kth_key = _top_k_key(row_ptr, vocab, m_ref, temp, top_k, BLOCK_V)
                norm = tl.full([], 1.0, tl.float32)
                if (HAS_Q | use_top_p | use_top_k) & (nothing_left == 0):
                    norm = _softmax_sum(row_ptr, vocab, m_ref, temp, kth_key, BLOCK_V)
                p_key = tl.full([], 0, tl.int32)
                norm2 = tl.full([], 1.0, tl.float32)
                if use_top_p & (nothing_left == 0):
                    x_max = _sanitize(tl.load(row_ptr + argmax).to(tl.float32))
                    p_max = _target_p(x_max, argmax, m_ref, temp, kth_key, norm, nothing_left, 0, 1.0)
                    p_key = _top_p_key(row_ptr, vocab, m_ref, temp, kth_key, norm, nothing_left, top_p, p_max,
                                       BLOCK_V)
                    norm2 = _kept_mass(row_ptr, vocab, m_ref, temp, kth_key, norm, nothing_left, p_key, BLOCK_V)
                c = tl.full([], 0.0, tl.float32)
                z_res = tl.full([], 1.0, tl.float32)
                if HAS_Q:
                    # SpecInfer: children in index order (children come after their parent).
                    for j in range(cur + 1, num_nodes):
                        parent_j = tl.load(parents_ptr + b * stride_pb + j * stride_pt)
                        if (nxt < 0) & (parent_j == cur):
                            x_id = tl.load(tokens_ptr + b * stride_tb + j * stride_tt)
                            x_id = tl.minimum(tl.maximum(x_id, 0), vocab - 1)
                            u = _uniform(k0, k1, j, PURPOSE_ACCEPT, k0 * 0)
                            q_x = _draft_q(tl.load(q_row_ptr + x_id).to(tl.float32))
                            x_x = _sanitize(tl.load(row_ptr + x_id).to(tl.float32))
                            p_x = _target_p(x_x, x_id, m_ref, temp, kth_key, norm, nothing_left, p_key, norm2)
                            r_x = tl.math.div_rn(tl.maximum(p_x - c * q_x, 0.0), z_res)
                            if u * q_x < r_x:
                                nxt = j
                            else:
                                c_new = c + z_res
                                z_new = _residual_mass(row_ptr, q_row_ptr, vocab, m_ref, temp, kth_key, norm,
                                                       nothing_left, p_key, norm2, c_new, BLOCK_V)
                                # mass 0 (r == q up to rounding): the residual stays as it is
                                moved = z_new > RESIDUAL_EPS
                                c = tl.where(moved, c_new, c)
                                z_res = tl.where(moved, z_new, z_res)
                    if nxt < 0:
                        emitted = _race(row_ptr, q_row_ptr, vocab, k0, k1, cur, m_ref, temp, kth_key, norm,
                                        nothing_left, p_key, norm2, c, z_res, argmax, HAS_Q, BLOCK_V, ACCURATE_LOG)
                else:
                    emitted = _race(row_ptr, q_row_ptr, vocab, k0, k1, cur, m_ref, temp, kth_key, norm,
                                    nothing_left, p_key, norm2, c, z_res, argmax, HAS_Q, BLOCK_V, ACCURATE_LOG)
                    hit = (parents == cur) & (tokens == emitted) & (nodes > 0)
                    first = tl.min(tl.where(hit, nodes, BLOCK_T), 0)
                    nxt = tl.where(first < BLOCK_T, first, -1)
            if nxt >= 0:
                tl.store(out_row + num_acc, tl.load(tokens_ptr + b * stride_tb + nxt * stride_tt))
                tl.store(acc_row + num_acc + 1, nxt)
                num_acc += 1
                cur = nxt
            else:
                tl.store(out_row + num_acc, emitted.to(tl.int64))
                done = 1
    tl.store(num_accepted_ptr + b, num_acc)


def launch_config(vocab: int):
    """(BLOCK_V, num_warps): 2048-token blocks over 4 warps, 16 tokens per thread.

    Chosen from `python -m specdec_kernels.ops.triton.compile_check verify` (ptxas register and
    spill counts, no GPU timing yet): wider programs (8-16 warps) get capped at 64-80 registers
    by ptxas and spill 24-100 bytes in the Philox / bisection loops; 2048 x 4 warps compiles
    without spills except 16 bytes on sm_80 with fp32/fp16 logits and no draft probabilities.
    """
    return min(2048, max(128, triton.next_power_of_2(vocab))), 4


def verify(target_logits, tree_tokens, parents, draft_probs, temperature, top_k, top_p, seed):
    """Same normalised arguments and result as `specdec_kernels.ops.reference.verify`.

    target_logits [B, T, V] fp32/bf16/fp16 (contiguous last dim); tree_tokens int64 [B, T];
    parents int [B, T] (any strides, e.g. a broadcast [T]); draft_probs [B, T, V] or None;
    temperature fp32 [B]; top_k int64 [B]; top_p fp32 [B]; seed int64 [B].
    Returns (accepted_nodes int32 [B, T], num_accepted int32 [B], output_tokens int64 [B, T]).
    """
    batch, num_nodes, vocab = target_logits.shape
    device = target_logits.device
    is_interpreted = interpreted()
    if device.type != "cuda" and not is_interpreted:
        raise RuntimeError(
            "backend='triton' on CPU tensors runs only under the Triton interpreter: set TRITON_INTERPRET=1 "
            "before specdec_kernels.ops.triton is first imported"
        )
    if target_logits.stride(-1) != 1:
        target_logits = target_logits.contiguous()
    if is_interpreted and target_logits.dtype == torch.bfloat16:
        target_logits = target_logits.float()  # the interpreter (numpy) has no bf16
    has_q = draft_probs is not None
    if has_q:
        if draft_probs.stride(-1) != 1:
            draft_probs = draft_probs.contiguous()
        if is_interpreted and draft_probs.dtype == torch.bfloat16:
            draft_probs = draft_probs.float()
    q = draft_probs if has_q else target_logits  # unused when HAS_Q is False
    tree_tokens = tree_tokens.to(torch.int64)
    parents = parents.to(torch.int64)
    temperature = temperature.to(torch.float32).contiguous()
    top_k = top_k.to(torch.int64).contiguous()
    top_p = top_p.to(torch.float32).contiguous()
    seed = seed.to(torch.int64).contiguous()

    accepted = torch.full((batch, num_nodes), -1, dtype=torch.int32, device=device)
    accepted[:, 0] = 0
    num_accepted = torch.empty(batch, dtype=torch.int32, device=device)
    output_tokens = torch.full((batch, num_nodes), -1, dtype=torch.int64, device=device)
    block_v, num_warps = launch_config(vocab)
    with _on_device(device):  # Triton launches on the current device, not the tensors'
        _verify_kernel[(batch,)](
            target_logits, tree_tokens, parents, q,
            temperature, top_k, top_p, seed,
            accepted, num_accepted, output_tokens,
            target_logits.stride(0), target_logits.stride(1), q.stride(0), q.stride(1),
            tree_tokens.stride(0), tree_tokens.stride(1), parents.stride(0), parents.stride(1),
            num_nodes, vocab,
            HAS_Q=has_q, BLOCK_V=block_v, BLOCK_T=max(2, triton.next_power_of_2(num_nodes)),
            ACCURATE_LOG=(not is_interpreted) and libdevice is not None,
            num_warps=num_warps,
        )
    return accepted, num_accepted, output_tokens
