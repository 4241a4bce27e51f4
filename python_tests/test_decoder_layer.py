"""`decoder_layer`: a Llama-family decoder layer's tree step in one CPU op (csrc/decoder_layer.cpp).

Against the plain-torch reference on fresh random layers (fp32 and bf16, GQA and MHA, with and
without biases and per-head q/k norms, ragged rows, random trees, bool and packed masks): the
returned hidden states and the cache writes agree to rounding (the products sum in another
order than `F.linear`); cache slots outside the tree are untouched. Bad input gets errors that
name the argument. `torch.library.opcheck` checks the registration (schema, fake, mutations).
"""

import pytest
import torch

from specdec_kernels.ops import decoder_layer as op
from specdec_kernels.ops.tree import pack_tree_mask, tree_mask

pytestmark = pytest.mark.skipif(not op.has_kernel(), reason="the compiled extension lacks decoder_layer")


def random_parents(gen, batch: int, nodes: int) -> torch.Tensor:
    parents = torch.full((batch, nodes), -1, dtype=torch.int64)
    for b in range(batch):
        for i in range(1, nodes):
            parents[b, i] = int(torch.randint(0, i, (), generator=gen))
    return parents


def make_case(seed: int, dtype=torch.float32, batch=3, nodes=5, width=64, heads=4, kv_heads=2, head_dim=16,
              inner=96, biases=False, qk_norm=False, capacity=48, packed=False):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    def norm_weight(n):
        return (1 + 0.2 * torch.randn(n, generator=gen)).to(dtype)

    s = width ** -0.5
    weights = [norm_weight(width), rand(heads * head_dim, width, scale=s), rand(heads * head_dim) if biases else None,
               rand(kv_heads * head_dim, width, scale=s), rand(kv_heads * head_dim) if biases else None,
               rand(kv_heads * head_dim, width, scale=s), rand(kv_heads * head_dim) if biases else None,
               norm_weight(head_dim) if qk_norm else None, norm_weight(head_dim) if qk_norm else None,
               rand(width, heads * head_dim, scale=(heads * head_dim) ** -0.5), rand(width) if biases else None,
               norm_weight(width), rand(inner, width, scale=s), rand(inner, width, scale=s),
               rand(width, inner, scale=inner ** -0.5)]
    hidden = rand(batch, nodes, width)
    positions = torch.randint(0, 200, (batch, nodes), generator=gen).float()
    freqs = positions[..., None] * (10000.0 ** (-torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.cat([freqs, freqs], -1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    k_cache, v_cache = rand(batch, capacity, kv_heads, head_dim), rand(batch, capacity, kv_heads, head_dim)
    seqlens = torch.randint(0, capacity - nodes + 1, (batch,), generator=gen).to(torch.int32)
    mask = tree_mask(random_parents(gen, batch, nodes))
    if packed:
        mask = pack_tree_mask(mask)
    return dict(hidden=hidden, cos=cos, sin=sin, weights=weights, k_cache=k_cache, v_cache=v_cache,
                tree_mask=mask, cache_seqlens=seqlens, scale=head_dim ** -0.5, eps=1e-6)


def run(case, backend, blas_rows=0):
    case = {k: ([w if w is None else w.clone() for w in v] if k == "weights" else
                v.clone() if torch.is_tensor(v) else v) for k, v in case.items()}
    out = op.decoder_layer(case["hidden"], case["cos"], case["sin"], case["weights"], case["k_cache"],
                           case["v_cache"], case["tree_mask"], case["cache_seqlens"], scale=case["scale"],
                           eps=case["eps"], blas_rows=blas_rows, backend=backend)
    return out, case["k_cache"], case["v_cache"]


CASES = {
    "llama": dict(),
    "mha_bias": dict(heads=4, kv_heads=4, biases=True),
    "qwen3_qk_norm": dict(qk_norm=True, head_dim=32, kv_heads=1),
    "one_node": dict(nodes=1, batch=1),
    "wide_tree_packed": dict(nodes=70, capacity=100, packed=True, batch=2),
    "odd_sizes": dict(width=72, inner=100, heads=3, kv_heads=3, head_dim=24, nodes=3),
    # a prefill chunk's rows: the element-wise steps split over the threads (kParallelElements)
    "many_rows_qk_norm": dict(batch=2, nodes=300, width=128, inner=256, capacity=320, qk_norm=True, packed=True),
}


@pytest.mark.parametrize("blas", (False, True), ids=("small_linear", "blas"))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=("fp32", "bf16"))
@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_the_reference(name, dtype, blas):
    """The op against the plain-torch reference, its products by small_linear's kernel or (blas:
    `blas_rows` at the step's row count, so the boundary itself takes torch's BLAS) by torch.mm."""
    for seed in range(2):
        case = make_case(seed * 1000 + hash(name) % 1000, dtype, **CASES[name])
        rows = case["hidden"].shape[0] * case["hidden"].shape[1]
        got, got_k, got_v = run(case, "cpu", blas_rows=rows if blas else rows + 1)
        want, want_k, want_v = run(case, "reference")
        tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.1, rtol=0.05)
        assert got.shape == want.shape and got.dtype == dtype
        torch.testing.assert_close(got, want, **tol)
        # bf16: a few elements may round to neighbouring values; most must agree closely
        if dtype == torch.bfloat16:
            close = torch.isclose(got.float(), want.float(), atol=0.02, rtol=0.02).float().mean()
            assert close > 0.97, f"only {close:.3f} of the outputs agree closely"
        torch.testing.assert_close(got_k, want_k, **tol)
        torch.testing.assert_close(got_v, want_v, **tol)
        # slots outside [seqlens[b], seqlens[b] + T) are untouched
        nodes = case["hidden"].shape[1]
        for b, start in enumerate(case["cache_seqlens"].tolist()):
            keep = torch.ones(case["k_cache"].shape[1], dtype=torch.bool)
            keep[start:start + nodes] = False
            assert torch.equal(got_k[b, keep], case["k_cache"][b, keep])
            assert torch.equal(got_v[b, keep], case["v_cache"][b, keep])


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=("fp32", "bf16"))
def test_the_threads_split_nothing_but_the_work(dtype):
    """A step of many rows splits its element-wise steps (norms, rotations, adds, the gated
    product) over torch's threads; each row is computed alone, so one thread and two give the
    same bits."""
    case = make_case(11, dtype=dtype, **CASES["many_rows_qk_norm"])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = run(case, "cpu")
        torch.set_num_threads(2)
        split = run(case, "cpu")
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(alone, split):
        assert torch.equal(a, b)


