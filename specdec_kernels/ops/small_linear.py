"""Few-row linears on a CPU: our `small_linear` kernel where it is measured faster.

A decoding step multiplies every weight matrix by a handful of rows (B rows, times the tree's
T tokens when verifying). That job is bandwidth-bound: the weights are read once whatever the
row count, so 1-16 rows should cost about what reading the weights costs. `F.linear` does not
get there on every CPU BLAS: with torch 2.13's MKL on an AMD EPYC (AVX2, 2 threads) one row
ran single-threaded at ~10 GB/s and 2-16 rows ~2-3x slower still (SmolLM2-135M's LM head,
113 MB: 10 ms for 1 row, 23-30 ms for 2-16). `torch.ops.specdec.small_linear`
(`csrc/include/specdec/small_linear.h`) streams each weight row once for all rows, split over
torch's threads: 6 ms for 1 row, 6-13 ms for 2-16 on the same machine. On a CPU with AVX-512
it runs 16-lane blocks of 4 weight rows x 4 input rows and prefetches the weights 18 KB ahead:
on one core of a Xeon (memory ~14 GB/s) the default model's 211 weights (538 MB) took 39 /
40 / 43 / 54 ms for 1 / 2 / 4 / 8 rows, `F.linear` 40 / 41 / 69 / 93 ms in the same run.
On an AVX2 CPU, 8 and 11+ rows (where the product is bound by the FMAs, not the weight reads)
run a packed-panel kernel instead: x packed in panels of 8 rows, each weight broadcast into
them, up to ~90% of the FMA peak in a standalone harness (docs/loop.md, "Products of 8+ rows near the FMA peak"). A row's
sums never depend on the rows beside it at a given row count; between 1-7 rows and 8 or 11+
they round differently.

With AVX2 and 1-7 rows the weight rows are read one after another (one memory stream), each
weight vector multiplied into every row. `small_linear_argmax` gives each row's greedy token of
the product (fp32 or bf16) from an int8 copy of the weights (one byte per weight) and exact
per-row bounds (`argmax_weights`), then the few candidates' exact logits: the same token as the
full product's, bit for bit (greedy decoding's LM head, docs/loop.md).

Which is faster depends on the BLAS, the CPU and the row count, so nothing is assumed:
`choose_small_linear_rows` times a module's own weights both ways and keeps the range of row
counts at which ours won (`(0, 0)`: none). The cost model's calibration
(`cost_model.calibrate`) makes that choice for the target, and `generate` runs the target
inside `small_linears(target, rows)`; head drafters make it for their head. fp32 and bf16
CPU linears qualify (the kernel's two dtypes). The two compute the same sums in a different
order (as any two BLAS kernels may): fp32 results agree to fp32 rounding, and greedy outputs
stay identical to HF's wherever they did before (tested against HF `generate`).

bf16 (weights and inputs bf16, sums in fp32, one rounding to bf16): on a CPU with
AVX512-BF16 the kernel multiplies the stored bf16 weights directly (VDPBF16PS). torch 2.13's
bf16 `F.linear` on such a CPU (Xeon with AMX, 2 threads) ran few-row products below the
fp32 ones' speed (a 1536x576 weight, 1 row: ~60 us bf16 vs ~37 us fp32), so half the bytes
bought nothing there; the measured numbers of ours are in docs/loop.md ("bf16 targets on a CPU"). A bf16
sum may round to the other neighbouring bf16 value than `F.linear`'s (a different order of
fp32 additions before the one rounding); greedy bf16 decoding is therefore compared with HF
up to ties within bf16 rounding (python_tests/test_bf16.py).
"""

import contextlib
import math
import time
from functools import partial
from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

LAYOUT_ROWS = (1, 2, 4, 8, 16, 32, 64, 128)  # row counts at which the two are compared (128: batch-8 trees of 16)
DTYPES = (torch.float32, torch.bfloat16)  # what the kernel computes in
NEVER = (0, 0)
_MARGIN = 0.97  # ours must be at least 3% faster to be chosen (noise is not a win)
_LOSS = 1.10  # ...and more than 10% slower to end a run of wins (see choose_small_linear_rows)


def has_kernel() -> bool:
    """Whether the compiled `specdec::small_linear` CPU kernel is loaded."""
    from ._extension import _C

    return _C is not None and hasattr(torch.ops.specdec, "small_linear")


