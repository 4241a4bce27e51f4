"""Few-row linears on a CPU: the weight-major product.

A verify forward multiplies every weight matrix by a handful of rows (the tree's tokens,
B x T of them). That is a bandwidth-bound job: the weights are read once, whatever the row
count, so 2-16 rows should cost what one row costs. `F.linear` computes x @ W^T, and on some
CPU BLAS builds that shape runs far slower than its one-row case: with torch 2.13's MKL on
an AMD EPYC (AVX2, 2 threads), SmolLM2-135M's linears took ~55 ms for one row but ~90-100 ms
for 2-4 rows. The same product as (W @ x^T)^T, a tall matrix times a few columns, streams the
weights once and took ~43-46 ms for 2-4 rows there (12.5 GB/s, the machine's bandwidth floor).

Which layout is faster depends on the BLAS, the CPU, the dtype and the row count, so nothing
is assumed: `choose_weight_major_rows` times a module's own weights both ways and keeps the
most rows for which the weight-major product won at every measured count (0: never). The
cost model's calibration (`cost_model.calibrate`) makes that choice for the target and
`generate` runs the target inside `weight_major_linears(target, rows)`; head drafters make
it for their head (`heads.drafters`). The two layouts compute the same sums in
a different order (as any two BLAS kernels may): results agree to rounding, and greedy
outputs stay identical to HF's wherever they did before (tested against HF `generate`).
"""

import contextlib
import math
import time
from functools import partial
from typing import List, Sequence

import torch
import torch.nn.functional as F

LAYOUT_ROWS = (2, 4, 8, 16, 32)  # row counts at which the two layouts are compared
_MARGIN = 0.97  # weight-major must be at least 3% faster to be chosen (noise is not a win)


def weight_major_linear(x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` computed as (weight @ x^T)^T: x [..., K], weight [N, K],
    bias [N] or None -> [..., N], contiguous."""
    rows = x.reshape(-1, x.shape[-1])
    out = torch.mm(weight, rows.T).T.contiguous()
    if bias is not None:
        out += bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _forward(module: torch.nn.Linear, max_rows: int, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // max(x.shape[-1], 1)
    if 2 <= rows <= max_rows:
        return weight_major_linear(x, module.weight, module.bias)
    return F.linear(x, module.weight, module.bias)


@contextlib.contextmanager
def weight_major_linears(model: torch.nn.Module, max_rows: int):
    """Inside the block, every `torch.nn.Linear` of `model` (exactly that class: subclasses,
    quantized or sharded linears keep their own forward) computes inputs of 2 to `max_rows`
    rows with `weight_major_linear`, and any other input with `F.linear`. max_rows < 2: no
    change. The modules' own forwards come back when the block exits (errors included)."""
    max_rows = int(max_rows)
    patched = []
    if max_rows >= 2:
        for module in model.modules():
            if type(module) is torch.nn.Linear and "forward" not in module.__dict__:
                module.forward = partial(_forward, module, max_rows)
                patched.append(module)
    try:
        yield
    finally:
        for module in patched:
            del module.forward


def linear_weights(module: torch.nn.Module) -> List[torch.Tensor]:
    """The weights of `module`'s plain `torch.nn.Linear` layers (what `weight_major_linears` patches)."""
    return [m.weight for m in module.modules() if type(m) is torch.nn.Linear]


def _time_products(weights: Sequence[torch.Tensor], rows: int, weight_major: bool) -> float:
    """Seconds of one product of `rows` random rows with every weight, in one layout."""
    inputs = {}
    for w in weights:
        key = (w.shape[1], w.dtype, w.device)
        if key not in inputs:
            inputs[key] = torch.randn(rows, w.shape[1], dtype=w.dtype, device=w.device)
    start = time.perf_counter()
    for w in weights:
        x = inputs[(w.shape[1], w.dtype, w.device)]
        weight_major_linear(x, w) if weight_major else F.linear(x, w)
    return time.perf_counter() - start


@torch.inference_mode()
def choose_weight_major_rows(weights: Sequence[torch.Tensor], counts: Sequence[int] = LAYOUT_ROWS,
                             repeats: int = 3) -> int:
    """The most rows (of `counts`) for which products with `weights` ran at least 3% faster
    weight-major than with `F.linear` at every count up to it (best of `repeats`
    interleaved rounds, after one warm-up round); 0 if the first count did not, or no weights."""
    weights = list(weights)
    if not weights or not counts:
        return 0
    plain, major = [math.inf] * len(counts), [math.inf] * len(counts)
    for round_ in range(repeats + 1):
        for i, n in enumerate(counts):
            a, b = _time_products(weights, n, False), _time_products(weights, n, True)
            if round_ > 0:  # round 0 warms up (first-touch allocations, caches)
                plain[i], major[i] = min(plain[i], a), min(major[i], b)
    rows = 0
    for n, a, b in zip(counts, plain, major):
        if b > _MARGIN * a:
            break
        rows = n
    return rows