def test_the_values_are_written_exactly():
    """The values written are v = x W_v^T exactly as the layer computed them: the cpu
    backend's v slots equal a small_linear product of the same normed input. (The default
    model's width: at 64, torch's product of 15 rows sums k in order, as our packed-panel
    kernel does, and the two paths would agree bit for bit.)"""
    case = make_case(7, width=576)
    _, _, v_cache = run(case, "cpu")
    from specdec_kernels.ops.reference.decoder_layer import _rms_norm
    from specdec_kernels.ops.small_linear import small_linear

    x = _rms_norm(case["hidden"], case["weights"][0], case["eps"])
    v = small_linear(x, case["weights"][5]).view(3, 5, 2, 16)
    for b, start in enumerate(case["cache_seqlens"].tolist()):
        torch.testing.assert_close(v_cache[b, start:start + 5], v[b], atol=1e-6, rtol=1e-6)
    # blas_rows at or below the step's 15 rows: the product is torch's (torch.mm) instead
    _, _, kernel_cache = run(case, "cpu")
    _, _, v_cache = run(case, "cpu", blas_rows=15)
    v_blas = (x.reshape(15, -1) @ case["weights"][5].t()).view(3, 5, 2, 16)
    assert not torch.equal(v_blas, v)  # (the two kernels sum in different orders)
    written = torch.stack([v_cache[b, start:start + 5] for b, start in enumerate(case["cache_seqlens"].tolist())])
    by_kernel = torch.stack([kernel_cache[b, start:start + 5] for b, start in enumerate(case["cache_seqlens"].tolist())])
    torch.testing.assert_close(written, v_blas, atol=1e-6, rtol=1e-6)
    assert not torch.equal(written, by_kernel)  # the product took the other path
    # ... and lands nearer torch's product than ours, summed over every value (a row's largest
    # difference can tie: the op's normed input may differ from the reference's in the last bit)
    assert (written - v_blas).abs().sum() < (written - v).abs().sum()


def test_opcheck():
    case = make_case(3, batch=2, nodes=3)
    args = (case["hidden"], case["cos"], case["sin"], case["weights"], case["k_cache"], case["v_cache"],
            case["tree_mask"], case["cache_seqlens"], case["scale"], case["eps"])
    torch.library.opcheck(torch.ops.specdec.decoder_layer, args)
    torch.library.opcheck(torch.ops.specdec.decoder_layer, args + (1,))  # products on torch's BLAS
    with pytest.raises(ValueError, match="blas_rows"):
        run(case, "cpu", blas_rows=-1)


def test_bad_input_is_named():
    case = make_case(4)

    def call(**changes):
        c = {**case, **changes}
        return torch.ops.specdec.decoder_layer(c["hidden"], c["cos"], c["sin"], c["weights"], c["k_cache"],
                                               c["v_cache"], c["tree_mask"], c["cache_seqlens"], c["scale"], c["eps"])

    with pytest.raises(RuntimeError, match="weights must list 15"):
        call(weights=case["weights"][:-1])
    with pytest.raises(RuntimeError, match="q_proj is required"):
        call(weights=[case["weights"][0], None] + case["weights"][2:])
    with pytest.raises(RuntimeError, match="gate_proj must be a contiguous CPU tensor of hidden's dtype"):
        call(weights=case["weights"][:12] + [case["weights"][12].double()] + case["weights"][13:])
    with pytest.raises(RuntimeError, match="hidden must be float32 or bfloat16"):
        call(hidden=case["hidden"].double())
    with pytest.raises(RuntimeError, match="contiguous"):
        call(hidden=case["hidden"].transpose(0, 1).contiguous().transpose(0, 1))
    with pytest.raises(RuntimeError, match="must fit in the cache"):
        call(cache_seqlens=torch.tensor([0, 46, 0], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="cos and sin must be"):
        call(cos=case["cos"][:, :, :8])
    with pytest.raises(RuntimeError, match="k_cache and v_cache must be contiguous dense caches"):
        call(v_cache=case["v_cache"][:, :40])
    with pytest.raises(RuntimeError, match="k_cache must be a CPU tensor of hidden's dtype"):
        call(k_cache=case["k_cache"].bfloat16())
    with pytest.raises(RuntimeError, match="cos must be a CPU tensor of hidden's dtype"):
        call(cos=case["cos"].double())
    with pytest.raises(RuntimeError, match="q_bias must be"):
        call(weights=case["weights"][:2] + [torch.zeros(3)] + case["weights"][3:])
    with pytest.raises(ValueError, match="weights: expected 15"):
        op.decoder_layer(case["hidden"], case["cos"], case["sin"], case["weights"][:3], case["k_cache"],
                         case["v_cache"], case["tree_mask"], case["cache_seqlens"], scale=1.0, eps=1e-6)
