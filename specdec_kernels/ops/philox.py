"""Counter-based random numbers (Philox4x32-10) in plain torch.

Every random number `verify` uses is a pure function of (seed, node, purpose, index):
no generator state, so a row's draws do not depend on the batch it sits in, and a
CUDA or Triton kernel can reproduce the same numbers bit for bit. The layout is:

    key     = (seed & 0xffffffff, seed >> 32)         # the row's int64 seed
    counter = (index, node, purpose, 0)                # index: vocabulary id or 0
    word    = philox4x32_10(counter, key)[0]
    uniform = ((word >> 9) + 0.5) * 2**-23             # strictly inside (0, 1), exact in fp32

All arithmetic is done on int64 tensors holding 32-bit values, splitting each 32x32-bit
product into 16-bit halves so nothing overflows.
"""

import torch

from . import _checks

MASK32 = 0xFFFFFFFF
PHILOX_M0 = 0xD2511F53
PHILOX_M1 = 0xCD9E8D57
PHILOX_W0 = 0x9E3779B9
PHILOX_W1 = 0xBB67AE85

# `purpose` values: separate streams for separate decisions at the same node.
PURPOSE_ACCEPT = 0  # the uniform of the acceptance test of a drafted node
PURPOSE_SAMPLE = 1  # the exponentials of the race that samples a token at a node


def _mulhilo32(a: int, b: torch.Tensor):
    """(hi, lo) 32-bit halves of the 64-bit product a * b, for 32-bit values."""
    b_lo = b & 0xFFFF
    b_hi = b >> 16
    t0 = a * b_lo  # < 2**48
    t1 = a * b_hi  # < 2**48
    mid = t0 + ((t1 & 0xFFFF) << 16)  # < 2**49
    lo = mid & MASK32
    hi = (t1 >> 16) + (mid >> 32)
    return hi & MASK32, lo


def philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Philox4x32 with 10 rounds; all inputs are int64 tensors (broadcastable) of 32-bit values.

    Returns the four 32-bit output words as int64 tensors.
    """
    for _ in range(10):
        hi0, lo0 = _mulhilo32(PHILOX_M0, c0)
        hi1, lo1 = _mulhilo32(PHILOX_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = (k0 + PHILOX_W0) & MASK32
        k1 = (k1 + PHILOX_W1) & MASK32
    return c0, c1, c2, c3


def uniform(seed: torch.Tensor, node, purpose: int, index) -> torch.Tensor:
    """fp32 uniforms strictly in (0, 1), one per broadcast element of (seed, node, index).

    seed: int64 tensor; node, index: int64 tensors or ints. Result shape is the broadcast shape.
    """
    seed = torch.as_tensor(seed, dtype=torch.int64)
    device = seed.device
    node = torch.as_tensor(node, dtype=torch.int64, device=device)
    index = torch.as_tensor(index, dtype=torch.int64, device=device)
    zero = torch.zeros((), dtype=torch.int64, device=device)
    c0, c1, c2, c3, k0, k1 = torch.broadcast_tensors(
        index & MASK32, node & MASK32, zero + purpose, zero, seed & MASK32, (seed >> 32) & MASK32
    )
    word = philox4x32_10(c0, c1, c2, c3, k0, k1)[0]
    return ((word >> 9).to(torch.float32) + 0.5) * (2.0 ** -23)


def seeds_from_int(seed: int, batch_size: int, device) -> torch.Tensor:
    """Per-row int64 seeds derived from one int seed: row b gets its own stream.

    The derivation is itself a Philox draw (key = seed, counter = (b, 0, 2, 0)), so rows are
    decorrelated and an int seed behaves like passing a tensor of unrelated per-row seeds.
    """
    seed = seed & 0xFFFFFFFFFFFFFFFF
    # torch.full, not torch.tensor: a fill kernel, which CUDA-graph capture records (a host copy it refuses)
    seed = torch.full((), seed - (1 << 64) if seed >= 1 << 63 else seed, dtype=torch.int64, device=device)
    return _row_seeds_op(seed, batch_size)


# An op of its own, opaque to torch.compile: traced inline, an int seed makes the 10 Philox
# rounds a graph of constants, and inductor did not finish compiling it in 10 minutes (the
# same rounds on a seed tensor compile in seconds). Its fake implementation gives the shape.
@torch.library.custom_op("specdec_philox::row_seeds", mutates_args=())
def _row_seeds_op(seed: torch.Tensor, batch_size: int) -> torch.Tensor:
    rows = torch.arange(batch_size, dtype=torch.int64, device=seed.device)
    zero = torch.zeros_like(rows)
    w0, w1, _, _ = philox4x32_10(rows, zero, zero + 2, zero, (seed & MASK32).expand_as(rows), ((seed >> 32) & MASK32).expand_as(rows))
    return (w1 << 32) | w0


@_row_seeds_op.register_fake
def _(seed, batch_size):
    return seed.new_empty(batch_size)


def row_seeds(seed, batch_size: int, device) -> torch.Tensor:
    """int64 [B] per-row seeds on `device`, from what a caller passes as `seed`.

    seed: None (a fresh random int64 from torch's global generator, then as an int), an int
    (`seeds_from_int`: each row its own stream), or an int64 [B] tensor on `device` (used as
    given: row b's seed, so a row's draws do not depend on the batch it is in).
    """
    if seed is None:
        seed = int(torch.randint(-(2**63), 2**63 - 1, (), dtype=torch.int64))
    if isinstance(seed, torch.Tensor):
        want = device if isinstance(device, torch.device) else torch.device(device)
        got = seed.device
        if not (seed.dim() == 1 and seed.dtype == torch.int64 and seed.shape[0] == batch_size and got == want):
            _checks.tensor("seed", seed, dims=1, dtypes=(torch.int64,))
            _checks.shape("seed", seed, (batch_size,))
            if got.type != want.type or (want.index is not None and got.index != want.index):
                _checks.fail("seed", f"expected a tensor on {device} (like target_logits), got {got}")
        return seed
    _checks.int_arg("seed", seed)
    return seeds_from_int(seed, batch_size, device)
