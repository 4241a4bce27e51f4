"""`rms_norm`: Llama's RMSNorm in one CPU op (csrc/rms_norm.cpp).

Against the plain-torch reference (transformers' `LlamaRMSNorm` arithmetic) on fresh random
inputs, fp32 and bf16, one weight or one per trailing group, contiguous or strided input: bf16
equal bit for bit where the sum of squares rounds alike (compared to one bf16 step), fp32 to
rounding. Also against transformers' module itself. Bad input gets errors that name what is
wrong; `torch.library.opcheck` checks the registration.
"""

import zlib

import pytest
import torch

from specdec_kernels.ops import rms_norm as op

pytestmark = pytest.mark.skipif(not op.has_kernel(), reason="the compiled extension lacks rms_norm")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape, groups", [((7,), 1), ((3, 5, 64), 1), ((2, 3, 2, 48), 2), ((4, 3, 33), 3), ((0, 16), 1)])
def test_matches_reference(dtype, shape, groups):
    gen = torch.Generator().manual_seed(zlib.crc32(repr((dtype, shape, groups)).encode()))
    x = (torch.randn(shape, generator=gen) * 3).to(dtype)
    weight_shape = shape[-1:] if groups == 1 else shape[-2:]
    weight = (1 + 0.3 * torch.randn(weight_shape, generator=gen)).to(dtype)
    eps = float(torch.rand((), generator=gen)) * 1e-3
    got = op.rms_norm(x, weight, eps)
    want = op.rms_norm(x, weight, eps, backend="reference")
    assert got.shape == x.shape and got.dtype == dtype and got.is_contiguous()
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    else:  # one rounding step at most, where the fp32 sums differ in their last bit
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-6)


def test_strided_input_and_transformers_module():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    gen = torch.Generator().manual_seed(0)
    base = torch.randn(4, 10, 96, generator=gen)
    x = base[:, ::2, 16:80]  # strided: the op reads it as it is
    norm = LlamaRMSNorm(64, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.2 * torch.randn(64, generator=gen))
        for dtype in (torch.float32, torch.bfloat16):
            module = norm.to(dtype)
            got = op.rms_norm(x.to(dtype), module.weight, module.variance_epsilon)
            want = module(x.to(dtype))
            tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=1e-6)
            torch.testing.assert_close(got.float(), want.float(), **tol)


def test_bad_input():
    x = torch.randn(2, 8)
    with pytest.raises(RuntimeError, match="both be float32 or both bfloat16"):
        op.rms_norm(x, torch.ones(8, dtype=torch.bfloat16), 1e-6)
    with pytest.raises(RuntimeError, match="both be float32 or both bfloat16"):
        op.rms_norm(x.half(), torch.ones(8).half(), 1e-6)
    with pytest.raises(RuntimeError, match="trailing dims"):
        op.rms_norm(x, torch.ones(7), 1e-6)
    with pytest.raises(RuntimeError, match="trailing dims"):
        op.rms_norm(x, torch.ones(3, 8), 1e-6)
    with pytest.raises(RuntimeError, match="weight must have 1 to"):
        op.rms_norm(x, torch.ones(1, 2, 8), 1e-6)
    with pytest.raises(RuntimeError, match="eps must be >= 0"):
        op.rms_norm(x, torch.ones(8), -1.0)
    with pytest.raises(ValueError, match="backend"):
        op.rms_norm(x, torch.ones(8), 1e-6, backend="cuda")


def test_opcheck():
    torch.library.opcheck(torch.ops.specdec.rms_norm, (torch.randn(3, 4, 24), torch.randn(24), 1e-5))
    torch.library.opcheck(torch.ops.specdec.rms_norm, (torch.randn(3, 2, 24).bfloat16(), torch.randn(2, 24).bfloat16(), 0.0))