def small_linear(x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` by our CPU kernel: x [..., K], weight [N, K], bias [N] or
    None, CPU tensors all fp32 or all bf16 -> [..., N] in their dtype, contiguous (bf16: sums
    in fp32, rounded once)."""
    out = torch.ops.specdec.small_linear(x.reshape(-1, x.shape[-1]), weight, bias)
    return out.view(*x.shape[:-1], weight.shape[0])


def argmax_weights(weight: torch.Tensor, out: Optional[torch.Tensor] = None) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """(weight_int8, row_stats) for `small_linear_argmax` from a float32 or bfloat16 weight
    [V, K] (an LM head's): an int8 copy q (into `out`, a contiguous int8 [V, K] tensor, when
    given), w^_v = s_v * q_v with s_v = max |w_v| / 127 (round to nearest), and row_stats,
    float32 [3, V]: the scales s_v, e_v and n_v, with |x . w_v - x^ . w^_v| <= ||x|| * e_v +
    ||x - x^|| * n_v for any x (x^ its int16 rounding in the kernel), exact sums:
    e_v = (||w_v - w^_v|| + gamma * ||w_v||) * (1 + 2^-10) (gamma = 2 K 2^-24: the exact
    product's fp32 summation error in any order, |error| <= gamma * ||x|| * ||w_v||) and
    n_v = ||w^_v|| * (1 + 2^-10), both rounded up to floats. None where a weight is not finite."""
    if weight.dtype not in DTYPES or weight.dim() != 2 or weight.device.type != "cpu":
        raise ValueError(f"argmax_weights: weight must be a float32 or bfloat16 CPU [V, K] tensor, got {weight.dtype} "
                         f"{tuple(weight.shape)} on {weight.device}")
    vocab, k_dim = weight.shape
    if out is None:
        out = torch.empty(vocab, k_dim, dtype=torch.int8)
    elif out.dtype != torch.int8 or tuple(out.shape) != (vocab, k_dim) or not out.is_contiguous():
        raise ValueError(f"argmax_weights: out must be a contiguous int8 [{vocab}, {k_dim}] tensor")
    gamma = 2.0 * k_dim * 2.0 ** -24
    stats = torch.empty(3, vocab, dtype=torch.float64)
    with torch.no_grad():
        for start in range(0, vocab, 4096):  # (chunks: float64 copies of the whole weight would be 8x its memory)
            w = weight[start: start + 4096].double()
            peak = w.abs().amax(1)
            if not bool(torch.isfinite(peak).all()):
                return None
            scale = (peak / 127).float()
            scale[scale == 0] = 1.0  # (a row of zeros: q = 0, exact)
            q = torch.round(w / scale.double()[:, None]).clamp(-127, 127)
            out[start: start + 4096].copy_(q.to(torch.int8))
            w_hat = q * scale.double()[:, None]  # exact in float64
            stats[0, start: start + 4096] = scale.double()
            stats[1, start: start + 4096] = ((w - w_hat).norm(dim=1) + gamma * w.norm(dim=1)) * (1 + 2.0 ** -10)
            stats[2, start: start + 4096] = w_hat.norm(dim=1) * (1 + 2.0 ** -10)
    if not bool(torch.isfinite(stats).all()):
        return None
    row_stats = stats.float()
    low = row_stats.double() < stats  # rounded down: the next float up (the scales are floats already)
    row_stats[low] = torch.nextafter(row_stats[low], torch.tensor(float("inf")))
    return out, row_stats


def small_linear_argmax(x: torch.Tensor, weight: torch.Tensor, weight_int8: torch.Tensor,
                        row_stats: torch.Tensor) -> torch.Tensor:
    """int64 [...]: each row's greedy token of `small_linear(x, weight)` (x [..., K], weight
    [V, K], CPU tensors both float32 or both bfloat16, no bias) by `verify`'s rule
    (`sampling.greedy_tokens` of the logits as float32: lowest id on ties, NaN never wins), the
    same token bit for bit, from one byte per weight: (weight_int8, row_stats) =
    `argmax_weights(weight)`. A first pass multiplies x, rounded to int16 per row, by the int8
    copy in exact integer sums; every token whose bound reaches the largest lower end (bf16:
    less the reach of a tie after rounding to bf16) is a candidate; the candidates' exact
    logits come from small_linear's kernel at x's row count
    (csrc/include/specdec/small_linear_argmax.h). Rows whose bound cannot decide (non-finite
    values, over 1024 candidates) take the full product."""
    out = torch.ops.specdec.small_linear_argmax(x.reshape(-1, x.shape[-1]), weight, weight_int8, row_stats)
    return out.view(x.shape[:-1])


def routed_linear(x: torch.Tensor, weight: torch.Tensor, bias, rows_range: Tuple[int, int]) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, by `small_linear` when x has weight's dtype (fp32 or bf16)
    and rows_range[0] to rows_range[1] rows (all dims but the last), else by `F.linear` itself."""
    rows = x.numel() // max(x.shape[-1], 1)
    if (rows_range[0] <= rows <= rows_range[1] and x.dtype == weight.dtype and x.dtype in DTYPES
            and (bias is None or bias.dtype == x.dtype)):
        return small_linear(x, weight, bias)
    if x.dim() > 2 and not x.is_contiguous():
        # F.linear folds a contiguous [..., K] input into one matrix product, but a strided one
        # (a slice of a tree's nodes) goes through bmm with the weight expanded and copied per
        # batch row: 33 ms for a [4, 2, 576] x 8192-row bf16 LM head, against 1 ms this way.
        return F.linear(x.reshape(-1, x.shape[-1]), weight, bias).view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


def _forward(module: torch.nn.Linear, rows_range: Tuple[int, int], x: torch.Tensor) -> torch.Tensor:
    return routed_linear(x, module.weight, module.bias, rows_range)


def _qualifies(module) -> bool:
    # Exactly torch.nn.Linear (subclasses, quantized or sharded linears keep their own
    # forward), fp32 or bf16 weights on the CPU, not already patched.
    return (type(module) is torch.nn.Linear and module.weight.dtype in DTYPES
            and (module.bias is None or module.bias.dtype == module.weight.dtype)
            and module.weight.device.type == "cpu" and "forward" not in module.__dict__)


@contextlib.contextmanager
def small_linears(model: torch.nn.Module, rows_range: Tuple[int, int]):
    """Inside the block, `model`'s fp32 and bf16 CPU `torch.nn.Linear` layers compute inputs of
    rows_range[0] to rows_range[1] rows (rows = all dims but the last) with `small_linear`,
    any other input with `F.linear`. `(0, 0)` (or no compiled kernel): no change. The
    modules' own forwards come back when the block exits (errors included).

    A module gets the same forward object in every block with the same range (kept on
    `model`): torch.compile guards on the identity of a patched forward, so fresh ones would
    recompile a compiled forward's graphs in every `generate` call (`loop.compiled`)."""
    lo, hi = (int(r) for r in rows_range)
    patched = []
    if 1 <= lo <= hi and has_kernel():
        forwards = model.__dict__.setdefault("_specdec_small_linear_forwards", {})
        for module in model.modules():
            if _qualifies(module):
                module.forward = forwards.setdefault((module, lo, hi), partial(_forward, module, (lo, hi)))
                patched.append(module)
    try:
        yield
    finally:
        for module in patched:
            del module.forward


def linear_weights(module: torch.nn.Module) -> List[torch.Tensor]:
    """The weights `small_linears` would route: `module`'s fp32 and bf16 CPU `torch.nn.Linear` layers'."""
    return [m.weight for m in module.modules() if _qualifies(m)]


def _time_products(weights: Sequence[torch.Tensor], rows: int, ours: bool) -> float:
    """Seconds of one product of `rows` random rows with every weight, one way."""
    inputs = {}
    for w in weights:
        if (w.shape[1], w.dtype) not in inputs:
            inputs[w.shape[1], w.dtype] = torch.randn(rows, w.shape[1], dtype=w.dtype, device=w.device)
    start = time.perf_counter()
    for w in weights:
        x = inputs[w.shape[1], w.dtype]
        small_linear(x, w) if ours else F.linear(x, w)
    return time.perf_counter() - start


@torch.inference_mode()
def choose_small_linear_rows(weights: Sequence[torch.Tensor], counts: Sequence[int] = LAYOUT_ROWS,
                             repeats: int = 3) -> Tuple[int, int]:
    """The row counts at which products with `weights` (fp32 or bf16, CPU) run with
    `small_linear` rather than `F.linear`: (lo, hi), from the first count at which ours won (at
    least 3% faster) through the last win of the run after it, a run that a loss of up to 10%
    does not break and a loss of more than 10% ends, extended down to fewer rows by the same
    rule (best of `repeats` interleaved rounds, after
    a warm-up round); `(0, 0)` if none won, there are no weights, or no kernel.
    Small losses do not break the run because at 1-2 rows both are bound by reading the weights
    and measure within noise of each other: a 1.04x at 2 rows read as a loss once cut a run of
    1.5x wins at 4-16 rows down to 1-1 (a calibration on a shared 2-core machine), and so did a
    calibration under load after the fused decoder layers arrived, which then ran 2-row steps
    op by op at 37 ms against 23 for 1 row. A wrong choice at a near-tie costs a few %; one
    at 4-16 rows costs 1.4-1.8x."""
    weights = list(weights)
    counts = sorted(int(c) for c in counts)
    if not weights or not counts or not has_kernel():
        return NEVER
    plain, ours = [math.inf] * len(counts), [math.inf] * len(counts)
    for round_ in range(repeats + 1):
        for i, n in enumerate(counts):
            a, b = _time_products(weights, n, False), _time_products(weights, n, True)
            if round_ > 0:  # round 0 warms up (first-touch allocations, caches)
                plain[i], ours[i] = min(plain[i], a), min(ours[i], b)
    won = [b <= _MARGIN * a for a, b in zip(plain, ours)]
    lost = [b > a * _LOSS for a, b in zip(plain, ours)]
    if not any(won):
        return NEVER
    first = won.index(True)
    last = first
    for i in range(first + 1, len(counts)):
        if lost[i]:
            break
        if won[i]:
            last = i
    # Below the first win, the same rule: fewer rows than a win read the same weights, and a
    # near-tie there is noise (a calibration under load once found 1 row a 2% loss and left
    # plain decoding on F.linear, 1.6x slower than ours there on an AVX2 machine).
    while first > 0 and not lost[first - 1]:
        first -= 1
    return counts[first], counts[last]
